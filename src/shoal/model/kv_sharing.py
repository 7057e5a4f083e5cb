"""CSA2 KV sharing (model.md §1.2, §2.8): the model keeps compressed KV and index keys for a
few source layers only, and every other compressed layer reads theirs.

Owns the roles (`derive_layers`: which layer owns a compressor, runs its own index query, reads
the block candidates, or reuses an earlier top-k) and the per-step shared state (`SharedIndex`:
the top-k rows and candidates the sources publish for their consumers). Imports no torch at run
time, so model/config.py stays torch-free; the state works on the tensors it is given.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from shoal.model.config import ModelConfig


class LayerRole(enum.Enum):
    SWA_ONLY = "swa_only"  # ratio 0: only the sliding window
    FULL = "full"  # kv source: owns compressor, index keys and (if an index source) top-k
    REUSE = "reuse"  # reads compressed KV and top-k of earlier sources
    REINDEX = "reindex"  # own index query over its kv source's keys, inside the candidates


@dataclass(frozen=True)
class LayerSpec:
    """Everything the model and the caches need to know about one layer (backbone or draft)."""

    layer_id: int
    compress_ratio: int  # 0 = SWA only; 1 = full-resolution sparse rows; >= 2 pooled groups
    role: LayerRole
    kv_source: int | None  # layer whose compressed KV / index keys this layer reads
    topk_source: int | None  # layer whose top-k this layer reads (itself for index sources)
    owns_compressor: bool  # role FULL
    owns_index_query: bool  # FULL that is an index source, or REINDEX
    is_candidate_source: bool  # publishes the block candidates (layer 20 in Flash)
    uses_candidates: bool  # REINDEX layers restrict their scores to the candidates
    has_engram: bool
    is_draft: bool  # DSpark stage
    is_decoder: bool  # runs only on the decoder rows in tail-only prefill
    compressor_gated: bool  # ratio >= 2: softmax gate and carried partial group

    @property
    def uses_compress_rope(self) -> bool:
        """Ratio != 0 layers rotate with compress_rope_theta + YaRN (Reuse/Reindex included)."""
        return self.compress_ratio != 0

    @property
    def is_kv_source(self) -> bool:
        return self.role is LayerRole.FULL


def derive_layers(c: ModelConfig) -> list[LayerSpec]:
    """Every layer's role (backbone then draft): a ratio-0 layer is SWA only; a compressed
    layer reads the compressed KV of the latest kv source at or before it and the top-k of the
    latest index source; kv sources own their compressor (FULL), other index sources run their
    own query (REINDEX), the rest reuse (REUSE)."""
    specs = []
    dec = c.decoder_start
    for layer in range(c.num_layers + c.num_draft_layers):
        r = c.compress_ratios[layer]
        draft = layer >= c.num_layers
        kv_src = topk_src = None
        role = LayerRole.SWA_ONLY
        if r > 0:
            kv_src = max(s for s in c.kv_source_layers if s <= layer)
            topk_src = max(s for s in c.index_source_layers if s <= layer)
            if layer in c.kv_source_layers:
                role = LayerRole.FULL
            elif layer in c.index_source_layers:
                role = LayerRole.REINDEX
            else:
                role = LayerRole.REUSE
        specs.append(LayerSpec(
            layer_id=layer, compress_ratio=r, role=role, kv_source=kv_src,
            topk_source=topk_src, owns_compressor=role is LayerRole.FULL,
            owns_index_query=role in (LayerRole.FULL, LayerRole.REINDEX),
            is_candidate_source=layer == c.candidate_source_layer,
            uses_candidates=(role is LayerRole.REINDEX and c.candidate_source_layer is not None
                             and kv_src == c.candidate_source_layer),
            has_engram=layer in c.engram_layer_ids, is_draft=draft,
            is_decoder=not draft and layer >= dec, compressor_gated=role is LayerRole.FULL
            and r >= 2,
        ))
    return specs


@dataclass
class SharedIndex:
    """One step's published CSA2 state: the top-k of every index source and the candidate
    source's block candidates, kept full-size [T, ...] so a consumer running on a subset of rows
    (tail-only prefill) reads exactly the rows its source computed (rows not computed: -1 /
    False). Sources publish before consumers read (layer order)."""

    topk: dict[int, Tensor] = field(default_factory=dict)  # source -> [T, K] int32, -1 padded
    candidates: Tensor | None = None  # [T, N] bool

    def publish_topk(self, source: int, top: Tensor, rows: Tensor | None,
                     num_tokens: int) -> None:
        """top [F, K] of the rows `rows` (None: every row of the step)."""
        self.topk[source] = top if rows is None else top.new_full(
            (num_tokens, top.shape[1]), -1).index_put_((rows,), top)

    def publish_candidates(self, mask: Tensor, rows: Tensor | None, num_tokens: int) -> None:
        """mask [F, N] bool of the rows `rows` (None: every row of the step)."""
        self.candidates = mask if rows is None else mask.new_zeros(
            (num_tokens, mask.shape[1])).index_put_((rows,), mask)

    def topk_of(self, source: int, rows: Tensor | None) -> Tensor:
        top = self.topk[source]
        return top if rows is None else top[rows]

    def candidates_of(self, rows: Tensor | None) -> Tensor:
        if self.candidates is None:
            raise RuntimeError("the candidate source must run before the reindex layers")
        return self.candidates if rows is None else self.candidates[rows]
