"""Triton (sm_90) `swiglu_clamp` (model.md §2.9; the reference lives in ops/reference/moe.py).

h = bf16(silu(min(g, limit)) * clamp(u, -limit, limit) [* w]): silu evaluated in fp64 and rounded
to fp32 as the reference does, the products in fp32 in the reference's order, one
round-to-nearest-even to bf16 (on the bits). Bit-identical to the reference except where the
fp64 silu of the two libraries differ in the last fp64 ulp across an fp32 rounding boundary.
Invariant: elementwise, so batch-invariant; rows with weight None skip the routing multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.engram import bf16_rne
from shoal.ops.triton.norm import on_device
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, w_ptr, o_ptr, I, limit, g_t, g_i, u_t, u_i,
                   HAS_W: tl.constexpr, LIBDEVICE: tl.constexpr, BI: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    ii = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = ii < I
    g = tl.load(g_ptr + t * g_t + ii * g_i, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * u_t + ii * u_i, mask=mask, other=0.0).to(tl.float32)
    # NaN stays NaN, as torch.clamp (the enum must appear inline: a jit local cannot hold it)
    u = tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL).to(tl.float64)
    if LIBDEVICE:  # fp64 exp from libdevice (__nv_exp) on the GPU
        e = libdevice.exp(-g)
    else:  # the interpreter has no libdevice; its tl.exp is NumPy's fp64 exp
        e = tl.exp(-g)
    silu = (g / (1.0 + e)).to(tl.float32)
    h = silu * u
    if HAS_W:
        h = tl.load(w_ptr + t).to(tl.float32) * h
    tl.store(o_ptr + t * I + ii, bf16_rne(h), mask=mask)


def _supports(*, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None,
              **_) -> bool:
    return (on_device(gate) and gate.dim() == 2 and up.shape == gate.shape
            and (weight is None or weight.shape == gate.shape[:1]))


@REGISTRY.implement("triton", "swiglu_clamp", supports=_supports)
def swiglu_clamp(*, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None,
                 limit: float) -> torch.Tensor:
    """gate, up [T, I] fp32 or bf16 (any strides), weight [T] fp32 or None -> h [T, I] bf16."""
    t, inter = gate.shape
    out = torch.empty(t, inter, dtype=torch.bfloat16, device=gate.device)
    if t == 0 or inter == 0:
        return out
    bi = min(1024, triton.next_power_of_2(inter))
    w = weight.contiguous() if weight is not None else gate
    _swiglu_kernel[(t, triton.cdiv(inter, bi))](
        gate, up, w, out.view(torch.int16), inter, float(limit), gate.stride(0), gate.stride(1),
        up.stride(0), up.stride(1), HAS_W=weight is not None, LIBDEVICE=gate.is_cuda, BI=bi,
        num_warps=4, **PDL_LAUNCH)
    return out
