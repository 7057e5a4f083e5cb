"""The host-memory tier of the prefix cache: cached blocks and ring snapshots evicted from the
device move to host slots (pinned memory the runner holds) and come back when a hit needs them.

Owns which key sits in which host slot (an LRU per kind) and `Transfer`, the plain-data copy
the next plan carries (the runner runs a plan's transfers, in order, on its stream before the
step's forward, so an eviction's copy out precedes the new owner's writes, and a copy in
precedes the reads). The scheduler side never touches the bytes, except the store tier's reads
(`store_tier.py`), which travel in the plan.

Invariant: a key is in at most one host slot per kind; every slot is free or holds one key.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BLOCK_OUT, BLOCK_IN, SNAPSHOT_OUT, SNAPSHOT_IN = "block_out", "block_in", "snapshot_out", \
    "snapshot_in"
# the store tier: write a device block / snapshot to the store under `key`; load `data` into it
BLOCK_PERSIST, SNAPSHOT_PERSIST = "block_persist", "snapshot_persist"
BLOCK_LOAD, SNAPSHOT_LOAD = "block_load", "snapshot_load"


@dataclass(frozen=True)
class Transfer:
    """Copy device block / snapshot `device` to host slot `host` (`*_out`) or back (`*_in`);
    or write it to the store under `key`, after the header `data` (`*_persist`), or fill it
    with `data` (`*_load`)."""

    kind: str
    device: int
    host: int = -1
    key: bytes = b""
    data: bytes | None = None


class SlotLRU:
    """`capacity` host slots keyed by content key, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity={capacity}: expected >= 0")
        self.capacity = capacity
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def get(self, key: bytes) -> int | None:
        """The key's slot (marked recently used), or None."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
        return slot

    def put(self, key: bytes, held: frozenset[bytes] = frozenset()) -> tuple[int, bytes | None]:
        """A slot for `key` (its own if present): (slot, the key evicted for it or None), never
        evicting a `held` key; (-1, None) when every slot is held (or there are none)."""
        if key in self._slot_of:
            return self.get(key), None
        evicted = None
        if not self._free:
            evicted = next((k for k in self._slot_of if k not in held), None)
            if evicted is None:
                return -1, None
            self._free.append(self._slot_of.pop(evicted))
            self.evictions += 1
        slot = self._free.pop()
        self._slot_of[key] = slot
        return slot, evicted

    def pop(self, key: bytes) -> int | None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def check_invariants(self) -> None:
        slots = list(self._slot_of.values()) + self._free
        assert sorted(slots) == list(range(self.capacity)), "a host slot leaked"


class HostTier:
    """Host slots for `num_blocks` blocks and `num_snapshots` ring snapshots."""

    def __init__(self, num_blocks: int, num_snapshots: int,
                 transfers: list[Transfer]) -> None:
        self.blocks = SlotLRU(num_blocks)
        self.snapshots = SlotLRU(num_snapshots)
        self.snapshot_exact: dict[bytes, bool] = {}  # host snapshot key -> decoder_exact
        self._transfers = transfers  # the prefix cache's list for the plan being built
        self.blocks_in = 0  # blocks copied back to the device for hits (stats)
        # keys of the hit being loaded: no eviction while its blocks are allocated
        self.held: frozenset[bytes] = frozenset()

    def block_out(self, key: bytes, block_id: int) -> bytes | None:
        """Keep evicted device block `block_id` (content `key`) in a host slot; returns the key
        the host evicted for it (gone from every tier), if any. A key the host still holds (a
        block copied back for a hit) needs no copy."""
        if key in self.blocks:
            self.blocks.get(key)
            return None
        slot, evicted = self.blocks.put(key, self.held)
        if slot < 0:
            return key
        self._transfers.append(Transfer(BLOCK_OUT, block_id, slot))
        return evicted

    def block_in(self, key: bytes, block_id: int) -> None:
        slot = self.blocks.get(key)
        assert slot is not None, "block_in of a key not in the host tier"
        self._transfers.append(Transfer(BLOCK_IN, block_id, slot))
        self.blocks_in += 1

    def snapshot_out(self, key: bytes, sid: int, decoder_exact: bool) -> None:
        slot, evicted = self.snapshots.put(key, self.held)
        if slot < 0:
            return
        if evicted is not None:
            del self.snapshot_exact[evicted]
        self.snapshot_exact[key] = decoder_exact
        self._transfers.append(Transfer(SNAPSHOT_OUT, sid, slot))

    def snapshot_in(self, key: bytes, sid: int) -> None:
        slot = self.snapshots.get(key)
        assert slot is not None, "snapshot_in of a key not in the host tier"
        self._transfers.append(Transfer(SNAPSHOT_IN, sid, slot))

    def forget(self, key: bytes) -> None:
        """`key` left every tier: drop its host snapshot."""
        if self.snapshots.pop(key) is not None:
            del self.snapshot_exact[key]

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        self.snapshots.check_invariants()
        assert set(self.snapshot_exact) == set(self.snapshots._slot_of)
