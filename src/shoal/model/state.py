"""Explicit model state: the KV caches and per-request fixed state, as plain tensors.

Owns `KVCaches`: per layer an SWA plane (request rings + a scratch tail for the step's own
keys), per kv source paged compressed-KV and index-K planes, and per gated source a ring of
the last r + slack compressor inputs (fp32 kv and score; token p in entry p % rows), from which
a group closing in a later step reads its earlier members. Invariant: the model never hides state in modules; one `KVCaches` serves
whole-prompt forwards, chunked prefill and decode, and the engine pages it (block ids, slots).

SWA plane of every layer: rows [slot * ring_size + p % ring_size] hold the request's last
`ring_size` keys; rows [num_slots * ring_size + t] are scratch for row t of the current step
(written before attention, copied into the ring after it), so a chunk longer than the window
never overwrites keys that its own queries still read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.model.cache_layout import CacheLayout
from shoal.model.config import ModelConfig


@dataclass
class KVCaches:
    swa: list[torch.Tensor]  # per layer (backbone + draft): uint8 [slots*ring + max_tokens, rec]
    compressed: dict[int, torch.Tensor]  # kv source -> uint8 [num_blocks * rows_per_block, 288]
    index_k: dict[int, torch.Tensor]  # kv source -> uint8 [num_blocks * rows_per_block, 68]
    comp_state: dict[int, tuple[torch.Tensor, torch.Tensor]]  # gated source -> kv, score fp32
    ratios: dict[int, int]  # kv source -> compress ratio
    num_slots: int
    ring_size: int
    block_size: int
    max_tokens: int
    # the planes of `swa` as one [layers, rows, rec] tensor (None: separate tensors), so one
    # copy commits a step's keys for a run of layers (StepContext.flush_swa)
    swa_stack: torch.Tensor | None = None
    # prefix caching: ring snapshots, uint8 [num_snapshots, backbone layers, window, rec]
    # (model/ring_snapshots.py); None without prefix caching
    snapshots: torch.Tensor | None = None

    @property
    def scratch_base(self) -> int:
        return self.num_slots * self.ring_size

    def rows_per_block(self, source: int) -> int:
        return self.block_size // self.ratios[source]

    @classmethod
    def from_layout(cls, layout: CacheLayout, *, num_blocks: int, num_slots: int,
                    max_tokens: int, num_snapshots: int = 0,
                    device: torch.device | str = "cpu") -> KVCaches:
        """Zeroed caches of `layout`: `num_blocks` pages, `num_slots` request slots, a
        scratch of `max_tokens` SWA rows for one step and `num_snapshots` ring snapshots."""
        ring = layout.swa_ring_len
        stack = torch.zeros(len(layout.swa_layer_ids), num_slots * ring + max_tokens,
                            layout.swa_record_bytes, dtype=torch.uint8, device=device)
        compressed, index_k, state, ratios = {}, {}, {}, {}
        for source in layout.sources:
            rows = num_blocks * source.rows_per_block
            ratios[source.layer_id] = source.compress_ratio
            compressed[source.layer_id] = torch.zeros(
                rows, source.compressed_record_bytes, dtype=torch.uint8, device=device)
            index_k[source.layer_id] = torch.zeros(
                rows, source.index_record_bytes, dtype=torch.uint8, device=device)
        for spec in layout.compressor_states:  # a ring of the last rows tokens (p % rows)
            shape = (num_slots, spec.rows, spec.head_dim)
            state[spec.layer_id] = (
                torch.zeros(shape, dtype=torch.float32, device=device),
                torch.full(shape, -torch.inf, dtype=torch.float32, device=device))
        snapshots = torch.zeros(
            num_snapshots, layout.snapshot_layers, layout.snapshot_window,
            layout.swa_record_bytes, dtype=torch.uint8, device=device) if num_snapshots else None
        return cls(list(stack.unbind(0)), compressed, index_k, state, ratios, num_slots, ring,
                   layout.block_size, max_tokens, stack, snapshots)

    @classmethod
    def allocate(cls, config: ModelConfig, *, num_blocks: int, num_slots: int, max_tokens: int,
                 block_size: int = 256, ring_slack: int = 8, num_snapshots: int = 0,
                 device: torch.device | str = "cpu") -> KVCaches:
        """`from_layout` of the layout of `config` with `ring_slack` rows of SWA and
        compressor-ring slack (tests and benchmarks)."""
        layout = CacheLayout.from_model_config(config, block_size=block_size,
                                               swa_slack=ring_slack)
        return cls.from_layout(layout, num_blocks=num_blocks, num_slots=num_slots,
                               max_tokens=max_tokens, num_snapshots=num_snapshots,
                               device=device)
