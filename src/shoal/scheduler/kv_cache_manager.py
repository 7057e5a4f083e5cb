"""Per-request KV resources: one block table (paged global KV) and one request slot (fixed state).

Owns: `KVCacheManager`, the only writer of `Request.block_ids` and `Request.slot`.

- Paged global KV (compressed-KV and index-K rows of the kv-source layers): a request's
  `block_ids[i]` holds context positions `[i * block_size, (i + 1) * block_size)` in every source
  layer (a source with ratio r stores `block_size // r` rows of that block).
- Request slots (`num_slots` of them): per-request fixed device state (SWA rings of every layer
  incl. the draft layers, compressor pending groups). Taken on admission, returned on
  finish / preemption; the lowest free slot is taken first.

- Prefix caching (optional, `scheduler/prefix_cache.py`): computed full blocks are registered
  by hash (`register_computed`) and outlive their requests as evictable blocks; a new request
  may start from a cached prefix (`find_prefix`, then `allocate(..., hit=)`), sharing those
  blocks by reference count.

Invariant: a request holding resources has a slot and exactly
`ceil(covered_tokens / block_size)` blocks, where covered_tokens >= num_computed_tokens; every
block and slot is returned exactly once (`free`), so an idle manager has all blocks and slots free
(cached blocks count as free: evictable).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from shoal.scheduler.block_pool import BlockPool
from shoal.scheduler.prefix_cache import Hit, PrefixCache, PrefixCacheSpec
from shoal.scheduler.request import Request


@dataclass(frozen=True)
class KVCacheUsage:
    num_blocks: int
    num_free_blocks: int
    num_slots: int
    num_free_slots: int

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def block_usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


class KVCacheManager:
    """Block tables and slots for the requests that currently hold resources."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int,
                 prefix: PrefixCacheSpec | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: expected an integer >= 1")
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: expected an integer >= 1")
        self.block_size = block_size
        self.num_slots = num_slots
        self.pool = BlockPool(num_blocks)
        self.prefix: PrefixCache | None = None
        if prefix is not None:
            self.prefix = PrefixCache(self.pool, block_size, prefix.num_snapshots, prefix.rule,
                                      prefix.salt, prefix.host_blocks, prefix.host_snapshots,
                                      prefix.store, prefix.replay_window)
            self.pool.on_evict = self.prefix.on_evict
        self._free_slots = list(range(num_slots))  # min-heap
        self._holders: dict[str, Request] = {}
        # ring snapshots the outstanding plan saves: (request, boundary, snapshot id)
        self._saves: list[tuple[Request, int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` context positions."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int,
                       num_lookahead_tokens: int = 0) -> int:
        """Blocks `allocate` would add so that the table covers computed + new (+ lookahead)."""
        target = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        return max(0, self.blocks_for_tokens(target) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int,
                     num_lookahead_tokens: int = 0, hit: Hit | None = None) -> bool:
        """True if `allocate` would succeed now (blocks, and a slot if the request has none).
        With a prefix `hit` (a request holding nothing yet), `num_new_tokens` count from the
        hit's boundary, and hit blocks that are evictable count against the free ones."""
        if request.slot is None and not self._free_slots:
            return False
        if hit is None or not hit.block_ids:
            need = self.num_new_blocks(request, num_new_tokens, num_lookahead_tokens)
            return need <= self.pool.num_free
        n_hit = len(hit.block_ids)
        need = self.blocks_for_tokens(n_hit * self.block_size + num_new_tokens
                                      + num_lookahead_tokens) - n_hit
        # revived evictable blocks and fresh blocks for host-resident ones use free blocks
        revived = sum(1 for b in hit.block_ids if b < 0 or self.pool.ref_count(b) == 0)
        return max(0, need) + revived <= self.pool.num_free

    def allocate(self, request: Request, num_new_tokens: int,
                 num_lookahead_tokens: int = 0, hit: Hit | None = None) -> list[int]:
        """Grow the request's table to cover computed + new tokens; take a slot if it has none.
        With a prefix `hit`, the table starts with the hit's cached blocks (the caller sets
        `num_computed_tokens` to the hit's boundary first).

        Returns the newly added block ids (ascending, lowest free first). Raises
        `BlockPoolError` / RuntimeError if called when `can_allocate` is False.
        """
        if hit is not None and hit.block_ids:
            if request.block_ids:
                raise RuntimeError(f"allocate({request.request_id!r}) with a prefix hit, but "
                                   "it already holds blocks")
            for block_id in hit.block_ids:
                if block_id >= 0:  # first, so that allocating below cannot evict them
                    self.pool.take(block_id)
            host = self.prefix.host
            if host is not None:
                host.held = frozenset(hit.keys)  # evictions below must not take them
            fresh = self.pool.allocate(hit.num_loaded_blocks)
            request.restore_snapshot = self.prefix.load(hit, fresh)
            if host is not None:
                host.held = frozenset()
            fresh_iter = iter(fresh)
            request.block_ids = [b if b >= 0 else next(fresh_iter) for b in hit.block_ids]
            request.num_registered_blocks = len(hit.block_ids)
        if not self.can_allocate(request, num_new_tokens, num_lookahead_tokens):
            raise RuntimeError(f"allocate({request.request_id!r}, {num_new_tokens}): "
                               "not enough free blocks or slots (check can_allocate first)")
        if request.slot is None:
            request.slot = heapq.heappop(self._free_slots)
        self._holders[request.request_id] = request
        new_ids = self.pool.allocate(
            self.num_new_blocks(request, num_new_tokens, num_lookahead_tokens))
        request.block_ids.extend(new_ids)
        return new_ids

    # ---- prefix caching ---------------------------------------------------------------------
    def find_prefix(self, request: Request) -> Hit | None:
        """The longest resumable cached prefix of a request that holds nothing yet (None when
        prefix caching is off or the request opted out)."""
        if self.prefix is None or not request.cache_prefix:
            return None
        n = request.num_tokens
        count = (n - 1) // self.block_size
        if len(request.block_hashes) < count:  # (a waiting head is looked up every step)
            self.prefix.hashes(request.all_token_ids(), request.block_hashes, count)
        return self.prefix.find(request.block_hashes[:count], n)

    def admitted(self, request: Request, hit: Hit | None) -> None:
        """Count the admission, and mark the known blocks the request will compute as pending
        (a request that needs them next waits for them)."""
        if hit is None:
            return
        self.prefix.count_admission(hit, request.num_tokens)
        self.prefix.set_pending(request.request_id,
                                request.block_hashes[len(hit.block_ids):])

    def waits_for_prefix(self, request: Request, hit: Hit | None) -> bool:
        """True if the block right after `hit` is being computed by a running request: the
        request then waits (a step or a few) and resumes after it instead of computing it too."""
        if hit is None:
            return False
        n_hit = len(hit.block_ids)
        hashes = request.block_hashes
        return n_hit < len(hashes) and self.prefix.is_pending(hashes[n_hit])

    def drain_transfers(self) -> tuple:
        """The prefix cache's transfers (host tier, store) for the plan being built."""
        return self.prefix.drain() if self.prefix is not None else ()

    def snapshot_saves(self, request: Request, start: int,
                       end: int) -> tuple[tuple[int, int], ...]:
        """(boundary, snapshot id) for each block boundary in (start, end] of a chunk being
        planned that has no snapshot yet, the latest first while ids last (the longest
        resume); ids are reserved now and bound by `bind_snapshots` when the plan is applied."""
        prefix = self.prefix
        if prefix is None or not request.cache_prefix or prefix.replay_window:
            return ()
        bs = self.block_size
        saves = []
        for boundary in range(end // bs * bs, start, -bs):
            index = boundary // bs - 1
            if index < len(request.block_hashes) and prefix.has_snapshot(
                    request.block_hashes[index]):
                continue
            sid = prefix.reserve_snapshot(
                prefix.rule.decoder_rings_exact(boundary, request.prefill_len))
            if sid < 0:
                break
            saves.append((boundary, sid))
            self._saves.append((request, boundary, sid))
        return tuple(saves)

    def bind_snapshots(self) -> None:
        """Bind the snapshots of the plan being applied to their blocks' hashes (released where
        the request no longer holds the boundary's block: rejected drafts, a finish or an
        abort before the step was applied). The prompt's last boundary, where the same prompt
        resumes, is also persisted."""
        saves, self._saves = self._saves, []
        for request, boundary, sid in saves:
            index = boundary // self.block_size - 1
            key = None
            if (request.num_computed_tokens >= boundary and index < len(request.block_hashes)
                    and index < request.num_registered_blocks):
                key = request.block_hashes[index]
            last = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
            self.prefix.bind_snapshot(sid, key, persist=boundary == last)

    def register_computed(self, request: Request) -> None:
        """Register the request's fully computed blocks (their tokens are all known)."""
        if self.prefix is None or not request.cache_prefix:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if full <= request.num_registered_blocks:
            return
        hashes = self.prefix.hashes(request.all_token_ids(), request.block_hashes, full)
        for i in range(request.num_registered_blocks, full):
            self.prefix.register(hashes[i], request.block_ids[i])
        request.num_registered_blocks = full

    def free(self, request: Request) -> list[int]:
        """Return every block and the slot of `request`; returns the block ids released."""
        if self.prefix is not None:
            self.prefix.clear_pending(request.request_id, request.block_hashes)
        released = self.pool.free(reversed(request.block_ids)) if request.block_ids else []
        request.block_ids = []
        request.num_registered_blocks = 0
        if request.slot is not None:
            heapq.heappush(self._free_slots, request.slot)
            request.slot = None
        self._holders.pop(request.request_id, None)
        return released

    def usage(self) -> KVCacheUsage:
        return KVCacheUsage(num_blocks=self.pool.num_blocks, num_free_blocks=self.pool.num_free,
                            num_slots=self.num_slots, num_free_slots=len(self._free_slots))

    def check_invariants(self) -> None:
        """Full consistency check of pool, slots and holders (tests)."""
        self.pool.check_invariants()
        if self.prefix is not None:
            self.prefix.check_invariants()
        held_blocks: dict[int, int] = {}
        held_slots = set()
        for req in self._holders.values():
            assert req.slot is not None, f"{req.request_id} holds blocks without a slot"
            assert req.slot not in held_slots, f"slot {req.slot} held twice"
            held_slots.add(req.slot)
            assert len(req.block_ids) >= self.blocks_for_tokens(req.num_computed_tokens)
            for block_id in req.block_ids:
                held_blocks[block_id] = held_blocks.get(block_id, 0) + 1
        for block_id, count in held_blocks.items():
            assert self.pool.ref_count(block_id) == count, f"block {block_id} ref mismatch"
        assert len(held_blocks) == self.pool.num_used, "a used block has no holder"
        assert held_slots.isdisjoint(self._free_slots)
        assert len(held_slots) + len(self._free_slots) == self.num_slots
