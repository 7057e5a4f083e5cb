"""Triton (sm_90) persistent FP8 GEMM for large M (the `gemm_fp8` op's kernel from
`persistent_ok` on; gemm.py chooses): one program per SM walks the output tiles, operands
through TMA descriptors, so one tile's epilogue overlaps the next tile's loads. Same folded
operands and the same promoted 128-K partials as gemm.py's pointer kernel: the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from shoal.ops.triton.device import sm_count

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the persistent kernel. H200 (2026-12-01,
# benchmarks/results/session10_h200_2026-12-01.txt): 0.64-0.65 of the FP8 peak on wq_b and
# 0.66-0.68 on wo_b at M = 4096 (the autotuned pointer kernel: 0.50 / 0.61-0.65); 128x256 or
# 64x256 tiles, 3 stages, an epilogue stored in two halves, two 128-K products per iteration
# and Triton's warp specialisation were no faster. On mini's dense shapes with N >= 4096 (wq_b,
# wo_b, shared w2, indexer wq_b) it is 10-13% faster summed over the four at M = 512, 1024 and
# 2048 (per shape 0.82-1.72x); with N <= 2304 (wq_a|wkv, shared w13: <= 2.2 waves of 128x128
# tiles at M = 2048, where the autotuned tiles fit better) 0.71-1.04x; at M = 128 slower.
PERSISTENT_TILE = (128, 128, 128, 8, 4)
PERSISTENT_MIN_ROWS = 512
PERSISTENT_MIN_N = 4096


def tma_aligned(n: int, k: int) -> bool:
    """TMA needs 16-byte row strides: K fp8 codes, N bf16 outputs."""
    return n % 8 == 0 and k % 16 == 0


def persistent_ok(m: int, n: int, k: int) -> bool:
    """Where the op runs the persistent kernel: large M and N, TMA-aligned."""
    return m >= PERSISTENT_MIN_ROWS and n >= PERSISTENT_MIN_N and tma_aligned(n, k)


@triton.jit
def _gemm_fp8_persistent(a_desc, b_desc, c_desc, rs_ptr, cs_ptr, M, N, K,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, PROMOTE: tl.constexpr):
    """Large M: the same tiles as `_gemm_fp8_body` (SPLIT_K = 1) from one program per SM that
    walks the output tiles in steps of PROGRAMS, operands through TMA descriptors (zero-filled
    beyond M, N, K; the store is clipped), so one tile's epilogue overlaps the next tile's loads.
    The same BLOCK_K partials added in the same order: bit-identical to `_gemm_fp8_body`."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    steps = tl.cdiv(K, BLOCK_K)
    width = GROUP_M * grid_n
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        first_m = (tile // width) * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        om = (first_m + (tile % width) % size_m) * BLOCK_M
        on = ((tile % width) // size_m) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(steps):
            a = a_desc.load([om, ki * BLOCK_K])
            b = b_desc.load([on, ki * BLOCK_K])
            if PROMOTE == 1:
                acc += tl.dot(a, b.T)
            else:
                acc = tl.dot(a, b.T, acc)
        offs_m = om + tl.arange(0, BLOCK_M)
        offs_n = on + tl.arange(0, BLOCK_N)
        rs = tl.load(rs_ptr + offs_m, mask=offs_m < M, other=0.0)
        cs = tl.load(cs_ptr + offs_n, mask=offs_n < N, other=0.0)
        c_desc.store([om, on], (acc * rs[:, None] * cs[None, :]).to(tl.bfloat16))


def gemm_persistent(q: torch.Tensor, row_scale: torch.Tensor, codes: torch.Tensor,
                    col_scale: torch.Tensor, out: torch.Tensor, promote: int,
                    tile: tuple[int, int, int, int, int] = PERSISTENT_TILE) -> None:
    """out [M, N] bf16 = (q[:M] e4m3 * row_scale) @ (codes [N, K] e4m3 * col_scale)^T, written
    in place; promote: gemm.py's CHAINED or PROMOTED."""
    m, n = out.shape
    bm, bn, bk, warps, stages = tile
    programs = min(sm_count(q.device), triton.cdiv(m, bm) * triton.cdiv(n, bn))
    _gemm_fp8_persistent[(programs,)](
        TensorDescriptor.from_tensor(q[:m], [bm, bk]),
        TensorDescriptor.from_tensor(codes, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), row_scale, col_scale, m, n, q.shape[1],
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PROGRAMS=programs, PROMOTE=promote,
        num_warps=warps, num_stages=stages)
