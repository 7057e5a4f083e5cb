"""Prefix caching: block hashes over token ids, the longest cached prefix of a new request, and
the ring snapshots that let it resume exactly after that prefix.

What a resume at a block boundary B needs (model.md §3, encoder-side replay):
- the paged compressed KV and index keys of [0, B): the cached blocks (ref-counted, shared);
- no compressor state: B is a multiple of the block size, so no ratio-2 group is pending;
- the Engram history: token ids, which the scheduler has;
- every layer's SWA ring over [B - window, B): not paged, per request. A *ring snapshot* taken
  when some request's rings held exactly those rows is restored into the new request's slot.

Which rings are exact depends on the tail-only prefill (`TailRule`): the encoder layers run every
prompt row, so their rings are exact at any boundary; the decoder layers' rings are exact only
where every decoder layer computed its kv (every row in `full` mode, from the prompt's end in
`staircase` mode, never under `bounded` floors). A snapshot records whether its decoder rings
are exact, and a hit uses it only where the new request will read them (`needs_decoder_rings`):
under `bounded` or `staircase` a long enough new tail never reads decoder rows below B, so an
encoder-exact snapshot resumes it exactly. Logits of a resumed request therefore equal those of
a run without the cache.

Keys: block i's hash chains the previous block's hash with block i's token ids; the chain starts
from a salt of everything else that changes the KV (model, block size, prefill mode). Blocks are
registered when computed; an unreferenced cached block stays in the pool as evictable (LRU) and
its snapshot goes with it when it is evicted. Snapshot ids are a fixed pool (device memory),
reserved when a plan asks the runner to save one and bound to the block hash when the step is
applied. Every request saves at every boundary it computes, so most snapshots are never used
(a unique suffix); eviction is a segmented LRU: a snapshot enters on probation and moves to
the protected segment (at most half the pool; its oldest falls back to probation) when a hit
uses it; saves evict from probation only and are skipped when it is empty, so a busy shared
prefix keeps its snapshot however many unique suffixes pass by.

With a host tier (`scheduler/host_tier.py`), an evicted block and an evicted snapshot move to
host slots instead of vanishing; with a store (`scheduler/store_tier.py`), blocks and some
snapshots are also written to disk as they are made. A hit may then continue through blocks
that are in host memory or in the store only: they are copied into fresh device blocks (and
such a snapshot into a device snapshot id) before the request's first forward.

With `replay_window` set (`prefix_resume="bounded"`) there are no snapshots: any cached
boundary resumes, and the scheduler starts the chunk that many rows below it (a replay that
rebuilds the rings approximately, see `ScheduledRequest.replay`).

Invariant: a hash maps to at most one block and a block to at most one hash; a bound snapshot's
hash is a cached block's or a host block's; every snapshot id is free, pending (in a plan) or
bound, exactly once.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from shoal.scheduler.block_pool import BlockPool
from shoal.scheduler.host_tier import HostTier, Transfer
from shoal.scheduler.store_tier import StoreTier
from shoal.scheduler.tail_rule import TailRule


@dataclass(frozen=True)
class PrefixCacheSpec:
    """Prefix caching settings for the KV manager: `num_snapshots` ring snapshots (device
    memory the runner reserved), the tail-only prefill's `rule`, and the hash chain's `salt`."""

    num_snapshots: int
    rule: TailRule
    salt: bytes = b""
    host_blocks: int = 0  # host tier: block slots (0: no host tier)
    host_snapshots: int = 0  # host tier: snapshot slots
    store: Any = None  # the persistent tier: a shoal.kvstore.KVStore (None: none)
    replay_window: int = 0  # > 0: resume by a bounded replay of this many rows, no snapshots


@dataclass
class PrefixCacheStats:
    """Counters of the cache (monotonic; the engine reports them)."""

    queries: int = 0  # admissions that looked up a prefix
    query_tokens: int = 0  # their tokens
    hit_tokens: int = 0  # tokens resumed from the cache instead of computed
    host_hit_tokens: int = 0  # of those, in blocks copied back from the host tier
    store_hit_tokens: int = 0  # of those, in blocks read from the store
    snapshots_saved: int = 0
    snapshot_evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True)
class Hit:
    """A resume point after `len(keys)` cached blocks: `block_ids[i]` is block i's device
    block, or -1 where it is in the host tier or the store only; restore device snapshot
    `snapshot`, or, when that is -1, the snapshot of the last key in `snapshot_tier`."""

    keys: tuple[bytes, ...] = ()
    block_ids: tuple[int, ...] = ()
    snapshot: int = -1
    snapshot_tier: str = ""  # "host" | "store" when `snapshot` is -1
    replay: bool = False  # resumed by a bounded replay instead (no snapshot)

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def num_loaded_blocks(self) -> int:
        """Blocks copied in from the host tier or the store."""
        return sum(1 for b in self.block_ids if b < 0)


@dataclass
class _Snapshot:
    decoder_exact: bool
    key: bytes | None = None  # the block hash it is bound to (None while pending)


@dataclass
class PrefixCache:
    """Hashes and snapshots over a `BlockPool` (which keeps cached blocks as evictable)."""

    pool: BlockPool
    block_size: int
    num_snapshots: int
    rule: TailRule
    salt: bytes = b""
    host_blocks: int = 0
    host_snapshots: int = 0
    store: Any = None
    replay_window: int = 0
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        if self.num_snapshots < 0:
            raise ValueError(f"num_snapshots={self.num_snapshots}: expected >= 0")
        self._root = hashlib.sha256(b"shoal-prefix-v1" + self.salt).digest()
        self._block_of: dict[bytes, int] = {}  # hash -> cached block
        self._hash_of: dict[int, bytes] = {}  # cached block -> hash
        self._snapshot_of: dict[bytes, int] = {}  # hash -> bound snapshot id
        # bound snapshot ids, least recently used first: never hit yet / hit at least once
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._snapshots: dict[int, _Snapshot] = {}  # pending and bound
        self._free_snapshots = list(range(self.num_snapshots - 1, -1, -1))  # pop -> lowest
        self._pending: dict[bytes, str] = {}  # hash -> the running request computing it
        self._transfers: list[Transfer] = []  # of the plan being built, in order
        self.host = HostTier(self.host_blocks, self.host_snapshots, self._transfers) \
            if self.host_blocks else None
        self.store_tier = StoreTier(self.store, self._transfers) \
            if self.store is not None else None

    # ---- hashing --------------------------------------------------------------------------
    def hashes(self, tokens: list[int], known: list[bytes], num_blocks: int) -> list[bytes]:
        """The chained hashes of the first `num_blocks` full blocks of `tokens`, extending
        `known` (a request's hashes so far) in place."""
        bs = self.block_size
        while len(known) < num_blocks:
            i = len(known)
            parent = known[-1] if known else self._root
            ids = array("q", tokens[i * bs:(i + 1) * bs]).tobytes()
            known.append(hashlib.sha256(parent + ids).digest())
        return known[:num_blocks]

    # ---- lookup ---------------------------------------------------------------------------
    def find(self, hashes: list[bytes], prefill_len: int) -> Hit:
        """The longest resumable prefix: cached blocks 0..j-1 whose boundary j * block_size
        has a snapshot usable for a prefill of `prefill_len` tokens (at least one token is
        always left to compute)."""
        host, store = self.host, self.store_tier
        if store is not None:
            store.begin_lookup()
        cached = 0
        for key in hashes:
            if key not in self._block_of and (host is None or key not in host.blocks) and (
                    store is None or not store.has_block(key)):
                break
            cached += 1
        for j in range(cached, 0, -1):
            boundary, key = j * self.block_size, hashes[j - 1]
            if boundary >= prefill_len:
                continue
            if self.replay_window:  # bounded replay: any cached boundary
                if not self._readable(hashes[:j]):
                    continue
                ids = tuple(self._block_of.get(k, -1) for k in hashes[:j])
                return Hit(tuple(hashes[:j]), ids, replay=True)
            sid, tier = self._snapshot_of.get(key), ""
            if sid is not None:
                exact = self._snapshots[sid].decoder_exact
            elif not self._can_reserve():
                continue
            elif host is not None and key in host.snapshots:
                exact, tier = host.snapshot_exact[key], "host"
            elif store is not None and (found := store.snapshot(key)) is not None:
                exact, tier = found[0], "store"
            else:
                continue
            if self.rule.needs_decoder_rings(boundary, prefill_len) and not exact:
                continue
            if not self._readable(hashes[:j]):
                continue  # a block only the store holds did not read back
            ids = tuple(self._block_of.get(k, -1) for k in hashes[:j])
            if sid is None:
                return Hit(tuple(hashes[:j]), ids, -1, tier)
            if sid in self._probation and self.store_tier is not None:  # its first hit
                self.store_tier.persist_snapshot(key, sid, exact)
            self._protect(sid)
            return Hit(tuple(hashes[:j]), ids, sid)
        return Hit()

    def _protect(self, sid: int) -> None:
        """A hit used snapshot `sid`: most recently used in the protected segment, whose
        oldest falls back to probation past half the pool."""
        self._probation.pop(sid, None)
        self._protected[sid] = None
        self._protected.move_to_end(sid)
        if len(self._protected) > self.num_snapshots // 2:
            oldest, _ = self._protected.popitem(last=False)
            self._probation[oldest] = None

    def _can_reserve(self) -> bool:
        return bool(self._free_snapshots or self._probation)

    def _readable(self, keys: list[bytes]) -> bool:
        """Every key is on the device, in the host tier, or reads back from the store."""
        host, store = self.host, self.store_tier
        return all(k in self._block_of or (host is not None and k in host.blocks)
                   or store.block(k) is not None for k in keys)

    def load(self, hit: Hit, block_ids: list[int]) -> int:
        """Copy the hit's blocks that are not on the device into `block_ids` (fresh device
        blocks, one per -1 in the hit) and a snapshot from the host or the store into a device
        id; returns the snapshot id to restore."""
        fresh = iter(block_ids)
        host, store = self.host, self.store_tier
        for key, block_id in zip(hit.keys, hit.block_ids, strict=True):
            if block_id < 0:
                target = next(fresh)
                in_host = host is not None and key in host.blocks
                self.register(key, target, persist=False)
                if in_host:
                    host.block_in(key, target)
                    self.stats.host_hit_tokens += self.block_size
                else:
                    store.load_block(key, target)
                    self.stats.store_hit_tokens += self.block_size
        if not hit.snapshot_tier:
            return hit.snapshot
        key = hit.keys[-1]
        if hit.snapshot_tier == "host":
            sid = self.reserve_snapshot(host.snapshot_exact[key])
            assert sid >= 0, "find() checked that a snapshot id can be reserved"
            host.snapshot_in(key, sid)
        else:
            sid = self.reserve_snapshot(store.snapshot(key)[0])
            assert sid >= 0, "find() checked that a snapshot id can be reserved"
            store.load_snapshot(key, sid)
        self._snapshots[sid].key = key
        self._snapshot_of[key] = sid
        self._protect(sid)
        return sid

    def is_pending(self, key: bytes) -> bool:
        """A running request is computing the block of `key` (a request needing it next waits
        for it rather than computing it twice)."""
        return key in self._pending

    def set_pending(self, request_id: str, keys: list[bytes]) -> None:
        for key in keys:
            if key not in self._block_of:
                self._pending.setdefault(key, request_id)

    def clear_pending(self, request_id: str, keys: list[bytes]) -> None:
        for key in keys:
            if self._pending.get(key) == request_id:
                del self._pending[key]

    def count_admission(self, hit: Hit, prefill_len: int) -> None:
        self.stats.queries += 1
        self.stats.query_tokens += prefill_len
        self.stats.hit_tokens += hit.num_blocks * self.block_size

    def cached_blocks(self) -> list[int]:
        """The device blocks that hold a registered key (ascending)."""
        return sorted(self._hash_of)

    def has_snapshot(self, key: bytes) -> bool:
        return key in self._snapshot_of

    # ---- registration ---------------------------------------------------------------------
    def register(self, key: bytes, block_id: int, persist: bool = True) -> None:
        """Block `block_id` (used, fully computed) holds the content of `key` (written to the
        store too, if there is one). A hash already held by another block keeps that block
        (this one stays private to its request)."""
        self._pending.pop(key, None)
        if key in self._block_of or block_id in self._hash_of:
            return
        self._block_of[key] = block_id
        self._hash_of[block_id] = key
        self.pool.mark_cached(block_id)
        if persist and self.store_tier is not None:
            self.store_tier.persist_block(key, block_id)

    def drain(self) -> tuple[Transfer, ...]:
        """The transfers of the plan being built (the scheduler calls this once per plan)."""
        out = tuple(self._transfers)
        self._transfers.clear()
        return out

    def on_evict(self, block_id: int) -> None:
        """The pool reuses a cached block: move it to the host tier, or forget its hash and
        its snapshots (and those of a key the host tier evicts for it)."""
        key = self._hash_of.pop(block_id)
        del self._block_of[key]
        gone = key if self.host is None else self.host.block_out(key, block_id)
        if gone is not None:
            self._forget(gone)

    def _forget(self, key: bytes) -> None:
        """`key` left every tier: so do its snapshots."""
        sid = self._snapshot_of.pop(key, None)
        if sid is not None:
            self._release(sid)
        if self.host is not None:
            self.host.forget(key)

    # ---- snapshots ------------------------------------------------------------------------
    def reserve_snapshot(self, decoder_exact: bool) -> int:
        """A snapshot id for the runner to save into (-1 if none is free or on probation)."""
        if not self._free_snapshots and self._probation:
            sid, _ = self._probation.popitem(last=False)
            evicted = self._snapshots.pop(sid)
            del self._snapshot_of[evicted.key]
            if self.host is not None:  # (the copy out precedes this step's save into sid)
                self.host.snapshot_out(evicted.key, sid, evicted.decoder_exact)
            self.stats.snapshot_evictions += 1
            self._free_snapshots.append(sid)
        if not self._free_snapshots:
            return -1
        sid = self._free_snapshots.pop()
        self._snapshots[sid] = _Snapshot(decoder_exact)
        return sid

    def bind_snapshot(self, sid: int, key: bytes | None, persist: bool = False) -> None:
        """The step that saved `sid` was applied: bind it to the cached block `key` (and write
        it to the store if `persist`), or release it (None, a block that is not cached, or a
        hash that has a snapshot already)."""
        if key is None or key not in self._block_of or key in self._snapshot_of \
                or (self.host is not None and key in self.host.snapshots):
            self._release(sid)
            return
        self._snapshots[sid].key = key
        self._snapshot_of[key] = sid
        self._probation[sid] = None
        self.stats.snapshots_saved += 1
        if persist and self.store_tier is not None:
            self.store_tier.persist_snapshot(key, sid, self._snapshots[sid].decoder_exact)

    def _release(self, sid: int) -> None:
        self._snapshots.pop(sid)
        self._probation.pop(sid, None)
        self._protected.pop(sid, None)
        self._free_snapshots.append(sid)

    def drop_all(self) -> None:
        """Forget every cached block, host entry and bound snapshot (an interrupted plan's
        copies and paged writes may never have run, so their contents are unknown)."""
        self.pool.uncache_all()
        self._block_of.clear()
        self._hash_of.clear()
        for sid in list(self._snapshot_of.values()):
            self._release(sid)
        self._snapshot_of.clear()
        self._transfers.clear()
        if self.host is not None:
            self.host = HostTier(self.host_blocks, self.host_snapshots, self._transfers)

    def check_invariants(self) -> None:
        assert len(self._block_of) == len(self._hash_of)
        for key, block_id in self._block_of.items():
            assert self._hash_of[block_id] == key and self.pool.is_cached(block_id)
        host = self.host
        for key, sid in self._snapshot_of.items():
            assert key in self._block_of or (host is not None and key in host.blocks)
            assert self._snapshots[sid].key == key
        assert self._probation.keys().isdisjoint(self._protected)
        assert len(self._probation) + len(self._protected) == len(self._snapshot_of)
        ids = list(self._snapshots) + self._free_snapshots
        assert sorted(ids) == list(range(self.num_snapshots)), "a snapshot id leaked"
        if host is not None:
            host.check_invariants()
            assert all(k in self._block_of or k in host.blocks for k in host.snapshot_exact)
