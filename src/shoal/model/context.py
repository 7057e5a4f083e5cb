"""Per-step context shared by all layers of one forward: the batch, the caches, the op table,
precomputed index metadata (SWA rows for encoder/decoder layers, visible compressed rows), the
deferred SWA commits, and the CSA2 shared state (`model/kv_sharing.py`'s SharedIndex).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shoal.model.batch import ForwardBatch
from shoal.model.config import LayerSpec, ModelConfig
from shoal.model.kv_sharing import SharedIndex
from shoal.model.params import ModelParams
from shoal.model.state import KVCaches
from shoal.ops.reference.rope import RopeParams
from shoal.ops.registry import OpTable
from shoal.parallel.expert_parallel import ExpertParallel


def rope_params(config: ModelConfig, spec: LayerSpec) -> RopeParams:
    """Ratio-0 layers: theta 10000, no YaRN; every ratio != 0 layer: compress theta + YaRN."""
    if spec.uses_compress_rope:
        return RopeParams(config.rope_head_dim, config.compress_rope_theta, config.rope_factor,
                          config.original_max_position_embeddings, config.beta_fast,
                          config.beta_slow)
    return RopeParams(config.rope_head_dim, config.rope_theta)


def select(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x[rows]


@dataclass
class StepContext:
    config: ModelConfig
    params: ModelParams
    caches: KVCaches
    ops: OpTable
    batch: ForwardBatch
    swa_rows_encoder: torch.Tensor  # [T, W] int32 physical SWA rows (floor 0)
    swa_rows_decoder: torch.Tensor  # [T, W] int32 (floored at the decoder floor)
    token_slot: torch.Tensor  # [T] request slot of each row
    shared: SharedIndex = field(default_factory=SharedIndex)  # CSA2 top-k and candidates
    ep: ExpertParallel | None = None  # expert parallelism: this rank's slice of the experts
    expert_loads: dict[str, torch.Tensor] | None = None  # recording: tokens per expert
    # index tensors that depend only on the step (not on the layer), computed once per step and
    # shared by the layers: key -> (the row-set tensor the key's id() refers to, the result)
    _memo: dict[tuple, tuple[torch.Tensor | None, object]] = field(default_factory=dict)
    # SWA commits deferred to the end of the forward: row-set id -> (row set, layer ids)
    _commits: dict[int | None, tuple[torch.Tensor | None, list[int]]] = field(
        default_factory=dict)

    def _once(self, key: tuple, rows: torch.Tensor | None, make):
        """make() once per (key, row set) in this step. Row sets are identified by object (the
        batch's `layer_rows` tensors, alive for the step; the entry keeps a reference)."""
        full_key = (*key, None if rows is None else id(rows))
        hit = self._memo.get(full_key)
        if hit is None:
            hit = self._memo[full_key] = (rows, make())
        return hit[1]

    @classmethod
    def build(cls, config: ModelConfig, params: ModelParams, caches: KVCaches, ops: OpTable,
              batch: ForwardBatch, ep: ExpertParallel | None = None,
              expert_loads: dict[str, torch.Tensor] | None = None) -> StepContext:
        t = batch.num_tokens
        if t > caches.max_tokens:
            raise ValueError(f"step has {t} tokens, more than the caches' scratch "
                             f"({caches.max_tokens})")
        token_slot = batch.slots[batch.req_index]
        common = dict(positions=batch.positions,
                      token_index=torch.arange(t, device=batch.positions.device),
                      chunk_start=batch.chunk_start[batch.req_index],
                      ring_base=token_slot * caches.ring_size, window=config.sliding_window,
                      ring_size=caches.ring_size, scratch_base=caches.scratch_base)
        floor, dec_floor = torch.zeros_like(batch.positions), batch.decoder_floor
        if batch.swa_floor is not None:  # a prefix-cache replay: no ring rows below its start
            floor, dec_floor = batch.swa_floor, torch.maximum(dec_floor, batch.swa_floor)
        enc = ops.swa_indices(floor=floor, **common)
        dec = ops.swa_indices(floor=dec_floor, **common)
        return cls(config, params, caches, ops, batch, enc, dec, token_slot, ep=ep,
                   expert_loads=expert_loads)

    def n_visible(self, ratio: int, rows: torch.Tensor | None) -> torch.Tensor:
        """Compressed rows of ratio `ratio` visible to each of `rows` (once per step)."""
        return self._once(("visible", ratio), rows,
                          lambda: (select(self.batch.positions, rows) + 1) // ratio)

    def paged_rows(self, source: int, logical: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
        """Physical rows (int32) of logical compressed rows `logical` [F] / [F, K] of requests
        `req` [F]; -1 where logical < 0 or the block is unassigned (-1: padded rows of a CUDA
        graph)."""
        return self.ops.paged_rows(logical=logical, req=req, block_table=self.batch.block_table,
                                   rows_per_block=self.caches.rows_per_block(source))

    def scratch_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """Scratch rows of the step's tokens `rows` (None: all) in every SWA plane."""
        def make() -> torch.Tensor:
            r = (torch.arange(self.batch.num_tokens, device=self.batch.positions.device)
                 if rows is None else rows)
            return self.caches.scratch_base + r
        return self._once(("scratch",), rows, make)

    def compressed_rows(self, topk_source: int, kv_source: int,
                        rows: torch.Tensor | None) -> torch.Tensor:
        """Physical compressed rows [F, K] int32 of the top-k of `topk_source` for `rows`, in
        `kv_source`'s cache (-1 where the top-k or the block is empty)."""
        def make() -> torch.Tensor:
            top = self.shared.topk_of(topk_source, rows)  # [F, K] logical rows, -1 padded
            return self.paged_rows(kv_source, top, select(self.batch.req_index, rows))
        return self._once(("compressed", topk_source, kv_source), rows, make)

    def commit_swa(self, layer: int, rows: torch.Tensor | None) -> None:
        """Mark layer's scratch keys of `rows` for the rings; `flush_swa` copies them. A layer
        reads only its own plane and only before its commit, so deferring every commit to the
        end of the forward changes nothing but the number of copies."""
        key = None if rows is None else id(rows)
        self._commits.setdefault(key, (rows, []))[1].append(layer)

    def flush_swa(self) -> None:
        """Copy the step's scratch keys into the rings (the last ring_size positions of each
        request only, so every ring slot is written at most once): one gather and one scatter
        per run of consecutive layers that committed the same rows when the planes are one
        stacked tensor, else one per layer."""
        commits, self._commits = self._commits, {}
        stack = self.caches.swa_stack
        for rows, layers in commits.values():
            dst, src = self._commit_rows(rows)
            layers = sorted(layers)
            runs: list[list[int]] = []
            for lay in layers:
                if runs and lay == runs[-1][-1] + 1:
                    runs[-1].append(lay)
                else:
                    runs.append([lay])
            for run in runs:
                if stack is not None:
                    planes = stack[run[0]:run[-1] + 1]
                    planes[:, dst] = planes[:, src]
                else:
                    for lay in run:
                        plane = self.caches.swa[lay]
                        plane[dst] = plane[src]

    def _commit_rows(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ring or scratch destination rows, scratch source rows) of the step's rows."""
        def make() -> tuple[torch.Tensor, torch.Tensor]:
            b = self.batch
            r = torch.arange(b.num_tokens, device=b.positions.device) if rows is None else rows
            pos = b.positions[r]
            end = torch.full((b.num_requests,), -1, dtype=pos.dtype, device=pos.device)
            end = end.scatter_reduce(0, b.req_index[r], pos, reduce="amax")
            keep = pos > end[b.req_index[r]] - self.caches.ring_size
            scratch = self.caches.scratch_base + r
            ring = self.token_slot[r] * self.caches.ring_size + pos % self.caches.ring_size
            # rows not kept copy onto themselves: no boolean indexing, so no host sync
            return torch.where(keep, ring, scratch), scratch
        return self._once(("commit",), rows, make)
