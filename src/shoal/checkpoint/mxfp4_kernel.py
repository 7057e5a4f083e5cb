"""Synthetic MXFP4 weights in one Triton kernel: the same bits as `writer._mxfp4` (hash ->
near-normal -> z / sqrt(K) -> `quant_mxfp4`), without its fp32 copy and its dozens of passes.

`load_format="dummy"` generates every routed expert this way on a GPU (mini: 9,216 tensors of
about 12M values each); the torch path stays the definition and runs everywhere else.

Each program makes BLOCK_R rows x BLOCK_K values: the even and the odd element of every packed
byte are hashed separately (so no interleave is needed), each 32-block's amax gives its UE8M0
scale by the exponent-bit rule of `pow2_scale_ceil`, the values are divided by it exactly (a
multiply by the power of two 1/s) and encoded by the RNE midpoints of `e2m1_encode`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R, BLOCK_K = 16, 128


@triton.jit
def _near_normal(idx, key, gamma, mix1, mix2):
    """writer.near_normal of element indices `idx` (int64): splitmix64 of idx + 1 under `key`
    in wrapping uint64 arithmetic (logical shifts), three 21-bit fields summed and centred."""
    z = (idx + 1).to(tl.uint64, bitcast=True) * gamma + key
    z = (z ^ (z >> 30)) * mix1
    z = (z ^ (z >> 27)) * mix2
    z = z ^ (z >> 31)
    m21 = 0x1FFFFF
    total = ((z & m21) + ((z >> 21) & m21) + ((z >> 42) & m21)).to(tl.int32)
    return (2 * total - 3 * m21).to(tl.float32) * (1.0 / (1 << 21))


@triton.jit
def _e2m1(v):
    """writer/quant e2m1_encode of scaled values (|v| <= 6, never NaN or -0): uint8 codes."""
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    return code | ((v < 0).to(tl.int32) << 3)


@triton.jit
def _mxfp4_kernel(consts, packed, scales, n, k, std,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    key = tl.load(consts).to(tl.uint64, bitcast=True)
    gamma = tl.load(consts + 1).to(tl.uint64, bitcast=True)
    mix1 = tl.load(consts + 2).to(tl.uint64, bitcast=True)
    mix2 = tl.load(consts + 3).to(tl.uint64, bitcast=True)
    NB: tl.constexpr = BLOCK_K // 32
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pairs = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # byte in the row
    even = rows[:, None].to(tl.int64) * k + 2 * pairs[None, :]
    ve = _near_normal(even, key, gamma, mix1, mix2) * std
    vo = _near_normal(even + 1, key, gamma, mix1, mix2) * std
    amax = tl.maximum(tl.max(tl.reshape(tl.abs(ve), (BLOCK_R, NB, 16)), axis=2),
                      tl.max(tl.reshape(tl.abs(vo), (BLOCK_R, NB, 16)), axis=2))
    p = tl.maximum(amax, 6.0 * 2.0**-126) * (1.0 / 6.0)
    bits = ((p.to(tl.int32, bitcast=True) & 0x7FFFFFFF) + 0x7FFFFF) & -(1 << 23)
    e = bits >> 23  # the UE8M0 byte, 1..253 here (amax >= the floor, |values| <= 3 / sqrt(K))
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1 / s, exact
    inv = tl.reshape(tl.broadcast_to(inv[:, :, None], (BLOCK_R, NB, 16)), (BLOCK_R, BLOCK_K // 2))
    lo = _e2m1(tl.minimum(tl.maximum(ve * inv, -6.0), 6.0))
    hi = _e2m1(tl.minimum(tl.maximum(vo * inv, -6.0), 6.0))
    ok = (rows[:, None] < n) & (pairs[None, :] < k // 2)
    tl.store(packed + rows[:, None].to(tl.int64) * (k // 2) + pairs[None, :],
             (lo | (hi << 4)).to(tl.uint8), mask=ok)
    blocks = tl.program_id(1) * NB + tl.arange(0, NB)
    tl.store(scales + rows[:, None].to(tl.int64) * (k // 32) + blocks[None, :], e.to(tl.uint8),
             mask=(rows[:, None] < n) & (blocks[None, :] < k // 32))


def generate_mxfp4(n: int, k: int, key: int, std: float, constants: tuple[int, int, int],
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [n, k // 2], UE8M0 scales uint8 [n, k // 32]) of the values
    near_normal(key, 0, n * k) * fp32(std) quantised as `quant_mxfp4` (block 32); `constants`:
    splitmix64's (gamma, mix1, mix2) as signed int64. k: a multiple of 32."""
    if k % 32:
        raise ValueError(f"generate_mxfp4: k = {k} is not a multiple of 32")
    packed = torch.empty((n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((n, k // 32), dtype=torch.uint8, device=device)
    consts = torch.tensor([key, *constants], dtype=torch.int64).to(device)
    grid = (triton.cdiv(n, BLOCK_R), triton.cdiv(k, BLOCK_K))
    _mxfp4_kernel[grid](consts, packed, scales, n, k, std, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    return packed, scales
