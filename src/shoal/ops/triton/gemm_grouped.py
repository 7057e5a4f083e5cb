"""Triton (sm_90) grouped W8A16 output projection `gemm_grouped_w8a16` (wo_a: G groups of
[T, Kg] x [Kg, R], inverse RoPE already applied to o): the FP8 weight tiles are dequantised in
registers to bf16 (exact: e4m3 x power-of-two scale), bf16 tensor-core products exact in fp32,
fp32 sums. UE8M0 byte 0 reads as 2^-127 and 255 as NaN, as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.engram import ue8m0_value
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Decode sizes (M_BUCKET <= 16) get 16-row tiles
# with narrow N (8 groups x 1024 rows / 32 = 256 programs streaming the FP8 weight; faster than
# the wide tiles' 64 programs), larger M the wide tiles. The decode tiles load the codes as
# [BLOCK_N, BLOCK_K] rows (16-byte loads along K) with one scale per 32-block, the wide tiles as
# [BLOCK_K, BLOCK_N] with a scale per element (row loads made them slower): the same products,
# but the two families' bits differ (mma.sync against wgmma sums), so `batch_invariant` keeps
# the wide tiles at every size. (measurements: docs/perf/gemm_grouped.md)
_GROUPED_TILES = [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                  (64, 64, 128, 4, 3), (16, 32, 256, 4, 4), (16, 64, 128, 4, 4),
                  (16, 32, 128, 8, 4)]


def _grouped_prune(configs, named_args, **kwargs):
    small = named_args["M_BUCKET"] <= 16
    return [c for c in configs if (c.kwargs["BLOCK_M"] == 16) == small]


@triton.autotune(configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
                                        num_warps=w, num_stages=s)
                          for bm, bn, bk, w, s in _GROUPED_TILES],
                 key=["M_BUCKET", "R", "K"], prune_configs_by={"early_config_prune": _grouped_prune},
                 cache_results=True)  # timings kept on disk, as gemm.py's
@triton.jit
def _grouped_w8a16_kernel(o_ptr, w_ptr, s_ptr, z_ptr, M, R, K, M_BUCKET, stride_om, stride_og,
                          stride_ok, G: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pdl_wait()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    kb = tl.cdiv(K, 32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rm = (offs_m % M).to(tl.int64)
    rows = (g * R + offs_n % R).to(tl.int64)  # weight rows
    offs_b = tl.arange(0, BLOCK_K // 32)  # the K blocks of one step
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(o_ptr + rm[:, None] * stride_om + g * stride_og + kk[None, :] * stride_ok,
                    mask=kk[None, :] < K, other=0.0)
        if BLOCK_M == 16:  # decode tiles: [BLOCK_N, BLOCK_K] code rows, one scale per 32-block
            wq = tl.load(w_ptr + rows[:, None] * K + kk[None, :], mask=kk[None, :] < K,
                         other=0.0)
            kbs = k0 // 32 + offs_b
            e = tl.load(s_ptr + (rows // 32)[:, None] * kb + kbs[None, :],
                        mask=kbs[None, :] < kb, other=127).to(tl.int32)
            scale = tl.reshape(tl.broadcast_to(ue8m0_value(e)[:, :, None],
                                               (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))
            b = tl.trans((wq.to(tl.float32) * scale).to(tl.bfloat16))
        else:  # [BLOCK_K, BLOCK_N] tiles, a scale per element
            wq = tl.load(w_ptr + rows[None, :] * K + kk[:, None], mask=kk[:, None] < K,
                         other=0.0)
            e = tl.load(s_ptr + (rows // 32)[None, :] * kb + (kk // 32)[:, None],
                        mask=kk[:, None] < K, other=127).to(tl.int32)
            b = (wq.to(tl.float32) * ue8m0_value(e)).to(tl.bfloat16)
        acc = tl.dot(a.to(tl.bfloat16), b, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < R)
    z = z_ptr + offs_m[:, None].to(tl.int64) * (G * R) + g * R + offs_n[None, :]
    tl.store(z, acc.to(tl.bfloat16), mask=mask)


def _supports_grouped(*, o: torch.Tensor, weight: torch.Tensor, block: int = 32, **_) -> bool:
    return o.is_cuda and o.dim() == 3 and block == 32 and (weight.shape[0] // o.shape[1]) % 32 == 0


def grouped_w8a16(o: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
                  tile: tuple[int, int, int, int, int] | None = None,
                  wide: bool = False) -> torch.Tensor:
    """o [T, G, Kg] bf16 -> z [T, G * R] bf16. tile: (BLOCK_M, BLOCK_N, BLOCK_K, warps,
    stages) instead of the autotuned choice (tests under the Triton interpreter). wide: the
    wide (wgmma) tiles at decode sizes too, whose bits the 16-row (mma.sync) tiles do not
    share."""
    t, g, k = o.shape
    r = weight.shape[0] // g
    z = torch.empty(t, g * r, dtype=torch.bfloat16, device=o.device)
    if t == 0:
        return z
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    weight = weight.contiguous()
    scale = weight_scale.contiguous()
    m_bucket = min(triton.next_power_of_2(t), 4096)
    if wide:
        m_bucket = max(m_bucket, 32)  # the autotuning key that prunes to the wide tiles
    args = (o, weight, scale, z, t, r, k, m_bucket, o.stride(0), o.stride(1), o.stride(2))
    if tile is None:
        def grid(meta):
            return (triton.cdiv(t, meta["BLOCK_M"]), triton.cdiv(r, meta["BLOCK_N"]), g)

        _grouped_w8a16_kernel[grid](*args, G=g, **PDL_LAUNCH)
    else:
        bm, bn, bk, warps, stages = tile
        _grouped_w8a16_kernel.fn[(triton.cdiv(t, bm), triton.cdiv(r, bn), g)](
            *args, G=g, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
            **PDL_LAUNCH)
    return z


@REGISTRY.implement("triton", "gemm_grouped_w8a16", supports=_supports_grouped)
def gemm_grouped_w8a16(*, o: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       block: int = 32) -> torch.Tensor:
    """Same contract as the reference: o [T, G, Kg] bf16 -> z [T, G * R] bf16 (exact dequant)."""
    return grouped_w8a16(o, weight, weight_scale)


@REGISTRY.implement("triton_invariant", "gemm_grouped_w8a16", supports=_supports_grouped)
def gemm_grouped_w8a16_invariant(*, o: torch.Tensor, weight: torch.Tensor,
                                 weight_scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The op on the wide tiles at every size: a row's bits do not depend on the batch."""
    return grouped_w8a16(o, weight, weight_scale, wide=True)
