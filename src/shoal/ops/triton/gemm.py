"""Triton (sm_90) GEMMs: the FP8 GEMM `gemm_fp8`, FP8 activation quantisation (`act_quant_fp8`)
and the registration of the batch-invariant bf16-weight GEMM `gemm_bf16` (its kernel `gemm_nt`
lives in gemm_nt.py; the heads in head.py use it too). The grouped W8A16 `wo_a` projection is in
gemm_grouped.py.

`gemm_fp8`: the UE8M0 block scales are *folded* (every 32-block re-encoded relative to its row's
largest exponent, `e4m3(q * 2^(e - E))`; one fp32 scale per activation row and per weight column
remains for the epilogue), so the main loop is a pure FP8 wgmma. Its accumulation is *promoted*
as in DeepSeek's DeepGEMM: each BLOCK_K (<= 128) step's product is formed from zero and added to
the fp32 accumulator, because sm_90's FP8 wgmma adds in reduced precision (about 14 bits kept)
along a chained accumulator: chained, outputs of mini's `engram.wkv` GEMM left the op's tolerance
in situ on the H200 (benchmarks/fold_loss.py's CPU model of that accumulator agrees; the fold
alone and fp32 adds keep every output inside it). Exact scales per 32-K step (one wgmma per
step) were dropped: several times slower, and not exact on the hardware either (one K = 32 wgmma
already rounds its sum). (measurements: docs/perf/gemm_fp8.md)
Folding is exact while a shifted code stays an e4m3 normal or a multiple of 2^-9; it rounds or
flushes only codes of blocks >= 2^6 below their row's largest, far below the output's bf16
resolution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.tensor_memo import TensorMemo
from shoal.ops.triton.act_quant import act_quant
from shoal.ops.triton.device import sm_count
from shoal.ops.triton.gemm_nt import gemm_nt, supports_nt
from shoal.ops.triton.gemm_persistent import (
    PERSISTENT_TILE,
    gemm_persistent,
    persistent_ok,
    tma_aligned,
)
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait

FP8_MAX = 448.0


@dataclass(frozen=True)
class PreparedFP8Weight:
    """Load-time re-encoding of a 32x32-block FP8 weight.

    codes [N, K] float8_e4m3fn (each block shifted to its 32-row block's largest exponent);
    col_scale [N] fp32 = 2^(E[n // 32] - 127).
    """

    codes: torch.Tensor
    col_scale: torch.Tensor


def prepare_fp8_weight(weight: torch.Tensor, weight_scale: torch.Tensor,
                       block: int = 32) -> PreparedFP8Weight:
    """Fold the UE8M0 block scales of weight [N, K] e4m3 (scales [ceil(N/32), K/32] uint8)."""
    n, k = weight.shape
    if weight_scale.shape != (-(-n // block), -(-k // block)):
        raise ValueError(f"prepare_fp8_weight: weight_scale.shape {tuple(weight_scale.shape)} "
                         f"must be {(-(-n // block), -(-k // block))} for weight {n}x{k}")
    e = weight_scale.to(torch.int32)  # [NB, KB]
    top = e.amax(dim=1, keepdim=True)  # [NB, 1]
    shift = (e - top).clamp_min(-126)
    factor = torch.exp2(shift.float()).repeat_interleave(block, 0).repeat_interleave(block, 1)
    codes = (weight.float() * factor[:n, :k]).to(torch.float8_e4m3fn).contiguous()
    col = torch.exp2((top.squeeze(1) - 127).float()).repeat_interleave(block)[:n]
    col = torch.where(top.squeeze(1).repeat_interleave(block)[:n] == 255, torch.nan, col)
    return PreparedFP8Weight(codes, col.contiguous())


# --------------------------------------------------------------------------- FP8 GEMM

CHAINED, PROMOTED = 0, 1  # `_gemm_fp8_kernel` PROMOTE modes (see there)
DECODE_MIN_ROWS = 16  # the op pads fewer activation rows to this many (see gemm_fp8_folded)
DEFAULT_PROMOTE = PROMOTED


class PreparedCache:
    """Folded weights prepared on first use (`TensorMemo`: an entry lives while its weight and
    scale are the same unchanged tensors). Each resolved op table owns one (the registry's
    per-table `state`), so nothing is shared between engines; the folded copies take about the
    size of the FP8 dense weights."""

    def __init__(self) -> None:
        self._memo = TensorMemo()

    def get(self, weight: torch.Tensor, scale: torch.Tensor, block: int) -> PreparedFP8Weight:
        return self._memo.get((weight, scale), block,
                              lambda: prepare_fp8_weight(weight, scale, block))


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Promoted modes hold a second [BM, BN] fp32 tile
# (the step's product) next to the accumulator, so their tiles keep <= 64 accumulator registers
# per thread (BM * BN <= 2048 * warps) and BLOCK_K <= 128 (DeepGEMM's promotion interval).
# Promotion is slower than chaining; Triton's own (`tl.dot(max_num_imprecise_acc=BLOCK_K)`)
# gives the same bits and speed (measurements: docs/perf/gemm_fp8.md). 16-warp 256x128 tiles
# (64 + 64 registers) spill 104 bytes (sm_90 build).
# Promoted tiles all use BLOCK_K = 128, so the autotuner's (timing-dependent) choice never
# changes the result: a 64-K promotion interval rounds differently, which made prefill logits
# depend on which tile won in a given process. (64, 64, 128, 4, 3) takes 48 KB of shared memory
# against 64 KB with 4 stages, so 4 programs fit an SM instead of 3: one wave for the 512
# programs of wq_b at decode M (more than one with 4 stages). Added for the autotuner to weigh;
# not yet timed.
_TILES = [(128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 8, 4),
          (128, 128, 128, 8, 3), (128, 256, 64, 8, 4), (64, 128, 128, 4, 4),
          (64, 128, 256, 4, 3), (64, 64, 256, 4, 4), (64, 64, 128, 4, 4), (64, 64, 128, 4, 3)]


def _gemm_configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                          num_warps=warps, num_stages=stages)
            for bm, bn, bk, warps, stages in _TILES]


def _tile_ok(bm: int, bn: int, bk: int, warps: int, m_bucket: int, k: int, split: int,
             promote: int) -> bool:
    if (m_bucket <= 64) != (bm == 64):
        return False
    if bk > max(32, k // max(split, 1)) and bk > 32:
        return False
    if promote != CHAINED and (bm * bn > 2048 * warps or bk != 128):
        return False  # every promoted tile adds the same 128-K partials: autotuning keeps bits
    return True


def _prune(configs, named_args, **kwargs):
    m_bucket, k = named_args["M_BUCKET"], named_args["K"]
    split = kwargs.get("SPLIT_K", named_args.get("SPLIT_K", 1))
    promote = kwargs.get("PROMOTE", named_args.get("PROMOTE", CHAINED))
    keep = [c for c in configs
            if _tile_ok(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"],
                        c.num_warps, m_bucket, k, split, promote)]
    if not keep:
        keep = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8},
                              num_warps=4, num_stages=2)]
    return keep


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


def _gemm_fp8_body(a_ptr, b_ptr, c_ptr, ws_ptr, rs_ptr, cs_ptr, M, MA, N, K, M_BUCKET,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                   PROMOTE: tl.constexpr, SEGMENTS: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of c = (a * rs) @ (b * cs)^T over this program's K range
    (SPLIT_K > 1: fp32 partial sums to ws[pid_k]). PROMOTE: CHAINED chains the accumulator
    through the MMA (reduced-precision adds on sm_90 FP8 wgmma); PROMOTED forms each BLOCK_K
    step's product from zero and adds it in fp32. SEGMENTS > 1 (SPLIT_K 1): the sums of a
    SEGMENTS-way split formed from zero and added in order, the bits of that split-K and its
    reduce in one program. M_BUCKET: the autotuning key only. MA: rows of a (>= M; rows beyond M
    are padding, read but never stored)."""
    pdl_wait()
    pid_k = tl.program_id(1)
    offs_m, offs_n = tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = (offs_m % MA).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k0 = pid_k * k_per
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + rn[None, :] * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.minimum(k0 + k_per, K)
    if SEGMENTS > 1:
        seg = tl.cdiv(tl.cdiv(K, BLOCK_K), SEGMENTS) * BLOCK_K
        for s0 in range(0, K, seg):
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(s0, tl.minimum(s0 + seg, K), BLOCK_K):
                ks = kk + tl.arange(0, BLOCK_K)
                if EVEN_K:
                    a = tl.load(a_ptr + rm[:, None] * K + ks[None, :])
                    b = tl.load(b_ptr + rn[None, :] * K + ks[:, None])
                else:
                    a = tl.load(a_ptr + rm[:, None] * K + ks[None, :], mask=ks[None, :] < K,
                                other=0.0)
                    b = tl.load(b_ptr + rn[None, :] * K + ks[:, None], mask=ks[:, None] < K,
                                other=0.0)
                if PROMOTE == 1:
                    part += tl.dot(a, b)
                else:
                    part = tl.dot(a, b, part)
            acc += part
    else:
        for kk in range(k0, k_end, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_end - (kk - k0), other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_end - (kk - k0), other=0.0)
            if PROMOTE == 1:
                acc += tl.dot(a, b)
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        rs = tl.load(rs_ptr + offs_m, mask=offs_m < M, other=0.0)
        cs = tl.load(cs_ptr + offs_n, mask=offs_n < N, other=0.0)
        out = acc * rs[:, None] * cs[None, :]
        tl.store(c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], out.to(tl.bfloat16),
                 mask=mask)
    else:
        ws = ws_ptr + pid_k.to(tl.int64) * M * N
        tl.store(ws + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=mask)


def _even_k(a) -> bool:
    return a["K"] % (a["BLOCK_K"] * a["SPLIT_K"]) == 0


_gemm_fp8_fixed = triton.heuristics({"EVEN_K": _even_k})(triton.jit(_gemm_fp8_body))
# cache_results: the timings stay in Triton's disk cache, so a second start on the machine
# neither re-times the tiles nor can pick another one
_gemm_fp8_kernel = triton.autotune(
    configs=_gemm_configs(), key=["M_BUCKET", "N", "K", "SPLIT_K", "PROMOTE", "SEGMENTS"],
    prune_configs_by={"early_config_prune": _prune}, cache_results=True)(
    triton.heuristics({"EVEN_K": _even_k})(triton.jit(_gemm_fp8_body)))


@triton.jit
def _splitk_reduce_kernel(ws_ptr, c_ptr, rs_ptr, cs_ptr, M, N, SPLIT_K: tl.constexpr,
                          BLOCK: tl.constexpr):
    pdl_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the result does not depend on timing
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    rs = tl.load(rs_ptr + offs // N, mask=mask, other=0.0)
    cs = tl.load(cs_ptr + offs % N, mask=mask, other=0.0)
    tl.store(c_ptr + offs, (acc * rs * cs).to(tl.bfloat16), mask=mask)


def split_k(m: int, n: int, k: int, sms: int) -> int:
    """K splits for small M (decode): enough programs to fill the SMs, >= 512 K per split;
    `_splitk_reduce_kernel` adds the partials: faster than each tile's last split adding them,
    and no other split or tile beat this rule (measurements: docs/perf/gemm_fp8.md)."""
    if m > 64:
        return 1
    tiles = triton.cdiv(n, 128)
    split = 1
    while tiles * split * 2 <= 2 * sms and k // (split * 2) >= 512:
        split *= 2
    return split


def gemm_fp8_folded(q: torch.Tensor, row_scale: torch.Tensor, w: PreparedFP8Weight,
                    promote: int = DEFAULT_PROMOTE, *, split: int | None = None,
                    tile: tuple[int, int, int, int, int] | None = None,
                    rows: int | None = None, persistent: bool | None = None,
                    segments: int = 1) -> torch.Tensor:
    """y [M, N] bf16 = (q [M, K] e4m3 * row_scale [M]) @ (w.codes [N, K] * w.col_scale [N])^T.
    promote: CHAINED or PROMOTED (see `_gemm_fp8_body`). split: K splits (default
    `split_k`; partials reduced in a fixed order). segments: one program adds the partial sums
    of that many K splits in their order (the bits of split=segments; split and persistent
    must be 1 / False). tile: (BLOCK_M, BLOCK_N, BLOCK_K, warps,
    stages) instead of the autotuned choice (tests under the Triton interpreter). rows: M when
    q holds padding rows beyond it (the op pads M < 16 to 16: a 64-row tile that reads one
    row 64 times is slower than one reading 16 distinct rows; docs/perf/gemm_fp8.md).
    persistent: the TMA kernel of gemm_persistent.py (default: `persistent_ok` there, one
    split; 256-K promoted partials, so its bits differ from the pointer kernel's, which a
    128-K `tile` reproduces)."""
    ma, k = q.shape
    m = ma if rows is None else rows
    if not 0 <= m <= ma:
        raise ValueError(f"gemm_fp8_folded: rows={rows} must be in [0, {ma}]")
    n = w.codes.shape[0]
    if promote not in (CHAINED, PROMOTED):
        raise ValueError(f"gemm_fp8_folded: promote must be 0 or 1, got {promote!r}")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if segments > 1 and (split not in (None, 1) or persistent):
        raise ValueError(f"gemm_fp8_folded: segments={segments} takes split 1 and the pointer "
                         f"kernel, got split={split}, persistent={persistent}")
    if persistent is None:
        persistent = (split in (None, 1) and segments == 1
                      and persistent_ok(m, n, k, sm_count(q.device)))
    if persistent:
        if split not in (None, 1) or not tma_aligned(n, k):
            raise ValueError(f"gemm_fp8_folded: the persistent kernel takes one split and "
                             f"N % 8 == K % 16 == 0, got split={split}, N={n}, K={k}")
        gemm_persistent(q, row_scale, w.codes, w.col_scale, out, promote,
                        tile or PERSISTENT_TILE)
        return out
    if split is None:
        split = 1 if segments > 1 else split_k(m, n, k, sm_count(q.device))
    ws = (torch.empty(split, m, n, dtype=torch.float32, device=q.device) if split > 1 else out)
    # one autotuning bucket for every decode size: M <= 64 all run 64-row tiles and, padded
    # to >= 16 rows by the op, read the same way (one tuning instead of seven)
    m_bucket = 64 if m <= 64 else min(triton.next_power_of_2(m), 4096)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), split)

    args = (q, w.codes, out, ws, row_scale, w.col_scale, m, ma, n, k, m_bucket)
    if tile is None:
        _gemm_fp8_kernel[grid](*args, SPLIT_K=split, PROMOTE=promote, SEGMENTS=segments,
                               **PDL_LAUNCH)
    else:
        bm, bn, bk, warps, stages = tile
        _gemm_fp8_fixed[grid](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                              SPLIT_K=split, PROMOTE=promote, SEGMENTS=segments,
                              num_warps=warps,
                              num_stages=stages, **PDL_LAUNCH)
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](ws, out, row_scale, w.col_scale, m, n,
                                                            SPLIT_K=split, BLOCK=block, **PDL_LAUNCH)
    return out


def _supports_gemm(*, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   block: int = 32, **_) -> bool:
    return (x.is_cuda and x.dim() == 2 and block == 32 and x.shape[1] % 32 == 0
            and weight.dtype in (torch.float8_e4m3fn, torch.uint8) and weight.dim() == 2)


@REGISTRY.implement("triton", "gemm_fp8", supports=_supports_gemm, state=PreparedCache)
def gemm_fp8(*, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             block: int = 32, state: PreparedCache | None = None) -> torch.Tensor:
    """Same contract as the reference op: the activation quantised per 32 (the reference's codes)
    and folded, the weight folded on first use (cached in the op table's `state`; folded on
    every call without one), promoted FP8 wgmma (split-K for decode sizes). No fused-quantisation
    CUDA-core GEMV for M <= 8: it was slower than this path (docs/perf/gemm_fp8.md)."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    prepared = (prepare_fp8_weight(weight, weight_scale, block) if state is None
                else state.get(weight, weight_scale, block))
    q, rs = act_quant(x, block, fold=True, min_rows=DECODE_MIN_ROWS)
    return gemm_fp8_folded(q, rs, prepared, rows=x.shape[0])


@REGISTRY.implement("triton_invariant", "gemm_fp8", supports=_supports_gemm, state=PreparedCache)
def gemm_fp8_invariant(*, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       block: int = 32, state: PreparedCache | None = None) -> torch.Tensor:
    """The op with one K partition at every M, so a row's bits do not depend on the rows beside
    it: the decode sizes' split (`split_k` at one row), as a split-K up to 64 rows and as the
    same partial sums added in one program above (never the persistent kernel's 256-K steps).
    Decode runs exactly the default path."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    prepared = (prepare_fp8_weight(weight, weight_scale, block) if state is None
                else state.get(weight, weight_scale, block))
    q, rs = act_quant(x, block, fold=True, min_rows=DECODE_MIN_ROWS)
    n, k = prepared.codes.shape
    split = split_k(1, n, k, sm_count(x.device))
    if x.shape[0] <= 64:
        return gemm_fp8_folded(q, rs, prepared, rows=x.shape[0], split=split, persistent=False)
    return gemm_fp8_folded(q, rs, prepared, rows=x.shape[0], persistent=False, segments=split)


def _supports_bf16(*, x: torch.Tensor, weight: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16) -> bool:
    return supports_nt(x, weight, out_dtype)


@REGISTRY.implement("triton", "gemm_bf16", supports=_supports_bf16)
def gemm_bf16(*, x: torch.Tensor, weight: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Same contract as the reference: x [T, K] bf16 or fp32 @ weight [N, K]^T (bf16), fp32
    accumulation of exact products (fp32 x via the exact 3xBF16 split) -> [T, N] out_dtype."""
    return gemm_nt(x, weight, out_dtype)
