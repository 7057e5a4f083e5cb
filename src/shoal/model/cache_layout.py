"""The KV cache layout derived from a ModelConfig: one spec per cache kind, built once (by the
runner) and read by the memory planner, the device caches (`KVCaches.from_layout`) and, through
its `block_size`, the scheduler's KV manager. Plain arithmetic: no torch.

Two kinds of KV memory (model.md §4):

- **Paged global KV**, per kv-source layer (role FULL) with ratio r: compressed-KV rows
  (`head_dim // 2` e2m1 bytes + `head_dim // 16` e4m3 scales; 288 B at d = 512) and index-K rows
  (`index_head_dim // 2` + `index_head_dim // 32` UE8M0 scales; 68 B at 128). One block covers
  `block_size` context tokens, i.e. `block_size // r` rows of every source; one block id names
  the same page in every source's planes. Flash: 3 x (288 + 68) / 2 + (288 + 68) = **890 B/token**.
- **Request slots** (fixed per request): an SWA ring of `sliding_window + slack` records of
  `head_dim + head_dim // 32` bytes (528 B) for **every** layer incl. the draft layers, and the
  fp32 compressor state of each gated source: a ring of `r + slack` rows x [kv | score] x
  head_dim x 4 B (token p in row p % rows), so that a rejected speculative token never
  overwrites an accepted one's entry. Engram history (3 ids) lives in the request, not here.

Invariant: `block_size` is a multiple of 128 and of lcm(source ratios) * candidate_group_rows, so
every source's rows and every 8-row candidate block stay whole inside a page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.model.config import ModelConfig

BLOCK_ALIGN = 128  # tokens; page sizes are multiples of this (kernel tiles, ratio-1/2 alignment)
FP32_BYTES = 4


@dataclass(frozen=True)
class SourceCacheSpec:
    """Paged compressed-KV and index-K planes of one kv-source layer (per block = page)."""

    layer_id: int
    compress_ratio: int
    rows_per_block: int  # block_size // compress_ratio
    compressed_value_bytes: int  # head_dim // 2: e2m1 pairs, low nibble = even dim
    compressed_scale_bytes: int  # head_dim // 16: one e4m3 scale per 16 dims
    index_value_bytes: int  # index_head_dim // 2: e2m1 pairs
    index_scale_bytes: int  # index_head_dim // 32: one UE8M0 scale per 32 dims

    @property
    def compressed_record_bytes(self) -> int:
        return self.compressed_value_bytes + self.compressed_scale_bytes

    @property
    def index_record_bytes(self) -> int:
        return self.index_value_bytes + self.index_scale_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.rows_per_block * (self.compressed_record_bytes + self.index_record_bytes)


@dataclass(frozen=True)
class CompressorStateSpec:
    """fp32 pending-group state of one gated (ratio >= 2) source: [rows, 2 (kv | score), dim]."""

    layer_id: int
    compress_ratio: int
    rows: int
    head_dim: int

    @property
    def bytes(self) -> int:
        return self.rows * 2 * self.head_dim * FP32_BYTES


@dataclass(frozen=True)
class CacheLayout:
    """Every cache size the runner allocates and the memory planner divides."""

    block_size: int
    sources: tuple[SourceCacheSpec, ...]
    swa_layer_ids: tuple[int, ...]  # every layer, backbone and draft
    swa_ring_len: int  # sliding_window + speculative slack
    swa_value_bytes: int  # head_dim e4m3
    swa_scale_bytes: int  # head_dim // 32 UE8M0
    compressor_states: tuple[CompressorStateSpec, ...]
    # a ring snapshot (prefix caching): the backbone layers' rows over the window below a block
    # boundary (model/ring_snapshots.py)
    snapshot_layers: int = 0
    snapshot_window: int = 0

    @classmethod
    def from_model_config(cls, config: ModelConfig, block_size: int = 256,
                          swa_slack: int | None = None,
                          compressor_state_rows: int | None = None) -> CacheLayout:
        """Derive the layout. `swa_slack` defaults to `dspark_draft_len` when the model has
        draft layers (room for verified drafts), else 0. `compressor_state_rows` defaults to
        r + swa_slack: a ring of the last tokens, so a rejected draft never overwrites an
        accepted token's entry (token p lives in entry p % rows)."""
        sources = [spec for spec in config.layers if spec.is_kv_source]
        ratios = sorted({spec.compress_ratio for spec in sources})
        align = math.lcm(BLOCK_ALIGN, math.lcm(*ratios) * config.candidate_group_rows) \
            if ratios else BLOCK_ALIGN
        if block_size < 1 or block_size % align:
            raise ValueError(f"block_size={block_size}: expected a positive multiple of {align} "
                             f"(lcm of {BLOCK_ALIGN} and lcm(source ratios {ratios}) x "
                             f"candidate_group_rows {config.candidate_group_rows})")
        if swa_slack is None:
            swa_slack = config.dspark_draft_len if config.num_draft_layers else 0
        if swa_slack < 0:
            raise ValueError(f"swa_slack={swa_slack}: expected >= 0")
        if compressor_state_rows is not None and compressor_state_rows < 1:
            raise ValueError(f"compressor_state_rows={compressor_state_rows}: expected >= 1")
        d, di = config.head_dim, config.index_head_dim
        return cls(
            block_size=block_size,
            sources=tuple(SourceCacheSpec(
                layer_id=spec.layer_id, compress_ratio=spec.compress_ratio,
                rows_per_block=block_size // spec.compress_ratio,
                compressed_value_bytes=d // 2, compressed_scale_bytes=d // 16,
                index_value_bytes=di // 2, index_scale_bytes=di // 32,
            ) for spec in sources),
            swa_layer_ids=tuple(spec.layer_id for spec in config.layers),
            swa_ring_len=config.sliding_window + swa_slack,
            swa_value_bytes=d, swa_scale_bytes=d // 32,
            compressor_states=tuple(CompressorStateSpec(
                layer_id=spec.layer_id, compress_ratio=spec.compress_ratio,
                rows=compressor_state_rows or spec.compress_ratio + swa_slack, head_dim=d,
            ) for spec in sources if spec.compressor_gated),
            snapshot_layers=len(config.backbone), snapshot_window=config.sliding_window,
        )

    # ---- paged global KV -----------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """One page in every source's compressed-KV and index-K planes."""
        return sum(source.bytes_per_block for source in self.sources)

    def bytes_per_context_token(self) -> float:
        """Global KV bytes per context token (890.0 for Flash, 534.0 mini, 106.0 tiny)."""
        return self.bytes_per_block / self.block_size

    # ---- per-request slot ---------------------------------------------------------------------
    @property
    def swa_record_bytes(self) -> int:
        return self.swa_value_bytes + self.swa_scale_bytes

    @property
    def swa_bytes_per_slot(self) -> int:
        return len(self.swa_layer_ids) * self.swa_ring_len * self.swa_record_bytes

    @property
    def compressor_bytes_per_slot(self) -> int:
        return sum(state.bytes for state in self.compressor_states)

    @property
    def bytes_per_slot(self) -> int:
        return self.swa_bytes_per_slot + self.compressor_bytes_per_slot

    @property
    def bytes_per_snapshot(self) -> int:
        """One ring snapshot (2.6 MiB for Flash: 40 x 128 x 528 B)."""
        return self.snapshot_layers * self.snapshot_window * self.swa_record_bytes
