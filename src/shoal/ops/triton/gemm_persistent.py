"""Triton (sm_90) persistent FP8 GEMM for large M (the `gemm_fp8` op's kernel from
`persistent_ok` on; gemm.py chooses): one program per SM walks the output tiles, operands
through TMA descriptors, so one tile's epilogue overlaps the next tile's loads. Same folded
operands as gemm.py's pointer kernel; promoted accumulation adds 256-K partials (the pointer
kernel: 128-K), each formed by the FP8 wgmma from zero and added in fp32: half the promotion
adds, which Triton cannot overlap with the next wgmma (the product is waited for at once). With a
128-K tile it gives the pointer kernel's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from shoal.ops.triton.device import sm_count
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the persistent kernel: BLOCK_K 256 with 3
# stages (promotion every 256 K), the fastest promoted tile measured; other tiles, stages and two
# CTAs per SM were no faster. (measurements and the variants tried: docs/perf/gemm_fp8.md)
PERSISTENT_TILE = (128, 128, 256, 8, 3)
# The persistent kernel from this many 256-K tile steps per SM on (tiles x K steps / SMs): from
# there it beats the autotuned pointer kernel at mini's dense shapes, below it is mostly equal or
# slower (measurements: docs/perf/gemm_fp8.md).
PERSISTENT_MIN_STEPS_PER_SM = 21
# Never for decode sizes (the M <= 64 of gemm.split_k, whose split pointer kernel they keep, so
# a token's bits are the same at every decode batch size); the pointer kernel is also faster
# there, e.g. the Engram wkv at M = 1 (measurements: docs/perf/gemm_fp8.md).
PERSISTENT_MIN_M = 65


def tma_aligned(n: int, k: int) -> bool:
    """TMA needs 16-byte row strides: K fp8 codes, N bf16 outputs."""
    return n % 8 == 0 and k % 16 == 0


def persistent_ok(m: int, n: int, k: int, sms: int) -> bool:
    """Where the op runs the persistent kernel: enough tile work per SM (each program then
    walks several tiles, so their epilogues overlap loads), TMA-aligned, above decode sizes."""
    bm, bn, bk = PERSISTENT_TILE[:3]
    steps = triton.cdiv(m, bm) * triton.cdiv(n, bn) * triton.cdiv(k, bk)
    return (m >= PERSISTENT_MIN_M and steps >= PERSISTENT_MIN_STEPS_PER_SM * sms
            and tma_aligned(n, k))


@triton.jit
def _gemm_fp8_persistent(a_desc, b_desc, c_desc, rs_ptr, cs_ptr, M, N, K,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, PROMOTE: tl.constexpr):
    """Large M: the same tiles as `_gemm_fp8_body` (SPLIT_K = 1) from one program per SM that
    walks the output tiles in steps of PROGRAMS, operands through TMA descriptors (zero-filled
    beyond M, N, K; the store is clipped), so one tile's epilogue overlaps the next tile's loads.
    Promoted: each BLOCK_K partial added in K order (BLOCK_K 128: `_gemm_fp8_body`'s bits)."""
    pdl_wait()
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
        num_warps=warps, num_stages=stages, **PDL_LAUNCH)
