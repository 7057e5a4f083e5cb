"""Speculative decoding under async scheduling: the inputs a verify step takes on the device
from the step before it, which was still in flight when this one was planned.

The scheduler plans step n+1 as if every draft verified in step n were accepted: a chunk's
anchor and drafts are `UNRESOLVED`, and its positions are those of full acceptance. Step n's
`Proposal` holds the truth: the chunk's input ids (the last accepted sample, then the new
drafts), the shift of its positions (accepted - verified rows, <= 0), the Engram ids before the
anchor, and how many drafts the confidence rule keeps. `DraftPatch.apply` writes them into the
step's batch (the eager layout, or a CUDA graph's static rows) after its upload and before its
forward; the sampler's positions and the drafts' checks take the same shift and limit.

Invariant: a shifted chunk's positions stay at or below the planned ones, whose blocks the
scheduler allocated; every row of a patched chunk (a graph's padding rows too) moves by the
same shift, so nothing is written beyond the ring slack of the true positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shoal.model.batch import ForwardBatch
from shoal.runner.inflight import to_device, upload
from shoal.runner.speculative import Proposal, VerifyLayout


@dataclass
class DraftPatch:
    """Chunks `chunks` (plan order) of `lengths` rows from batch row `first_rows` take their
    inputs from request `sources` of `proposal` (row j: next_ids[source, j])."""

    chunks: tuple[int, ...]
    sources: tuple[int, ...]
    first_rows: tuple[int, ...]
    lengths: tuple[int, ...]
    proposal: Proposal
    _values: tuple | None = field(default=None, repr=False)

    def _compute(self, device: torch.device, n_hist: int) -> tuple:
        if self._values is None:
            p = self.proposal
            rows, owner, cols = [], [], []
            for i, (first, n) in enumerate(zip(self.first_rows, self.lengths, strict=True)):
                rows.extend(range(first, first + n))
                owner.extend([i] * n)
                cols.extend(range(n))
            index = upload([rows, owner, cols], device)
            src = upload([self.sources], device)[0]
            ids = p.next_ids[src[index[1]], index[2]]  # [rows]
            shift = p.shift[src]  # per patched chunk
            width = max(self.lengths)
            # per chunk the ids at positions anchor - n_hist .. anchor + width - 1, then for
            # row j column c the id at position anchor + j - 1 - c
            seq = torch.cat([p.history[src].flip(1), p.next_ids[src, :width]], dim=1)
            back = index[2].unsqueeze(1) - 1 - torch.arange(n_hist, device=device)
            flat = index[1].unsqueeze(1) * (n_hist + width) + n_hist + back
            hist = seq.flatten()[flat] if n_hist else None
            self._values = (index[0], index[1], ids, shift, hist)
        return self._values

    def apply(self, batch: ForwardBatch) -> None:
        """Write the inputs into a host-built batch on the device (eager layout)."""
        rows, owner, ids, shift, hist = self._compute(batch.input_ids.device,
                                                      batch.engram_history.shape[1])
        batch.input_ids[rows] = ids
        batch.positions[rows] += shift[owner]
        batch.chunk_start[upload([self.chunks], rows.device)[0]] += shift
        if hist is not None:
            batch.engram_history[rows] = hist

    def apply_static(self, static: ForwardBatch, dst: torch.Tensor | None, q: int) -> None:
        """Write the inputs into a CUDA graph's static batch: request r's rows are static rows
        r*q .. r*q + q - 1 (`dst`: each real row's static row; None: row r is request r)."""
        device = static.input_ids.device
        rows, owner, ids, shift, hist = self._compute(device, static.engram_history.shape[1])
        chunks = upload([self.chunks], device)[0]
        where = rows if dst is None else to_device(dst, device)[rows]
        static.input_ids[where] = ids
        every = (chunks.unsqueeze(1) * q + torch.arange(q, device=device)).flatten()
        static.positions[every] += shift.repeat_interleave(q)
        static.chunk_start[chunks] += shift
        if hist is not None:
            static.engram_history[where] = hist

    def limits(self, layout: VerifyLayout, device: torch.device) -> torch.Tensor:
        """Per sampling request of `layout`: the drafts its checks reach (its chunk's drafts,
        or fewer where the confidence rule kept fewer)."""
        limits = upload([layout.num_drafts], device)[0]
        at = {c: i for i, c in enumerate(self.chunks)}
        pick = [(i, at[c]) for i, c in enumerate(layout.chunks) if c in at]
        if pick:
            index = upload([[i for i, _ in pick], [self.sources[j] for _, j in pick]], device)
            limits[index[0]] = torch.minimum(limits[index[0]], self.proposal.keep[index[1]])
        return limits

    def draw_shift(self, layout: VerifyLayout, device: torch.device) -> torch.Tensor:
        """Per draw of `layout`: its request's position shift (0 where not patched)."""
        at = {c: self.sources[i] for i, c in enumerate(self.chunks)}
        owner = layout.draw_owner()
        src = [at.get(layout.chunks[i], -1) for i in owner]
        index = upload([src], device)[0]
        shift = self.proposal.shift[index.clamp(min=0)]
        return torch.where(index >= 0, shift, 0)
