"""Ring snapshots: the backbone layers' SWA rows over the window below a block boundary, copied
out of a request's slot and later into another's, so a prefix-cache hit resumes exactly
(`scheduler/prefix_cache.py` decides which boundaries are saved and which snapshot a hit uses).

A snapshot is `KVCaches.snapshots[id]`: uint8 [backbone layers, window, record], rows in
position order B - window .. B - 1. Saving reads each position where the step left it: a key
computed in this step is still in the step's scratch rows (the rings may already hold later
positions of a long chunk at its ring index), an older one in the ring. Restoring writes the
rows at their ring index (slot * ring + p % ring) before any layer reads them.

Invariant: saves run after every layer wrote its scratch rows and before the step's keys are
committed (`save(..., committed=False)` inside the forward), or after the commit when every
saved position is a ring row (`committed=True`: a decode step replayed as a CUDA graph, whose
boundary is its chunk's end).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shoal.model.state import KVCaches

# (slot, boundary, snapshot id): restore before the forward
Restore = tuple[int, int, int]
# (slot, chunk start, first row of the chunk in the step, boundary, snapshot id)
Save = tuple[int, int, int, int, int]


def _upload(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host index data to the snapshots' device without waiting for the stream (pinned)."""
    if device.type != "cuda":
        return values
    return values.pin_memory().to(device, non_blocking=True)


def _ring_rows(caches: KVCaches, slot: int, positions: torch.Tensor) -> torch.Tensor:
    """The slot's ring rows of `positions` (the SWA plane's ring index)."""
    return slot * caches.ring_size + positions % caches.ring_size


def _planes(caches: KVCaches) -> torch.Tensor:
    assert caches.snapshots is not None and caches.swa_stack is not None
    return caches.swa_stack[:caches.snapshots.shape[1]]


def restore(caches: KVCaches, restores: Sequence[Restore]) -> None:
    """Copy each snapshot into its slot's rings at the positions below its boundary."""
    if not restores:
        return
    snaps = caches.snapshots
    window = snaps.shape[2]
    offs = torch.arange(-window, 0)
    rows = _upload(torch.stack([_ring_rows(caches, slot, b + offs) for slot, b, _ in restores]),
                   snaps.device)  # [S, window]
    ids = _upload(torch.tensor([sid for _, _, sid in restores]), snaps.device)
    planes = _planes(caches)
    planes[:, rows.flatten()] = snaps[ids].transpose(0, 1).flatten(1, 2)


def save(caches: KVCaches, saves: Sequence[Save], *, committed: bool) -> None:
    """Copy the rows below each boundary into its snapshot (see the module docstring)."""
    if not saves:
        return
    snaps = caches.snapshots
    window = snaps.shape[2]
    offs = torch.arange(-window, 0)
    rows = []
    for slot, start, first_row, b, _ in saves:
        pos = b + offs
        ring = _ring_rows(caches, slot, pos)
        if committed:
            rows.append(ring)
        else:
            rows.append(torch.where(pos >= start, caches.scratch_base + first_row + pos - start,
                                    ring))
    index = _upload(torch.stack(rows), snaps.device)  # [S, window]
    ids = _upload(torch.tensor([s[-1] for s in saves]), snaps.device)
    planes = _planes(caches)
    snaps[ids] = planes[:, index.flatten()].unflatten(1, index.shape).transpose(0, 1)
