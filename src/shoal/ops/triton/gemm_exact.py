"""`gemm_fp8` with the official kernel's rounding (backend `triton_exact`, opt-in through
`backends=("triton_exact", "triton")`): each 32-K block's product formed from zero by one
bf16 MMA (the e4m3 codes widened to bf16 in registers, exact: an FP8 wgmma already rounds
inside one K = 32 block on the H200), scaled by its activation and weight UE8M0 scales in
fp32, and added to the fp32 accumulator in K order, one program per output tile (no split-K,
no folded scales). That is the reference's definition; the only deviation left is the order
of the 32 products inside one block on the tensor core (a few fp32 ulp at most, rarely one
bf16 ulp of the output; in situ on the official fixture: benchmarks/results/session29_*).

The default `triton` gemm_fp8 (gemm.py) folds the scales and promotes every 128 K, within the
op's tolerance but not the reference's bits (2-5% of outputs one bf16 ulp off in situ): a
flipped ulp re-quantises differently downstream and moves discrete choices (index top-k,
routing), which the official per-layer comparison (tests/model/test_official_layers.py) sees.
A row's bits never depend on the other rows (batch-invariant). Speed against the default:
benchmarks/bench_gemm_exact.py (not yet run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.act_quant import act_quant
from shoal.ops.triton.engram import ue8m0_value
from shoal.ops.triton.gemm import _supports_gemm, tile_offsets
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait

BLOCK = 32  # the UE8M0 scale block along K (and along N for the weight)


def _gemm_fp8_exact_body(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, M_BUCKET,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """c [M, N] bf16 = sum over K blocks kb, in order, of (a_kb @ b_kb^T) * sa[m, kb] * sb[n, kb].
    a [M, K] e4m3 with as [M, K/32] UE8M0; b [N, K] e4m3 with bs [ceil(N/32), K/32] UE8M0.
    M_BUCKET: the autotuning key only."""
    pdl_wait()
    offs_m, offs_n = tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    kb_count = K // 32
    offs_k = tl.arange(0, 32)
    a_ptrs = a_ptr + rm[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + rn[None, :] * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, kb_count):
        a = tl.load(a_ptrs).to(tl.bfloat16)  # e4m3 values are bf16 values: exact
        b = tl.load(b_ptrs).to(tl.bfloat16)
        sa = ue8m0_value(tl.load(as_ptr + rm * kb_count + kb).to(tl.int32))
        sb = ue8m0_value(tl.load(bs_ptr + (rn // 32) * kb_count + kb).to(tl.int32))
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += 32
        b_ptrs += 32
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(tl.bfloat16),
             mask=mask)


# (BLOCK_M, BLOCK_N, warps, stages); BLOCK_K is the scale block, so every tile adds the same
# partials in the same order: the autotuner's choice never changes the bits
_TILES = [(64, 64, 4, 4), (64, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3)]
_gemm_fp8_exact_fixed = triton.jit(_gemm_fp8_exact_body)
_gemm_fp8_exact_kernel = triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=w,
                           num_stages=st) for bm, bn, w, st in _TILES],
    key=["M_BUCKET", "N", "K"], cache_results=True)(triton.jit(_gemm_fp8_exact_body))


def gemm_fp8_blockwise(codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                       weight_scale: torch.Tensor,
                       tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """y [M, N] bf16 from codes [M, K] e4m3 with scales [M, K/32] uint8 and weight [N, K] e4m3
    with weight_scale [ceil(N/32), K/32] uint8 (the reference op's operands, unfolded). tile:
    (BLOCK_M, BLOCK_N, warps, stages) instead of the autotuned one (the Triton interpreter)."""
    m, k = codes.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=codes.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    m_bucket = 64 if m <= 64 else min(triton.next_power_of_2(m), 4096)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    args = (codes, scales.contiguous(), weight, weight_scale.contiguous(), out, m, n, k, m_bucket)
    if tile is None:
        _gemm_fp8_exact_kernel[grid](*args, **PDL_LAUNCH)
    else:
        bm, bn, warps, stages = tile
        _gemm_fp8_exact_fixed[grid](*args, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=warps,
                                    num_stages=stages, **PDL_LAUNCH)
    return out


@REGISTRY.implement("triton_exact", "gemm_fp8", supports=_supports_gemm)
def gemm_fp8_exact(*, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   block: int = BLOCK, state=None) -> torch.Tensor:
    """Same contract as the reference op, and its rounding points (module docstring)."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    codes, scales = act_quant(x, block, fold=False)
    return gemm_fp8_blockwise(codes, scales, weight.contiguous(), weight_scale)
