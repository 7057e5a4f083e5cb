"""One mHC block (model.md §2.2, V4.1 single-pass form), shared by backbone layers and DSpark
stages: coefficients from the stream, the attention sublayer collapsed with the *previous*
sublayer's pre, post-mix, then the FFN sublayer collapsed with this attention's pre.

Invariant: the block returns the new stream and its FFN pre only for `rows.full`; the caller
keeps the rest (tail-only prefill) and hands pre_f to the next block as its pre_prev.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shoal.model.context import StepContext, select
from shoal.model.moe import moe
from shoal.model.tail_prefill import ALL_ROWS, LayerRows


def _coeffs(ctx: StepContext, prefix: str, which: str, stream: torch.Tensor):
    p, cfg = ctx.params, ctx.config
    return ctx.ops.hc_coeffs(stream=stream, fn=p[f"{prefix}hc_{which}_fn"],
                             scale=p[f"{prefix}hc_{which}_scale"],
                             base=p[f"{prefix}hc_{which}_base"], norm_eps=cfg.norm_eps,
                             hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)


def mhc_block(ctx: StepContext, prefix: str, stream: torch.Tensor, pre_prev: torch.Tensor,
              attend: Callable[[torch.Tensor], torch.Tensor], num_experts_per_tok: int,
              rows: LayerRows = ALL_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """stream [T, hc, D] bf16, pre_prev [T, hc] fp32; attend(x [P, D]) -> y [F, D] for the
    attention input x of rows.prod. Returns (stream [F, hc, D], pre_f [F, hc]) of rows.full."""
    ops, p, eps = ctx.ops, ctx.params, ctx.config.norm_eps
    r_full = select(stream, rows.full)
    pre_a, post_a, comb_a = _coeffs(ctx, prefix, "attn", r_full)
    x = ops.hc_collapse_norm(stream=select(stream, rows.prod), pre=select(pre_prev, rows.prod),
                             weight=p[prefix + "attn_norm.weight"], eps=eps)
    r_full = ops.hc_post(y=attend(x), stream=r_full, post=post_a, comb=comb_a)
    pre_f, post_f, comb_f = _coeffs(ctx, prefix, "ffn", r_full)
    x = ops.hc_collapse_norm(stream=r_full, pre=pre_a, weight=p[prefix + "ffn_norm.weight"],
                             eps=eps)
    r_full = ops.hc_post(y=moe(ctx, prefix, x, num_experts_per_tok), stream=r_full,
                         post=post_f, comb=comb_f)
    return r_full, pre_f
