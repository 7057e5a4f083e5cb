"""Triton (sm_90) FP8 activation quantisation per 32 (model.md §5.2): the op `act_quant_fp8`
(codes and UE8M0 scales, bit-exact with the reference) and the folded form the FP8 GEMM and the
MoE feed their MMAs (`fold=True`: every block re-encoded relative to its row's largest block
exponent, one fp32 scale per row; see gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_xk,
                      FOLD: tl.constexpr, NB_P2: tl.constexpr, BLOCK: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    nb = K // BLOCK
    offs_b = tl.arange(0, NB_P2)
    offs_e = tl.arange(0, BLOCK)
    col = offs_b[:, None] * BLOCK + offs_e[None, :]
    mask = offs_b[:, None] < nb
    x = tl.load(x_ptr + row * stride_xm + col * stride_xk, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    p = amax * (1.0 / 448.0)
    bits = p.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # biased exponent of s
    e = tl.minimum(e, 253)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # exact 1/s
    q = tl.clamp(x * inv[:, None], -448.0, 448.0).to(tl.float8e4nv)
    if FOLD:
        top = tl.max(tl.where(offs_b < nb, e, 0), axis=0)
        sh = tl.maximum(e - top, -126)
        f = ((sh + 127) << 23).to(tl.float32, bitcast=True)
        q = (q.to(tl.float32) * f[:, None]).to(tl.float8e4nv)
        tl.store(s_ptr + row, (top << 23).to(tl.float32, bitcast=True))  # 2^(top - 127)
    else:
        tl.store(s_ptr + row * nb + offs_b, e.to(tl.uint8), mask=offs_b < nb)
    tl.store(q_ptr + row * K + col, q, mask=mask)


def act_quant(x: torch.Tensor, block: int, fold: bool,
               min_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (codes, scales). min_rows: the codes get at least that many rows, those
    beyond T left unwritten (padding for `gemm.gemm_fp8_folded(rows=T)`)."""
    t, k = x.shape
    q = torch.empty(max(t, min_rows), k, dtype=torch.float8_e4m3fn, device=x.device)
    s = (torch.empty(t, dtype=torch.float32, device=x.device) if fold else
         torch.empty(t, k // block, dtype=torch.uint8, device=x.device))
    if t:
        nb = k // block
        _act_quant_kernel[(t,)](x, q, s, k, x.stride(0), x.stride(1), FOLD=fold,
                                NB_P2=triton.next_power_of_2(nb), BLOCK=block,
                                num_warps=4 if k <= 2048 else 8, **PDL_LAUNCH)
    return q, s


def _supports_act(*, x: torch.Tensor, block: int = 32, **_) -> bool:
    return x.is_cuda and x.dim() == 2 and block == 32 and x.shape[1] % block == 0


@REGISTRY.implement("triton", "act_quant_fp8", supports=_supports_act)
def act_quant_fp8(*, x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference: codes [T, K] e4m3, scales [T, K/32] uint8 (bit-exact)."""
    return act_quant(x, block, fold=False)
