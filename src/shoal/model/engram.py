"""Engram of a layer (model.md §2.10): gather the 24 hashed FP8 rows of each token, project
them with engram.wkv to one key per stream plus a shared value, and mix the value into each
stream through a normalised-dot-product gate. Applied to the whole stream before the layer's
attention coefficients. The row ids come from `engram_hash` before the forward."""

from __future__ import annotations

import torch

from shoal.model.context import StepContext


def engram(ctx: StepContext, layer: int, stream: torch.Tensor,
           row_ids: torch.Tensor) -> torch.Tensor:
    """stream [T, hc, D] bf16, row_ids [T, n] int64 -> stream [T, hc, D] bf16."""
    ops, p = ctx.ops, ctx.params
    pre = f"layers.{layer}.engram."
    table = p[pre + "embed.weight"]
    rows = ops.engram_gather(table=table, table_scale=p[pre + "embed.scale"],
                             row_ids=row_ids.to(table.device))
    kv = ops.gemm_fp8(x=rows.to(stream.device), weight=p[pre + "wkv.weight"],
                      weight_scale=p[pre + "wkv.scale"])
    return ops.engram_mix(stream=stream, kv=kv, q_weight=p[pre + "q_weight"],
                          k_weight=p[pre + "k_weight"], eps=ctx.config.norm_eps)
