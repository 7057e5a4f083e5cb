"""The split of a memory budget into KV blocks and request slots (`plan_memory` -> `MemoryPlan`),
over the sizes of a `CacheLayout` (`model/cache_layout.py`). Plain arithmetic: no torch, no
CUDA; the scheduler receives only `num_blocks`, `block_size` and `num_slots`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.model.cache_layout import CacheLayout

__all__ = ["GPU_ACTIVATION_RESERVE_GB", "CacheLayout", "MemoryPlan", "plan_memory"]

GPU_ACTIVATION_RESERVE_GB = 8.0  # GPU memory kept out of the KV pool for activations and graphs


@dataclass(frozen=True)
class MemoryPlan:
    """How a KV budget is split: `num_blocks` pages of `block_size` tokens + `num_slots` slots."""

    block_size: int
    num_blocks: int
    num_slots: int
    bytes_per_block: int
    bytes_per_slot: int
    max_blocks_per_request: int  # ceil(max_model_len / block_size)
    budget_bytes: int
    num_snapshots: int = 0  # prefix caching's ring snapshots
    bytes_per_snapshot: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def slot_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshots * self.bytes_per_snapshot

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.slot_bytes + self.snapshot_bytes

    @property
    def max_context_tokens(self) -> int:
        """Context tokens the whole pool holds (over all requests)."""
        return self.num_blocks * self.block_size


def plan_memory(layout: CacheLayout, budget_bytes: int, max_num_seqs: int,
                max_model_len: int, num_snapshots: int = 0,
                prefix_caching: bool = False) -> MemoryPlan:
    """Split `budget_bytes` into request slots and KV blocks (after `num_snapshots` ring
    snapshots of prefix caching, taken off the top).

    1. Reserve one max-length request: `ceil(max_model_len / block_size)` blocks + one slot;
       if the budget cannot hold that, raise ValueError.
    2. Slots: `max_num_seqs`, or fewer if they would not fit beside that one request (then
       `num_slots < max_num_seqs` and the engine should say so).
    3. Blocks: the rest of the budget; without `prefix_caching` no more than `num_slots`
       max-length requests can use (with it, finished requests' blocks stay as cache, so
       every block the budget holds is useful).
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs}: expected >= 1")
    if max_model_len < 1:
        raise ValueError(f"max_model_len={max_model_len}: expected >= 1")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes}: expected >= 0")
    if num_snapshots < 0:
        raise ValueError(f"num_snapshots={num_snapshots}: expected >= 0")
    full_budget = budget_bytes
    budget_bytes -= num_snapshots * layout.bytes_per_snapshot
    per_block, per_slot = layout.bytes_per_block, layout.bytes_per_slot
    max_blocks = -(-max_model_len // layout.block_size)
    one_request = per_slot + max_blocks * per_block
    if budget_bytes < one_request:
        raise ValueError(
            f"KV budget of {full_budget} B (after {num_snapshots} ring snapshots) cannot hold "
            f"one request of max_model_len="
            f"{max_model_len}: that needs {one_request} B ({max_blocks} blocks x {per_block} B "
            f"+ one slot of {per_slot} B); raise the memory budget or lower max_model_len")
    num_slots = max_num_seqs
    if per_slot:
        num_slots = min(max_num_seqs, (budget_bytes - max_blocks * per_block) // per_slot)
    num_blocks = (budget_bytes - num_slots * per_slot) // per_block if per_block else max_blocks
    if not prefix_caching:
        num_blocks = min(num_blocks, num_slots * max_blocks)
    return MemoryPlan(block_size=layout.block_size, num_blocks=num_blocks, num_slots=num_slots,
                      bytes_per_block=per_block, bytes_per_slot=per_slot,
                      max_blocks_per_request=max_blocks, budget_bytes=full_budget,
                      num_snapshots=num_snapshots, bytes_per_snapshot=layout.bytes_per_snapshot)
