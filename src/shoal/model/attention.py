"""Attention sublayer of every layer (model.md §2.5): q / SWA kv projections, the compressed
path of its role (compressor for kv sources, indexer for index sources, shared top-k for the
rest), sparse MQA with sink over the SWA ring + selected compressed rows, inverse RoPE and the
grouped low-rank output projection.

Rows: the layer input `x` covers `rows.prod`; SWA kv is written for `rows.kv`; the rest runs for
`rows.full` (tail-only prefill, see batch.py). Invariant: the SWA keys of the step are written to
scratch rows before attention and committed to the rings after it.
"""

from __future__ import annotations

import torch

from shoal.model.compressor import run_compressor
from shoal.model.config import LayerRole, LayerSpec
from shoal.model.context import StepContext, rope_params, select
from shoal.model.indexer import run_indexer
from shoal.model.tail_prefill import LayerRows


def _local(sub: torch.Tensor | None, sup: torch.Tensor | None) -> torch.Tensor | None:
    """Positions of row set `sub` inside row set `sup` (sorted index tensors; None = all)."""
    if sup is None:
        return sub
    assert sub is not None, "a row subset cannot cover more than its superset"
    return torch.searchsorted(sup, sub)


def swa_kv(ctx: StepContext, prefix: str, spec: LayerSpec, x: torch.Tensor,
           rows: torch.Tensor | None, kv: torch.Tensor | None = None) -> None:
    """kv = RoPE(kv_norm(wkv . x)) at p, stored as MXFP8 records in the scratch rows (kv: wkv . x
    already computed)."""
    ops, p, cfg = ctx.ops, ctx.params, ctx.config
    if kv is None:
        kv = ops.gemm_fp8(x=x, weight=p[prefix + "attn.wkv.weight"],
                          weight_scale=p[prefix + "attn.wkv.scale"])
    kv = ops.rmsnorm(x=kv, weight=p[prefix + "attn.kv_norm.weight"], eps=cfg.norm_eps)
    kv = ops.rope_tail(x=kv, positions=select(ctx.batch.positions, rows),
                       params=rope_params(cfg, spec))
    ops.swa_write(x=kv, cache=ctx.caches.swa[spec.layer_id], rows=ctx.scratch_rows(rows))


def project_q(ctx: StepContext, prefix: str, spec: LayerSpec, x: torch.Tensor,
              positions: torch.Tensor,
              qa: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """qr = q_norm(wq_a . x) [F, q_lora]; q = RoPE(wq_b . qr) at p [F, H, head_dim] (qa: wq_a . x
    already computed)."""
    ops, p, cfg = ctx.ops, ctx.params, ctx.config
    if qa is None:
        qa = ops.gemm_fp8(x=x, weight=p[prefix + "attn.wq_a.weight"],
                          weight_scale=p[prefix + "attn.wq_a.scale"])
    qr = ops.rmsnorm(x=qa, weight=p[prefix + "attn.q_norm.weight"], eps=cfg.norm_eps)
    q = ops.gemm_fp8(x=qr, weight=p[prefix + "attn.wq_b.weight"],
                     weight_scale=p[prefix + "attn.wq_b.scale"])
    q = q.view(positions.shape[0], cfg.num_heads, cfg.head_dim)
    return qr, ops.rope_tail(x=q, positions=positions, params=rope_params(cfg, spec))


def attend_and_project(ctx: StepContext, prefix: str, spec: LayerSpec, q: torch.Tensor,
                       positions: torch.Tensor, swa_idx: torch.Tensor,
                       comp_cache: torch.Tensor | None,
                       comp_idx: torch.Tensor | None) -> torch.Tensor:
    """Sparse MQA with sink over the layer's SWA plane (+ compressed rows), inverse RoPE, and the
    grouped low-rank output projection: q [F, H, head_dim] -> y [F, D] bf16."""
    ops, p, cfg = ctx.ops, ctx.params, ctx.config
    o = ops.sparse_attn_sink(q=q, swa_cache=ctx.caches.swa[spec.layer_id], swa_idx=swa_idx,
                             comp_cache=comp_cache, comp_idx=comp_idx,
                             sink=p[prefix + "attn.attn_sink"], scale=cfg.head_dim ** -0.5)
    o = ops.rope_tail(x=o, positions=positions, params=rope_params(cfg, spec), inverse=True)
    f = positions.shape[0]
    z = ops.gemm_grouped_w8a16(
        o=o.view(f, cfg.o_groups, cfg.num_heads // cfg.o_groups * cfg.head_dim),
        weight=p[prefix + "attn.wo_a.weight"], weight_scale=p[prefix + "attn.wo_a.scale"])
    return ops.gemm_fp8(x=z, weight=p[prefix + "attn.wo_b.weight"],
                        weight_scale=p[prefix + "attn.wo_b.scale"])


def attention(ctx: StepContext, spec: LayerSpec, x: torch.Tensor,
              rows: LayerRows) -> torch.Tensor:
    """x [P, D] bf16 (normed collapse of rows.prod) -> y [F, D] bf16 for rows.full."""
    b = ctx.batch
    prefix = f"layers.{spec.layer_id}."
    full = rows.full
    xf = select(x, _local(full, rows.prod))
    pos = select(b.positions, full)
    both = ctx.params.fused(prefix + "attn.wq_a+wkv") if rows.kv is full else None
    qa = kv = None
    if both is not None:  # the same rows need q and kv (every layer of a decode step)
        qakv = ctx.ops.gemm_fp8(x=xf, weight=both[0], weight_scale=both[1])
        qa, kv = qakv[:, :both[2]], qakv[:, both[2]:]
    swa_kv(ctx, prefix, spec, select(x, _local(rows.kv, rows.prod)), rows.kv, kv=kv)
    if spec.role is LayerRole.FULL:
        run_compressor(ctx, spec, x, rows.prod)
    qr, q = project_q(ctx, prefix, spec, xf, pos, qa=qa)
    comp_cache = comp_idx = None
    if spec.compress_ratio > 0:
        if spec.owns_index_query:
            run_indexer(ctx, spec, xf, qr, full)
        comp_idx = ctx.compressed_rows(spec.topk_source, spec.kv_source, full)
        comp_cache = ctx.caches.compressed[spec.kv_source]
    swa_rows = ctx.swa_rows_decoder if spec.is_decoder else ctx.swa_rows_encoder
    y = attend_and_project(ctx, prefix, spec, q, pos, select(swa_rows, full), comp_cache,
                           comp_idx)
    ctx.commit_swa(spec.layer_id, rows.kv)
    return y
