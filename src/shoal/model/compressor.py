"""Compressor of a kv-source layer (model.md §2.6) and the index keys derived from it (§2.7).

Ratio r >= 2: kv = wkv.x and s = wgate.x in fp32, per-channel softmax pooling over each group of
r tokens (earlier members of a group read from the ring `KVCaches.comp_state`), bf16,
compressor.norm. Ratio 1: the
normed bf16 projection of every token. Each emitted row j: index key k_norm(wk . latent) roped
at j*r and stored MXFP4; the latent roped at j*r and stored NVFP4. Invariant: rows are written
to the paged planes before any indexer or attention of the step reads them. Shapes never
depend on device data (tokens that close no group carry row id -1 and write nothing), so the
compressor runs inside a CUDA graph.
"""

from __future__ import annotations

import torch

from shoal.model.config import LayerSpec
from shoal.model.context import StepContext, rope_params, select


def run_compressor(ctx: StepContext, spec: LayerSpec, x: torch.Tensor,
                   rows: torch.Tensor | None) -> None:
    """x [P, D] bf16: the normed attention input of `rows` (None = every row of the step)."""
    ops, p, cfg = ctx.ops, ctx.params, ctx.config
    layer, r = spec.layer_id, spec.compress_ratio
    pre = f"layers.{layer}.attn.compressor."
    pos = select(ctx.batch.positions, rows)
    req = select(ctx.batch.req_index, rows)
    if spec.compressor_gated:
        xf = x.float()
        kv = ops.gemm_bf16(x=xf, weight=p[pre + "wkv.weight"], out_dtype=torch.float32)
        score = ops.gemm_bf16(x=xf, weight=p[pre + "wgate.weight"], out_dtype=torch.float32)
        state_kv, state_score = ctx.caches.comp_state[layer]
        # one row per token (row id -1 where no group closes): no host sync
        pooled, row_ids = ops.compress_pool(
            kv=kv, score=score, positions=pos, slots=select(ctx.token_slot, rows),
            state_kv=state_kv, state_score=state_score, ratio=r)
    else:
        pooled = ops.gemm_bf16(x=x, weight=p[pre + "wkv.weight"], out_dtype=torch.bfloat16)
        row_ids = pos
    if row_ids.numel() == 0:
        return
    write_start = ctx.batch.kv_write_start
    if write_start is not None:  # a prefix-cache replay: those rows are the cache's (shared)
        # (the boundary is a block boundary: no group straddles it)
        row_ids = torch.where(pos >= write_start[req], row_ids, -1)
    latent = ops.rmsnorm(x=pooled, weight=p[pre + "norm.weight"], eps=cfg.norm_eps)
    rope = rope_params(cfg, spec)
    row_pos = row_ids.clamp_min(0) * r  # a row stands for the first token of its group
    phys = ctx.paged_rows(layer, row_ids, req)  # -1 (skipped by the writers) where row_ids < 0
    idx = f"layers.{layer}.attn.indexer."
    k = ops.gemm_bf16(x=latent, weight=p[idx + "wk.weight"], out_dtype=torch.bfloat16)
    k = ops.rmsnorm(x=k, weight=p[idx + "k_norm.weight"], eps=cfg.norm_eps)
    k = ops.rope_tail(x=k, positions=row_pos, params=rope)
    ops.index_k_write(x=k, cache=ctx.caches.index_k[layer], rows=phys)
    latent = ops.rope_tail(x=latent, positions=row_pos, params=rope)
    ops.compressed_write(x=latent, cache=ctx.caches.compressed[layer], rows=phys)
