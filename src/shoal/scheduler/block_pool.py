"""Fixed pool of KV block ids with reference counts.

Owns: which of the `num_blocks` page ids are free, and how many holders each used block has.
One block id names the same page in every kv-source layer's compressed-KV and index-K planes
(see `shoal.runner.cache_memory`), so there is a single pool per engine.

Allocation order is deterministic: **the lowest free id first** (a min-heap). The result of a
sequence of allocate/free calls therefore does not depend on the order in which a request's
blocks are freed, which keeps exact-id tests simple.

Prefix caching: a block marked `cached` (its content is registered under a hash) keeps its
content when its last holder frees it: it becomes *evictable* (kept in LRU order) instead of
free. `allocate` takes never-cached free blocks first and then evicts the least recently
released cached ones (telling `on_evict`, which drops the hash); `take` gives a holder to a
cached block, evictable or not.

Invariant: `num_free + num_used == num_blocks`, where free counts the evictable blocks; a block
is free or evictable iff its ref count is 0; no id is ever handed out twice while used;
freeing a free block raises `BlockPoolError`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable


class BlockPoolError(RuntimeError):
    """An internal accounting error: over-allocation, double free, unknown id."""


class BlockPool:
    """`num_blocks` page ids, 0..num_blocks-1, handed out lowest-free-first with ref counts."""

    def __init__(self, num_blocks: int,
                 on_evict: Callable[[int], None] | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks}: expected an integer >= 0")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free_heap = list(range(num_blocks))  # already a valid heap
        self._num_free = num_blocks  # free heap + evictable
        self._cached: set[int] = set()  # blocks whose content is registered (prefix cache)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; oldest first
        self.on_evict = on_evict  # told the id of each cached block that allocate evicts
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: never-cached free ones plus evictable cached ones."""
        return self._num_free

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._cached

    def mark_cached(self, block_id: int) -> None:
        """The used block's content is registered: keep it when its last holder frees it."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise BlockPoolError(f"mark_cached of free block {block_id}")
        self._cached.add(block_id)

    def uncache_all(self) -> None:
        """Forget every registration (the prefix cache was dropped): evictable blocks become
        plainly free."""
        for block_id in self._evictable:
            heapq.heappush(self._free_heap, block_id)
        self._evictable.clear()
        self._cached.clear()

    def take(self, block_id: int) -> None:
        """Add a holder to a cached block (a prefix hit), reviving it if it was evictable."""
        self._check_id(block_id)
        if block_id not in self._cached:
            raise BlockPoolError(f"take of block {block_id}, which is not cached")
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
            self._num_free -= 1
        self._ref_counts[block_id] += 1

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (ascending ids, lowest first), each with ref count 1."""
        if count < 0:
            raise BlockPoolError(f"allocate({count}): count must be >= 0")
        if count > self._num_free:
            raise BlockPoolError(f"allocate({count}): only {self._num_free} of "
                                 f"{self.num_blocks} blocks are free")
        fresh = min(count, len(self._free_heap))
        ids = [heapq.heappop(self._free_heap) for _ in range(fresh)]
        for _ in range(count - fresh):  # then the least recently released cached blocks
            block_id, _ = self._evictable.popitem(last=False)
            self._cached.discard(block_id)
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block_id)
            ids.append(block_id)
        for block_id in ids:
            assert self._ref_counts[block_id] == 0, f"free block {block_id} has references"
            self._ref_counts[block_id] = 1
        self._num_free -= count
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each used block (prefix sharing)."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise BlockPoolError(f"incref of free block {block_id}")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one holder from each block; returns the ids that became free (ref count 0)."""
        released = []
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise BlockPoolError(f"double free of block {block_id}")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._cached:
                    self._evictable[block_id] = None  # most recently released last
                else:
                    heapq.heappush(self._free_heap, block_id)
                self._num_free += 1
                released.append(block_id)
        return released

    def check_invariants(self) -> None:
        """Full consistency check (tests; O(num_blocks))."""
        free_set = set(self._free_heap)
        assert len(free_set) == len(self._free_heap), "duplicate ids in the free heap"
        assert free_set.isdisjoint(self._evictable), "a block is both free and evictable"
        assert set(self._evictable) <= self._cached, "an evictable block is not cached"
        assert free_set.isdisjoint(self._cached), "a free block is still cached"
        assert len(free_set) + len(self._evictable) == self._num_free, "free count drifted"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0
            idle = block_id in free_set or block_id in self._evictable
            assert (count == 0) == idle, f"block {block_id}: ref {count}"

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockPoolError(f"block id {block_id} outside [0, {self.num_blocks})")
