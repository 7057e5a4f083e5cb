"""Per-request KV resources: one block table (paged global KV) and one request slot (fixed state).

Owns: `KVCacheManager`, the only writer of `Request.block_ids` and `Request.slot`.

- Paged global KV (compressed-KV and index-K rows of the kv-source layers): a request's
  `block_ids[i]` holds context positions `[i * block_size, (i + 1) * block_size)` in every source
  layer (a source with ratio r stores `block_size // r` rows of that block).
- Request slots (`num_slots` of them): per-request fixed device state (SWA rings of every layer
  incl. the draft layers, compressor pending groups). Taken on admission, returned on
  finish / preemption; the lowest free slot is taken first.

Invariant: a request holding resources has a slot and exactly
`ceil(covered_tokens / block_size)` blocks, where covered_tokens >= num_computed_tokens; every
block and slot is returned exactly once (`free`), so an idle manager has all blocks and slots free.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from shoal.scheduler.block_pool import BlockPool
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

    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: expected an integer >= 1")
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: expected an integer >= 1")
        self.block_size = block_size
        self.num_slots = num_slots
        self.pool = BlockPool(num_blocks)
        self._free_slots = list(range(num_slots))  # min-heap
        self._holders: dict[str, Request] = {}

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
                     num_lookahead_tokens: int = 0) -> bool:
        """True if `allocate` would succeed now (blocks, and a slot if the request has none)."""
        if request.slot is None and not self._free_slots:
            return False
        need = self.num_new_blocks(request, num_new_tokens, num_lookahead_tokens)
        return need <= self.pool.num_free

    def allocate(self, request: Request, num_new_tokens: int,
                 num_lookahead_tokens: int = 0) -> list[int]:
        """Grow the request's table to cover computed + new tokens; take a slot if it has none.

        Returns the newly added block ids (ascending, lowest free first). Raises
        `BlockPoolError` / RuntimeError if called when `can_allocate` is False.
        """
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

    def free(self, request: Request) -> list[int]:
        """Return every block and the slot of `request`; returns the block ids released."""
        released = self.pool.free(reversed(request.block_ids)) if request.block_ids else []
        request.block_ids = []
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
