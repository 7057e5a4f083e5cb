"""Triton (sm_90) grouped W8A16 output projection `gemm_grouped_w8a16` (wo_a: G groups of
[T, Kg] x [Kg, R]): the FP8 weight tiles are dequantised in registers to bf16 (exact: e4m3 x
power-of-two scale), bf16 tensor-core products exact in fp32, fp32 sums. UE8M0 byte 0 reads as
2^-127 and 255 as NaN, as the reference. With `rope`, the inverse rotary embedding of each
head's last rope_dim dims is applied to the o tile in registers (the K steps that hold rope
columns only; cos/sin and the rotation as rope.py's kernel, rounded to bf16 as its output),
which saves the separate `rope_tail` launch and its round trip of o.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from shoal.ops.reference.rope import RopeParams
from shoal.ops.registry import REGISTRY
from shoal.ops.triton.rope import rope_freqs, use_libdevice

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Decode sizes (M_BUCKET <= 16) get 16-row tiles
# with narrow N (8 groups x 1024 rows / 32 = 256 programs streaming the FP8 weight): on the H200
# (2026-11-29) T = 1 went from 39.8 us (the wide tiles, 64 programs; 0.20 of the HBM floor) to
# 23.2 us (0.34); T = 64 (31.2 us) and T = 4096 (649 us, 0.56) use the wide tiles as before.
_GROUPED_TILES = [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                  (64, 64, 128, 4, 3), (16, 32, 256, 4, 4), (16, 64, 128, 4, 4),
                  (16, 32, 128, 8, 4)]


def _grouped_prune(configs, named_args, **kwargs):
    small = named_args["M_BUCKET"] <= 16
    return [c for c in configs if (c.kwargs["BLOCK_M"] == 16) == small]


@triton.jit
def _inverse_rope_tile(a, k0, pos, f_ptr, HEAD: tl.constexpr, RD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, LIBDEVICE: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] bf16, columns k0.. of o: pairs (2i, 2i+1) in a head's last RD dims
    rotated by -pos * f_i in fp32 and rounded to bf16; other columns unchanged."""
    x0, x1 = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
    d = (k0 + 2 * tl.arange(0, BLOCK_K // 2)) % HEAD - (HEAD - RD)  # rope dim of the pair
    is_rope = d >= 0
    f = tl.load(f_ptr + tl.maximum(d, 0) // 2, mask=is_rope, other=0.0)
    ang = pos.to(tl.float32)[:, None] * f[None, :]
    if LIBDEVICE:
        cos = libdevice.cos(ang)
        sin = -libdevice.sin(ang)
    else:
        cos = tl.cos(ang)
        sin = -tl.sin(ang)
    re = x0.to(tl.float32)
    im = x1.to(tl.float32)
    r0 = tl.where(is_rope[None, :], (re * cos - im * sin).to(tl.bfloat16), x0)
    r1 = tl.where(is_rope[None, :], (re * sin + im * cos).to(tl.bfloat16), x1)
    return tl.reshape(tl.join(r0, r1), (BLOCK_M, BLOCK_K))


@triton.autotune(configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
                                        num_warps=w, num_stages=s)
                          for bm, bn, bk, w, s in _GROUPED_TILES],
                 key=["M_BUCKET", "R", "K"], prune_configs_by={"early_config_prune": _grouped_prune})
@triton.jit
def _grouped_w8a16_kernel(o_ptr, w_ptr, s_ptr, z_ptr, pos_ptr, f_ptr, M, R, K, M_BUCKET,
                          stride_om, stride_og, stride_ok, G: tl.constexpr, HEAD: tl.constexpr,
                          RD: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """RD > 0: inverse RoPE on the last RD of every HEAD columns of o (BLOCK_K divides HEAD or
    is a multiple of it)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    kb = tl.cdiv(K, 32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rm = (offs_m % M).to(tl.int64)
    rows = (g * R + offs_n % R).to(tl.int64)  # weight rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if RD > 0:
        pos = tl.load(pos_ptr + rm)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(o_ptr + rm[:, None] * stride_om + g * stride_og + kk[None, :] * stride_ok,
                    mask=kk[None, :] < K, other=0.0).to(tl.bfloat16)
        if RD > 0:
            if (k0 % HEAD) + BLOCK_K > HEAD - RD:  # the step holds rope columns
                a = _inverse_rope_tile(a, k0, pos, f_ptr, HEAD, RD, BLOCK_M, BLOCK_K,
                                       LIBDEVICE)
        wq = tl.load(w_ptr + rows[None, :] * K + kk[:, None], mask=kk[:, None] < K, other=0.0)
        e = tl.load(s_ptr + (rows // 32)[None, :] * kb + (kk // 32)[:, None],
                    mask=kk[:, None] < K, other=127).to(tl.int32)
        scale = tl.where(e == 255, float("nan"),
                         tl.where(e == 0, 2.0**-127, (e << 23).to(tl.float32, bitcast=True)))
        b = (wq.to(tl.float32) * scale).to(tl.bfloat16)
        acc = tl.dot(a, b, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < R)
    z = z_ptr + offs_m[:, None].to(tl.int64) * (G * R) + g * R + offs_n[None, :]
    tl.store(z, acc.to(tl.bfloat16), mask=mask)


def _rope_ok(head_dim: int, rope: RopeParams | None) -> bool:
    """Every tile's BLOCK_K (64 .. 256) must divide head_dim or be a multiple of it, and the
    rope columns must be whole pairs of one head."""
    if rope is None:
        return True
    rd = rope.rope_dim
    pow2 = head_dim > 0 and head_dim & (head_dim - 1) == 0
    return pow2 and 2 <= rd <= head_dim and rd & (rd - 1) == 0


def _supports_grouped(*, o: torch.Tensor, weight: torch.Tensor, block: int = 32,
                      rope: RopeParams | None = None, head_dim: int = 0, **_) -> bool:
    return (o.is_cuda and o.dim() == 3 and block == 32
            and (weight.shape[0] // o.shape[1]) % 32 == 0 and _rope_ok(head_dim, rope))


def grouped_w8a16(o: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
                  positions: torch.Tensor | None = None, rope: RopeParams | None = None,
                  head_dim: int = 0,
                  tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """o [T, G, Kg] bf16 -> z [T, G * R] bf16; with rope, the inverse RoPE of each head_dim
    head of o first (the reference contract). tile: (BLOCK_M, BLOCK_N, BLOCK_K, warps,
    stages) instead of the autotuned choice (tests under the Triton interpreter)."""
    t, g, k = o.shape
    r = weight.shape[0] // g
    z = torch.empty(t, g * r, dtype=torch.bfloat16, device=o.device)
    if rope is not None and (positions is None or positions.shape != (t,) or head_dim <= 0
                             or k % head_dim or not _rope_ok(head_dim, rope)):
        raise ValueError(f"gemm_grouped_w8a16: rope needs positions [T] and a power-of-two "
                         f"head_dim dividing Kg = {k} with rope_dim <= head_dim, got "
                         f"head_dim={head_dim}, rope_dim={rope.rope_dim}")
    if t == 0:
        return z
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    weight = weight.contiguous()
    scale = weight_scale.contiguous()
    m_bucket = min(triton.next_power_of_2(t), 4096)
    rd = 0 if rope is None else rope.rope_dim
    freqs = rope_freqs(rope, o.device) if rope is not None else z
    pos = positions if rope is not None else z
    args = (o, weight, scale, z, pos, freqs, t, r, k, m_bucket, o.stride(0), o.stride(1),
            o.stride(2))
    consts = dict(G=g, HEAD=head_dim if rd else 1, RD=rd, LIBDEVICE=use_libdevice())
    if tile is None:
        def grid(meta):
            return (triton.cdiv(t, meta["BLOCK_M"]), triton.cdiv(r, meta["BLOCK_N"]), g)

        _grouped_w8a16_kernel[grid](*args, **consts)
    else:
        bm, bn, bk, warps, stages = tile
        _grouped_w8a16_kernel.fn[(triton.cdiv(t, bm), triton.cdiv(r, bn), g)](
            *args, **consts, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
            num_stages=stages)
    return z


@REGISTRY.implement("triton", "gemm_grouped_w8a16", supports=_supports_grouped)
def gemm_grouped_w8a16(*, o: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       block: int = 32, positions: torch.Tensor | None = None,
                       rope: RopeParams | None = None, head_dim: int = 0) -> torch.Tensor:
    """Same contract as the reference: o [T, G, Kg] bf16 -> z [T, G * R] bf16 (exact dequant;
    inverse RoPE fused when `rope` is given)."""
    return grouped_w8a16(o, weight, weight_scale, positions=positions, rope=rope,
                         head_dim=head_dim)
