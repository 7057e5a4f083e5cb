"""Indexer of an index-source layer (model.md §2.7): FP4 query, fp32 scores over the kv
source's paged index keys, the level-1 candidate filter (candidate source) or level-2 masking
(Reindex layers), and the top-k rows published for the layers that reuse them.
"""

from __future__ import annotations

import torch

from shoal.model.config import LayerSpec
from shoal.model.context import StepContext, rope_params, select


def run_indexer(ctx: StepContext, spec: LayerSpec, x: torch.Tensor, qr: torch.Tensor,
                rows: torch.Tensor | None) -> None:
    """x [F, D] (normed input), qr [F, q_lora] of the full rows `rows`; publishes
    the layer's top-k ([index_topk] int32 logical rows, -1 padded) and, at the candidate
    source, the block candidates into ctx.shared (model/kv_sharing.py)."""
    ops, p, cfg, b = ctx.ops, ctx.params, ctx.config, ctx.batch
    layer, src, r = spec.layer_id, spec.kv_source, spec.compress_ratio
    pre = f"layers.{layer}.attn.indexer."
    pos = select(b.positions, rows)
    req = select(b.req_index, rows)
    f = pos.shape[0]
    q = ops.gemm_fp8(x=qr, weight=p[pre + "wq_b.weight"], weight_scale=p[pre + "wq_b.scale"])
    q = q.view(f, cfg.index_n_heads, cfg.index_head_dim)
    q = ops.index_q_quant(q=ops.rope_tail(x=q, positions=pos, params=rope_params(cfg, spec)))
    w = ops.gemm_bf16(x=x, weight=p[pre + "weights_proj.weight"], out_dtype=torch.bfloat16)
    w = (w * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)).float()
    n_vis = ctx.n_visible(r, rows)
    width = (b.max_position + 1) // r if f else 0  # host bound: extra columns score -inf
    logits = ops.index_scores(q=q, weights=w, k_cache=ctx.caches.index_k[src],
                              block_table=b.block_table, req=req, n_visible=n_vis,
                              num_rows=width, rows_per_block=ctx.caches.rows_per_block(src))
    if spec.is_candidate_source:
        mask = ops.candidate_mask(logits=logits, n_visible=n_vis,
                                  block_size=cfg.candidate_group_rows,
                                  topk_blocks=cfg.candidate_topk_blocks)
        ctx.shared.publish_candidates(mask, rows, b.num_tokens)
    elif spec.uses_candidates:
        logits = ops.mask_logits(logits=logits, mask=ctx.shared.candidates_of(rows)[:, :width])
    top = ops.topk_rows(logits=logits, n_visible=n_vis, k=cfg.index_topk)
    ctx.shared.publish_topk(layer, top, rows, b.num_tokens)
