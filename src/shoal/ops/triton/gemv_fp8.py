"""Triton FP8 GEMV for decode-size `gemm_fp8` calls (M <= 8 rows): memory-bound, so no tensor
cores and no separate activation-quantisation launch.

Each program owns BN weight rows and one K slice. It quantises its slice of the (at most 8)
activation rows itself, exactly as model.md §5.2 and the reference (`quant_fp8_act`): per
32-block, UE8M0 scale 2^e with e the smallest exponent such that amax / 2^e <= 448 (amax
floored at 1e-4), codes e4m3 round-to-nearest-even. The e4m3 rounding is done in fp32 integer
arithmetic, so the Triton interpreter (whose fp8 cast truncates) computes the same bits as the
GPU. Both operands are dequantised exactly (codes x power-of-two scales), every product is exact
in fp32 (two 4-bit significands) and the K sum is fp32 in a fixed order (slices reduced in index
order), so the result does not depend on timing; it is more exact than the wgmma kernel
(gemm.py), whose FP8 adds keep about 14 bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 8


@triton.jit
def _e4m3_rne(v):
    """fp32 v with |v| <= 448 -> the nearest e4m3 value (ties to even), as fp32."""
    b = v.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = (v + 24576.0) - 24576.0  # fp32 spacing at 1.5 * 2^14 is 2^-9: RNE to e4m3's grid
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, M, N, K, stride_xm,
                     MR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    rn = offs_n.to(tl.int64)
    rm = tl.arange(0, MR)
    mmask = rm < M
    KB = K // 32
    per = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
    k0 = pid_k * per
    k1 = tl.minimum(k0 + per, K)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((MR, BN), dtype=tl.float32)
    for kk in range(k0, k1, BK):
        kmask = kk + offs_k < k1
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (kk + offs_k)[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        xb = tl.reshape(x, (MR, BK // 32, 32))
        amax = tl.maximum(tl.max(tl.abs(xb), axis=2), 1e-4)
        bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # biased exp of s
        e = tl.minimum(e, 253)
        inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # exact 1 / s
        s_x = (e << 23).to(tl.float32, bitcast=True)  # s = 2^(e - 127)
        q = _e4m3_rne(tl.clamp(xb * inv[:, :, None], -448.0, 448.0))
        xd = tl.reshape(q * s_x[:, :, None], (MR, BK))
        w = tl.load(w_ptr + rn[:, None] * K + (kk + offs_k)[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        kb = kk // 32 + tl.arange(0, BK // 32)
        sb = tl.load(s_ptr + (rn // 32)[:, None] * KB + kb[None, :],
                     mask=nmask[:, None] & (kb[None, :] < KB), other=127).to(tl.int32)
        s_w = tl.where(sb == 255, float("nan"),
                       tl.where(sb == 0, 2.0**-127, (sb << 23).to(tl.float32, bitcast=True)))
        wd = tl.reshape(tl.reshape(w, (BN, BK // 32, 32)) * s_w[:, :, None], (BN, BK))
        acc += tl.sum(xd[:, None, :] * wd[None, :, :], axis=2)
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + rm[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(tl.bfloat16),
                 mask=omask)
    else:
        tl.store(ws_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * N + offs_n[None, :], acc,
                 mask=omask)


@triton.jit
def _sum_splits_kernel(ws_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # index order: the sum does not depend on timing
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=mask)


def gemv_splits(n: int, k: int, bn: int, sms: int) -> int:
    """K slices: enough programs for ~4 per SM, each slice >= 512 of K (a power of two)."""
    split = 1
    while triton.cdiv(n, bn) * split < 4 * sms and k // (split * 2) >= 512:
        split *= 2
    return split


def gemv_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
             split: int | None = None, bn: int = 32) -> torch.Tensor:
    """y [M, N] bf16 = quant_fp8_act(x [M, K] bf16) @ (weight [N, K] e4m3 x 2^(weight_scale
    [ceil(N/32), K/32] - 127))^T for M <= GEMV_MAX_ROWS, K a multiple of 32 (see the module
    docstring). UE8M0 byte 0 is 2^-127, 255 is NaN (as the reference)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > GEMV_MAX_ROWS or k % 32 or weight.shape[1] != k:
        raise ValueError(f"gemv_fp8: x {tuple(x.shape)}, weight {tuple(weight.shape)}: needs "
                         f"M <= {GEMV_MAX_ROWS} and a common K that is a multiple of 32")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    mr = max(2, triton.next_power_of_2(m))
    bk = max(32, 256 // mr)  # the [MR, BN, BK] product tile: 64 fp32 registers per thread
    while k % bk:
        bk //= 2
    if split is None:
        sms = (torch.cuda.get_device_properties(x.device).multi_processor_count
               if x.is_cuda else 132)
        split = gemv_splits(n, k, bn, sms)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    xc = x if x.stride(1) == 1 else x.contiguous()
    _gemv_fp8_kernel[(triton.cdiv(n, bn), split)](
        xc, weight, weight_scale, out, ws, m, n, k, xc.stride(0),
        MR=mr, BN=bn, BK=bk, SPLIT=split, num_warps=4,
        num_stages=4)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](ws, out, m * n, SPLIT=split,
                                                         BLOCK=block)
    return out
