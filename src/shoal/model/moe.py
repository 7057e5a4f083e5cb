"""Mixture of experts of a block (model.md §2.9): router, routed MXFP4 experts (FP8
activations) and the FP8 shared expert; y = bf16(sum_k routed_k + shared) in fp32. Under
expert parallelism the routed experts run on their ranks (`parallel/expert_parallel.py`)."""

from __future__ import annotations

import torch

from shoal.model.context import StepContext


def moe(ctx: StepContext, prefix: str, x: torch.Tensor, num_experts_per_tok: int) -> torch.Tensor:
    """x [F, D] bf16 (ffn_norm output) -> [F, D] bf16. prefix: 'layers.L.' or 'mtp.i.'."""
    ops, p, cfg = ctx.ops, ctx.params, ctx.config
    ffn = prefix + "ffn."
    ids, weights = ops.router(x=x, weight=p[ffn + "gate.weight"], bias=p[ffn + "gate.bias"],
                              k=num_experts_per_tok, route_scale=cfg.routed_scaling_factor,
                              gate_temp=cfg.gate_temp)
    if ctx.expert_loads is not None:
        e_total = cfg.dspark_n_routed_experts if prefix.startswith("mtp.") else \
            cfg.n_routed_experts
        counts = ctx.expert_loads.setdefault(prefix, torch.zeros(
            e_total, dtype=torch.int64, device=ids.device))
        counts += torch.bincount(ids.reshape(-1), minlength=e_total)
    se = ffn + "shared_experts."
    w13 = p.fused(se + "w1+w3")
    if w13 is not None:  # one GEMM: gate columns, then up columns
        gu = ops.gemm_fp8(x=x, weight=w13[0], weight_scale=w13[1])
        gate, up = gu[:, :w13[2]], gu[:, w13[2]:]
    else:
        gate = ops.gemm_fp8(x=x, weight=p[se + "w1.weight"], weight_scale=p[se + "w1.scale"])
        up = ops.gemm_fp8(x=x, weight=p[se + "w3.weight"], weight_scale=p[se + "w3.scale"])
    h = ops.swiglu_clamp(gate=gate, up=up, weight=None, limit=cfg.swiglu_limit)  # bf16 in
    shared = ops.gemm_fp8(x=h, weight=p[se + "w2.weight"], weight_scale=p[se + "w2.scale"])
    if ctx.ep is not None:
        return ctx.ep.moe(ops, x, ids, weights, shared, p.experts(prefix), cfg.swiglu_limit,
                          prefix)
    # bf16(sum of the routed outputs + shared) in fp32, added and rounded inside the op
    return ops.moe_mxfp4(x=x, ids=ids, weights=weights, limit=cfg.swiglu_limit, shared=shared,
                         **p.experts(prefix))
