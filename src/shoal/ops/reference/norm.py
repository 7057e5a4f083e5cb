"""RMSNorm (model.md §2.3): y = bf16(w * x * rsqrt(mean(x^2) + eps)), all in fp32, the weight
multiply before the cast. eps is 1e-20 for every text norm (effectively zero). Same rounding as
the reference: the same fp32 torch expression (mean of squares, rsqrt, products)."""

from __future__ import annotations

import torch

from shoal.ops.reference._cases import randn
from shoal.ops.registry import REGISTRY, OpCase, Tolerance


def _case(t: int, k: int) -> OpCase:
    return OpCase(f"T{t}xK{k}", lambda g, d: {
        "x": randn(g, t, k, scale=3.0, device=d),
        "weight": randn(g, k, scale=0.1, device=d) + 1, "eps": 1e-20})


@REGISTRY.define("rmsnorm", tolerances={torch.bfloat16: Tolerance(atol=1e-2, rtol=8e-3)},
                 cases=[_case(1, 128), _case(7, 512), _case(0, 64), _case(83, 1280),
                        _case(769, 5120)])
def rmsnorm(*, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, K] (any float dtype), weight [K] bf16 -> [T, K] bf16. Zero rows stay zero."""
    return rms_normalise(x.float(), weight, eps)


def rms_normalise(xf: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The official RMSNorm's fp32 expression on xf [T, K] fp32 -> bf16."""
    return (weight.float() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))
            ).to(torch.bfloat16)
