"""Triton (sm_90) batch-invariant GEMM with a bf16 weight: y = x @ W^T (`gemm_nt`), used by the
`gemm_bf16` op (ops/triton/gemm.py) and the output heads (ops/triton/head.py).

bf16 x bf16 products on the tensor cores, fp32 accumulation. An fp32 x is split exactly into
three bf16 terms (x = x1 + x2 + x3: each takes the next 8 significant bits; the residuals are
exact in fp32), so its products with the bf16 weight are exact too ("3xBF16", not TF32).
Batch invariance: the tile shape (NT_BM rows), the K chunking and the order in which chunk
partials are added depend only on (N, K), never on M, so a row's result is the same in every
batch. K is cut into SPLIT chunks of KS values; each chunk's partial starts from zero and the
partials are added in the order 0, 1, ... . For small M (decode) the chunks run in parallel
programs and a second launch adds them; for larger M one program walks the chunks itself. The
sums are the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from shoal.ops.triton.engram import bf16_rne
from shoal.ops.triton.norm import on_device
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait

NT_BM = 16  # rows per tile, for every M (one tl.dot shape: the same MMA instruction always)
NT_TARGET_PROGRAMS = 264  # split K until the N tiles x chunks cover ~2 waves of 132 SMs
NT_MIN_CHUNK = 512  # never cut K below this many values per chunk
NT_SPLIT_MAX_M = 64  # above this, chunks are walked inside one program (no partial buffer)
# Wider row tiles (64, one warpgroup MMA) for M > NT_BM. Off: a 16-row tile and a 64-row tile
# may use different MMA instructions, and the rows' bits must not depend on M. Turn on only
# after benchmarks/bench_ops.py --only head reports bits_equal_default=True for block_m 64 and
# tests/kernels/test_triton_head.py passes with it on the H200 (it saves re-reading the weight once
# per 16 rows from L2 at large M).
NT_WIDE_M = False


@dataclass(frozen=True)
class NTConfig:
    """Launch shape of the bf16-weight GEMM for a weight [N, K]; a function of (N, K) only.

    block_m stays NT_BM in every config the ops use (another value may change the MMA
    instruction, hence the bits; benchmarks/bench_ops.py measures whether it does)."""

    block_n: int
    block_k: int
    split: int  # number of K chunks
    chunk: int  # K values per chunk (a multiple of block_k)
    num_warps: int
    num_stages: int
    block_m: int = NT_BM


def nt_config(n: int, k: int) -> NTConfig:
    """The fixed config of weight shape [N, K] (never a function of M: batch invariance)."""
    bn = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    bk = 128 if k >= 128 else max(16, triton.next_power_of_2(k))
    n_tiles = triton.cdiv(n, bn)
    split = max(1, min(triton.cdiv(NT_TARGET_PROGRAMS, n_tiles), k // NT_MIN_CHUNK, 16))
    chunk = triton.cdiv(triton.cdiv(k, split), bk) * bk
    return NTConfig(bn, bk, triton.cdiv(k, chunk), chunk, 4, 4)


@triton.jit
def split_bf16x3(x):
    """fp32 x -> bf16 (x1, x2, x3) with x = x1 + x2 + x3 exactly (each the next 8 significant
    bits; the residuals are exact in fp32): products of the terms with a bf16 operand are exact
    on the tensor cores ("3xBF16")."""
    x1 = x.to(tl.bfloat16)
    r1 = x - x1.to(tl.float32)
    x2 = r1.to(tl.bfloat16)
    x3 = (r1 - x2.to(tl.float32)).to(tl.bfloat16)
    return x1, x2, x3


@triton.jit
def _nt_chunk(x_ptr, w_ptr, rm, rn, k_lo, k_hi, M, N, x_m, x_k, w_n, w_k,
              X_F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """fp32 partial [BM, BN] of x[rm, k_lo:k_hi] . W[rn, k_lo:k_hi]^T, from zero, K ascending."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    lo = tl.zeros((BM, BN), dtype=tl.float32)  # x2, x3 terms: ~2^-8 of acc, own accumulator
    offs_k = tl.arange(0, BK)
    for k0 in range(k_lo, k_hi, BK):
        rk = k0 + offs_k
        kmask = rk < k_hi
        x = tl.load(x_ptr + rm[:, None] * x_m + rk[None, :] * x_k,
                    mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * w_n + rk[:, None] * w_k,
                    mask=(rn[None, :] < N) & kmask[:, None], other=0.0)
        if X_F32:  # x = x1 + x2 + x3 exactly (bf16 terms), products exact on the tensor cores
            x1, x2, x3 = split_bf16x3(x)
            acc = tl.dot(x1, w, acc)
            lo = tl.dot(x2, w, lo)
            lo = tl.dot(x3, w, lo)
        else:
            acc = tl.dot(x, w, acc)
    if X_F32:  # the low terms' accumulation error stays ~2^-8 below the main sum's
        acc += lo
    return acc


@triton.jit
def _nt_store(o_ptr, acc, rm, rn, M, N, OUT_BF16: tl.constexpr):
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    off = rm[:, None] * N + rn[None, :]
    if OUT_BF16:
        tl.store(o_ptr + off, bf16_rne(acc), mask=mask)
    else:
        tl.store(o_ptr + off, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _nt_gemm_kernel(x_ptr, w_ptr, o_ptr, M, N, K, CHUNK, x_m, x_k, w_n, w_k,
                    SPLIT: tl.constexpr, PARTIAL: tl.constexpr, X_F32: tl.constexpr,
                    OUT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    """PARTIAL: program (m, n, s) writes chunk s's partial to o_ptr [SPLIT, M, N] fp32.
    Else program (m, n) adds the SPLIT chunk partials in order and writes the output [M, N]."""
    pdl_wait()
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    if PARTIAL:
        s = tl.program_id(2)
        k_lo = s * CHUNK
        acc = _nt_chunk(x_ptr, w_ptr, rm, rn, k_lo, tl.minimum(k_lo + CHUNK, K), M, N, x_m,
                        x_k, w_n, w_k, X_F32, BM, BN, BK)
        _nt_store(o_ptr + s.to(tl.int64) * M * N, acc, rm, rn, M, N, False)
    else:
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for s in range(SPLIT):
            k_lo = s * CHUNK
            total += _nt_chunk(x_ptr, w_ptr, rm, rn, k_lo, tl.minimum(k_lo + CHUNK, K), M, N,
                               x_m, x_k, w_n, w_k, X_F32, BM, BN, BK)
        _nt_store(o_ptr, total, rm, rn, M, N, OUT_BF16)


@triton.jit
def _nt_reduce_kernel(p_ptr, o_ptr, MN, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr,
                      BLOCK: tl.constexpr):
    """o = sum over s = 0, 1, ... of p[s] (fp32, in that order), cast to the output dtype."""
    pdl_wait()
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < MN
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(p_ptr + s * MN + idx, mask=mask, other=0.0)
    if OUT_BF16:
        tl.store(o_ptr + idx, bf16_rne(total), mask=mask)
    else:
        tl.store(o_ptr + idx, total, mask=mask)


def gemm_nt(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
            config: NTConfig | None = None, partial: bool | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] (bf16 or fp32, any strides) @ weight [N, K]^T (bf16), fp32
    accumulation, cast to `out_dtype` (fp32, or bf16 round-to-nearest-even).

    `config` defaults to `nt_config(N, K)`; `partial` (parallel chunks + reduce) defaults to
    M <= NT_SPLIT_MAX_M. Both only change speed, never the result (see the section comment).
    """
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or nt_config(n, k)
    if config is None and NT_WIDE_M and m > NT_BM:
        cfg = replace(cfg, block_m=64)
    out_bf16 = out_dtype == torch.bfloat16
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    o_view = out.view(torch.int16) if out_bf16 else out
    x_f32 = x.dtype == torch.float32
    if partial is None:
        partial = m <= NT_SPLIT_MAX_M
    partial = partial and cfg.split > 1
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    args = (x, weight)
    strides = (x.stride(0), x.stride(1), weight.stride(0), weight.stride(1))
    meta = dict(SPLIT=cfg.split, X_F32=x_f32, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if partial:
        part = torch.empty(cfg.split, m, n, dtype=torch.float32, device=x.device)
        _nt_gemm_kernel[(*grid, cfg.split)](*args, part, m, n, k, cfg.chunk, *strides,
                                            PARTIAL=True, OUT_BF16=False, **meta, **PDL_LAUNCH)
        block = 1024
        _nt_reduce_kernel[(triton.cdiv(m * n, block),)](part, o_view, m * n, SPLIT=cfg.split,
                                                        OUT_BF16=out_bf16, BLOCK=block,
                                                        num_warps=4, **PDL_LAUNCH)
    else:
        _nt_gemm_kernel[grid](*args, o_view, m, n, k, cfg.chunk, *strides, PARTIAL=False,
                              OUT_BF16=out_bf16, **meta, **PDL_LAUNCH)
    return out


def supports_nt(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Shapes and dtypes `gemm_nt` takes (anything else falls back to the reference)."""
    return (on_device(x) and x.dim() == 2 and weight.dim() == 2
            and x.shape[1] == weight.shape[1] and weight.dtype == torch.bfloat16
            and x.dtype in (torch.bfloat16, torch.float32)
            and out_dtype in (torch.bfloat16, torch.float32))
