"""Triton (sm_90) FP8 GEMM with the UE8M0 block scales applied exactly: every 32-wide K step is
its own FP8 tensor-core product, formed from zero and added to the fp32 accumulator times
s_a[row, kb] * s_w[col // 32, kb] (the checkpoint's 32x32 weight blocks, the per-32 activation
blocks of model.md §5.2).

Why (gemm.py's `gemm_fp8_folded` was the default before): its main loop chains the accumulator
through FP8 wgmma, which adds in reduced precision; the H200 in-situ check
(tests/gpu/test_model_gpu.py, 2026-11-29) found `mini`'s engram.wkv GEMM (K = 6144) with 25 of
5.35M outputs over the op's tolerance (worst |diff| 0.0166 at 0.128), which a CPU model of that
accumulator reproduces (benchmarks/fold_loss.py). Its scale folding also rounds or flushes small
codes of blocks far below their row's largest (inside the tolerance on the dummy weights). Here
products are exact (e4m3 x e4m3), each 32-term sum starts from zero and is added in fp32, and
the scales are never folded.

Owns `gemm_fp8_blockwise` (codes + scales in, bf16 out), its split-K reduce and its tile set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCALE_BLOCK = 32  # K elements per UE8M0 scale; also the rows of a weight scale block


def _configs() -> list[triton.Config]:
    """Tiles without register spills in the sm_90 build (ptxas via AOT compile, 2026-11-29:
    every 32-K product is its own wgmma result held next to the accumulator, so wider tiles or
    more K steps per iteration spill: 128x128x64 spills 88 B, 128x256x32 224 B)."""
    out = []
    for bm, bn, bk, warps, stages in [(128, 128, 32, 8, 4), (128, 128, 32, 8, 5),
                                      (128, 64, 64, 4, 4), (64, 128, 64, 4, 5),
                                      (64, 128, 32, 4, 6), (64, 64, 64, 4, 5)]:
        out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                                 num_warps=warps, num_stages=stages))
    return out


def _prune(configs, named_args, **kwargs):
    m_bucket = named_args["M_BUCKET"]
    keep = [c for c in configs if (m_bucket <= 64) == (c.kwargs["BLOCK_M"] == 64)]
    return keep or configs[:1]


@triton.jit
def _ue8m0(byte):
    """UE8M0 byte -> fp32 2^(byte - 127): 0 -> 2^-127 (subnormal), 255 -> NaN."""
    e = byte.to(tl.int32)
    bits = tl.where(e == 0, 0x00400000, tl.where(e == 255, 0x7FC00000, e << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def tile_offsets(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """Row and column offsets of output tile `pid`, in GROUP_M-row bands (L2 reuse)."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "SPLIT_K"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _blockwise_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, ws_ptr, M, N, K, M_BUCKET,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """c[M, N] = sum_kb s_a[m, kb] s_w[n // 32, kb] (a[m, kb] . b[n, kb]) over the 32-blocks kb
    of this program's K range (SPLIT_K > 1: fp32 partial sums to ws[pid_k]). a [M, K] and
    b [N, K] e4m3 (row-major), as [M, K/32] and bs [ceil(N/32), K/32] UE8M0 bytes."""
    pid_k = tl.program_id(1)
    offs_m, offs_n = tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    kb_total = K // 32
    kb_per = tl.cdiv(tl.cdiv(kb_total, BLOCK_K // 32), SPLIT_K) * (BLOCK_K // 32)
    kb0 = pid_k * kb_per
    kb_end = tl.minimum(kb0 + kb_per, kb_total)
    offs_s = tl.arange(0, 32)
    a_rows = a_ptr + rm[:, None] * K + offs_s[None, :]
    b_cols = b_ptr + rn[None, :] * K + offs_s[:, None]
    as_rows = as_ptr + rm * kb_total
    bs_cols = bs_ptr + (rn // 32) * kb_total
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb0, kb_end, BLOCK_K // 32):
        for j in tl.static_range(BLOCK_K // 32):
            b_idx = kb + j
            ok = b_idx < kb_end
            a = tl.load(a_rows + b_idx * 32, mask=ok, other=0.0)
            b = tl.load(b_cols + b_idx * 32, mask=ok, other=0.0)
            sa = _ue8m0(tl.load(as_rows + b_idx, mask=ok, other=127))
            sb = _ue8m0(tl.load(bs_cols + b_idx, mask=ok, other=127))
            acc = tl.fma(tl.dot(a, b) * sa[:, None], sb[None, :], acc)  # sa, sb: powers of 2
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(tl.bfloat16),
                 mask=mask)
    else:
        ws = ws_ptr + pid_k.to(tl.int64) * M * N
        tl.store(ws + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _reduce_kernel(ws_ptr, c_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the result does not depend on timing
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(tl.bfloat16), mask=mask)


def split_k(m: int, n: int, k: int, sms: int) -> int:
    """K splits for small M (decode): enough programs to fill the SMs, >= 512 K per split."""
    if m > 64:
        return 1
    tiles = triton.cdiv(n, 128)
    split = 1
    while tiles * split * 2 <= 2 * sms and k // (split * 2) >= 512:
        split *= 2
    return split


def gemm_fp8_blockwise(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                       w_scale: torch.Tensor, *, split: int | None = None,
                       tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """y [M, N] bf16 = blockwise (a [M, K] e4m3 x 2^(a_scale [M, K/32] - 127)) @
    (w [N, K] e4m3 x 2^(w_scale [ceil(N/32), K/32] - 127))^T, K a multiple of 32.
    split: K splits (default `split_k`; partial sums reduced in a fixed order). tile:
    (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) instead of the autotuned choice (tests under the
    Triton interpreter, benchmarks)."""
    m, k = a.shape
    n = w.shape[0]
    if k % SCALE_BLOCK or w.shape[1] != k:
        raise ValueError(f"gemm_fp8_blockwise: K={k} (weight {tuple(w.shape)}) must match and "
                         f"be a multiple of {SCALE_BLOCK}")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if split is None:
        sms = (torch.cuda.get_device_properties(a.device).multi_processor_count
               if a.is_cuda else 132)
        split = split_k(m, n, k, sms)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=a.device) if split > 1 else out
    m_bucket = min(triton.next_power_of_2(m), 4096)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), split)

    args = (a.contiguous(), a_scale.contiguous(), w.contiguous(), w_scale.contiguous(), out, ws,
            m, n, k, m_bucket)
    if tile is None:
        _blockwise_kernel[grid](*args, SPLIT_K=split)
    else:
        bm, bn, bk, warps, stages = tile
        if bk % SCALE_BLOCK:
            raise ValueError(f"gemm_fp8_blockwise: BLOCK_K {bk} must be a multiple of 32")
        _blockwise_kernel.fn[grid](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                   SPLIT_K=split, num_warps=warps, num_stages=stages)
    if split > 1:
        block = 1024
        _reduce_kernel[(triton.cdiv(m * n, block),)](ws, out, m * n, SPLIT_K=split, BLOCK=block)
    return out
