"""The host tier's memory: pinned host copies of paged KV blocks and ring snapshots, and the
copies a plan's `transfers` ask for (`scheduler/host_tier.py` decides them).

A host block slot holds one block of every kv source's compressed-KV and index-K planes (the
rows `block * rows_per_block ..` of each); a host snapshot slot one ring snapshot. Copies are
queued on the current stream before the step's forward, non-blocking from / to pinned memory
(on CUDA), in the plan's order, so a block's copy out precedes the writes of its new owner and
a copy in precedes every read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shoal.model.cache_layout import CacheLayout
from shoal.model.state import KVCaches
from shoal.scheduler.host_tier import BLOCK_IN, BLOCK_OUT, SNAPSHOT_IN, SNAPSHOT_OUT, Transfer


def host_slots(layout: CacheLayout, budget_bytes: int) -> tuple[int, int]:
    """(block slots, snapshot slots) of a host budget: a quarter for snapshots, the rest for
    blocks."""
    snap = layout.bytes_per_snapshot
    num_snapshots = budget_bytes // 4 // snap if snap else 0
    num_blocks = (budget_bytes - num_snapshots * snap) // layout.bytes_per_block
    return int(num_blocks), int(num_snapshots)


class HostKV:
    def __init__(self, layout: CacheLayout, num_blocks: int, num_snapshots: int,
                 device: torch.device) -> None:
        pin = device.type == "cuda"
        self.num_blocks, self.num_snapshots = num_blocks, num_snapshots

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=torch.uint8, pin_memory=pin)

        self.rows = {s.layer_id: s.rows_per_block for s in layout.sources}
        self.compressed = {s.layer_id: empty(num_blocks * s.rows_per_block,
                                             s.compressed_record_bytes) for s in layout.sources}
        self.index_k = {s.layer_id: empty(num_blocks * s.rows_per_block, s.index_record_bytes)
                        for s in layout.sources}
        self.snapshots = empty(num_snapshots, layout.snapshot_layers, layout.snapshot_window,
                               layout.swa_record_bytes)

    @property
    def nbytes(self) -> int:
        planes = [*self.compressed.values(), *self.index_k.values(), self.snapshots]
        return sum(t.numel() for t in planes)

    def apply(self, caches: KVCaches, transfers: Sequence[Transfer]) -> None:
        for t in transfers:
            if t.kind in (BLOCK_OUT, BLOCK_IN):
                for source, rpb in self.rows.items():
                    dev = slice(t.device * rpb, (t.device + 1) * rpb)
                    host = slice(t.host * rpb, (t.host + 1) * rpb)
                    for device_plane, host_plane in ((caches.compressed[source],
                                                      self.compressed[source]),
                                                     (caches.index_k[source],
                                                      self.index_k[source])):
                        if t.kind == BLOCK_OUT:
                            host_plane[host].copy_(device_plane[dev], non_blocking=True)
                        else:
                            device_plane[dev].copy_(host_plane[host], non_blocking=True)
            elif t.kind == SNAPSHOT_OUT:
                self.snapshots[t.host].copy_(caches.snapshots[t.device], non_blocking=True)
            elif t.kind == SNAPSHOT_IN:
                caches.snapshots[t.device].copy_(self.snapshots[t.host], non_blocking=True)
            else:
                raise ValueError(f"unknown transfer kind {t.kind!r}")
