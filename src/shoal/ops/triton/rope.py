"""Triton (sm_90) rotary embedding on the last rope_dim dims, GPT-J interleaved (`rope_tail`,
model.md §2.4).

One program per (token, block of heads) copies the pass-through dims and rotates pairs
(2i, 2i+1) of the tail by angle `fp32(p) * f_i` (one fp32 rounding), with fp32 cos/sin and an
fp32 rotation, then rounds to bf16. The [rd/2] frequency vector (YaRN ramp included) comes from
the reference `rope_frequencies`, computed once per (params, device) and cached.
Invariant: same contract as the reference; cos/sin are libdevice's accurate `cosf`/`sinf`
(full range reduction: angles reach 1e6 rad), so results differ from torch by an fp32 ulp at most
before the bf16 rounding.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from shoal.ops.reference.rope import RopeParams, rope_frequencies
from shoal.ops.registry import REGISTRY
from shoal.ops.triton.norm import on_device
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait


@functools.lru_cache(maxsize=64)
def _freqs(params: RopeParams, device: torch.device) -> torch.Tensor:
    return rope_frequencies(params, device).contiguous()


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, f_ptr, o_ptr, H, N, sx_t, sx_h, sx_n, SIGN: tl.constexpr,
                 RD: tl.constexpr, BH: tl.constexpr, BP: tl.constexpr,
                 LIBDEVICE: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = hh < H
    xb = x_ptr + t * sx_t + hh[:, None] * sx_h
    ob = o_ptr + (t * H + hh[:, None]) * N
    npass = N - RD
    for c0 in range(0, npass, BP):  # pass-through dims
        cc = c0 + tl.arange(0, BP)
        m = hmask[:, None] & (cc[None, :] < npass)
        tl.store(ob + cc[None, :], tl.load(xb + cc[None, :] * sx_n, mask=m), mask=m)
    i = tl.arange(0, RD // 2)
    ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(f_ptr + i)
    if LIBDEVICE:
        cos = libdevice.cos(ang)
        sin = libdevice.sin(ang)
    else:
        cos = tl.cos(ang)
        sin = tl.sin(ang)
    sin = sin * SIGN
    ce = npass + 2 * i
    re = tl.load(xb + ce[None, :] * sx_n, mask=hmask[:, None], other=0.0).to(tl.float32)
    im = tl.load(xb + (ce[None, :] + 1) * sx_n, mask=hmask[:, None], other=0.0).to(tl.float32)
    out_re = re * cos[None, :] - im * sin[None, :]
    out_im = re * sin[None, :] + im * cos[None, :]
    tl.store(ob + ce[None, :], out_re.to(tl.bfloat16), mask=hmask[:, None])
    tl.store(ob + ce[None, :] + 1, out_im.to(tl.bfloat16), mask=hmask[:, None])


def _supports(*, x: torch.Tensor, positions: torch.Tensor, params: RopeParams, **_) -> bool:
    rd = params.rope_dim
    return (on_device(x) and x.dtype == torch.bfloat16 and x.dim() in (2, 3)
            and rd >= 2 and (rd & (rd - 1)) == 0 and rd <= x.shape[-1]
            and positions.shape == (x.shape[0],))


@REGISTRY.implement("triton", "rope_tail", supports=_supports)
def rope_tail(*, x: torch.Tensor, positions: torch.Tensor, params: RopeParams,
              inverse: bool = False) -> torch.Tensor:
    """x [T, n] or [T, H, n] bf16, positions [T] int -> new bf16 tensor (reference contract)."""
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    t, h, n = x3.shape
    out = torch.empty(t, h, n, dtype=torch.bfloat16, device=x.device)
    if t and h:
        rd = params.rope_dim
        bh = min(16, triton.next_power_of_2(h))
        interp = os.environ.get("TRITON_INTERPRET", "") == "1"
        _rope_kernel[(t, triton.cdiv(h, bh))](
            x3, positions, _freqs(params, x.device), out, h, n, x3.stride(0), x3.stride(1),
            x3.stride(2), SIGN=-1.0 if inverse else 1.0, RD=rd, BH=bh,
            BP=min(256, triton.next_power_of_2(max(n - rd, 1))), LIBDEVICE=not interp,
            num_warps=4, **PDL_LAUNCH)
    return out.view(x.shape)
