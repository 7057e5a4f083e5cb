"""Triton (sm_90) RMSNorm (`rmsnorm`, model.md §2.3) and the shared device predicate.

One program normalises ROWS rows of x [T, K] held whole in registers (K <= 8192): fp32
`sum(x^2) / K`, `rsqrt(var + eps)`, the weight multiply in fp32, then one bf16 rounding.
Invariant: same contract and bf16 tolerance as the reference; zero rows stay zero; masked tail
lanes load 0 (so padding never perturbs the statistic).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait

MAX_K = 8192


def on_device(t: torch.Tensor) -> bool:
    """Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter (tests)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "") == "1"


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, o_ptr, T, K, eps, stride_xt, stride_xk,
                    ROWS: tl.constexpr, BK: tl.constexpr):
    pdl_wait()
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BK)
    rmask = rows < T
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xk, mask=mask,
                other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=1) / K
    r = 1.0 / tl.sqrt_rn(var + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = w[None, :] * (x * r[:, None])
    tl.store(o_ptr + rows[:, None] * K + cols[None, :], y.to(tl.bfloat16), mask=mask)


def rmsnorm_launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, K] float (any strides) -> [T, K] bf16."""
    t, k = x.shape
    out = torch.empty(t, k, dtype=torch.bfloat16, device=x.device)
    if t == 0:
        return out
    bk = triton.next_power_of_2(k)
    rows = max(1, min(16, 2048 // bk))
    warps = 4 if bk <= 2048 else 8
    _rmsnorm_kernel[(triton.cdiv(t, rows),)](
        x, weight.contiguous(), out, t, k, float(eps), x.stride(0), x.stride(1),
        ROWS=rows, BK=bk, num_warps=warps, **PDL_LAUNCH)
    return out


def _supports(*, x: torch.Tensor, weight: torch.Tensor, **_) -> bool:
    return (on_device(x) and x.dim() == 2 and x.is_floating_point() and x.dtype.itemsize >= 2
            and 0 < x.shape[1] <= MAX_K and weight.shape == (x.shape[1],))


@REGISTRY.implement("triton", "rmsnorm", supports=_supports)
def rmsnorm(*, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, K] (bf16/fp16/fp32), weight [K] bf16 -> [T, K] bf16 (reference contract)."""
    return rmsnorm_launch(x, weight, eps)
