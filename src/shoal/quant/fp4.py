"""FP4 (e2m1) codes, nibble packing, and the MXFP4 / NVFP4-style block quantisers (model.md §5.3, §5.4).

e2m1 code: bit 3 is the sign, bits 0-2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Two codes
per byte, the **low nibble holds the even element**.

Quantisers (reference ``fp4_act_quant``):
- MXFP4 (indexer q and k, synthetic MXFP4 expert weights): blocks of 32, UE8M0 scale
  ``s = 2^ceil(log2(max(amax, 6*2^-126) * fp32(1/6)))`` (:func:`pow2_scale_ceil`).
- NVFP4-style (compressed KV): blocks of 16, e4m3 scale ``s = e4m3_RNE(fp32(max(amax, 6*2^-9) / 6))``
  (an IEEE fp32 division by 6, then one RNE cast to e4m3, saturating).
- Both: ``v = clamp(x / s, -6, 6)`` with an IEEE fp32 **division** by the fp32 value of the scale
  (as the reference kernel, compiled without fast math; never a multiply by a reciprocal, which
  differs at the e2m1 rounding boundaries when ``s`` is not a power of two), then
  round-to-nearest, ties to the even code: 0.75 -> 1, 1.75 -> 2, 3.5 -> 4 go up; 0.25 -> 0,
  1.25 -> 1, 2.5 -> 2, 5 -> 4 go down. The sign of ``v`` is kept even when it rounds to zero.

NaN/inf: e2m1 has no NaN or inf. :func:`e2m1_encode` maps NaN to a zero code (sign bit kept) and
+/-inf to +/-6. In the quantisers a NaN anywhere in a block makes the block's scale NaN (UE8M0 0xFF
or an e4m3 NaN byte), so the whole block dequantises to NaN and its codes are unspecified. An inf
makes an MXFP4 scale +inf (byte 0xFF, block NaN); an NVFP4 scale saturates at 448 like the
reference's satfinite cast, so the inf element becomes +/-6*448 and the rest of the block
quantises against s = 448. MXFP4 overflow: near the fp32 maximum, ``e2m1 * s`` can reach 2^128 and
dequantise to inf (e.g. the bf16 maximum), as in the reference.

All functions are pure, work on CPU and CUDA, on any leading shape and on empty tensors.
Invariant: for finite input, every dequantised value is ``e2m1 * s``, exact in bf16.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shoal.quant._blocks import (
    abs_block_max,
    blocked,
    check_block,
    check_dtype,
    check_float,
    check_last_dim,
    check_shape,
)
from shoal.quant.fp8 import e4m3_saturate
from shoal.quant.ue8m0 import pow2_scale_ceil, ue8m0_decode, ue8m0_encode

__all__ = [
    "E2M1_VALUES",
    "FP4_MAX",
    "MXFP4_AMAX_FLOOR",
    "NVFP4_AMAX_FLOOR",
    "dequant_mxfp4",
    "dequant_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "pack_fp4",
    "qdq_mxfp4",
    "qdq_nvfp4",
    "quant_mxfp4",
    "quant_nvfp4",
    "unpack_fp4",
]

FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude by 3-bit code
MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126
NVFP4_AMAX_FLOOR = 6.0 * 2.0**-9
# Midpoints between consecutive magnitudes, and whether an exact tie rounds up (to the even code).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
              (5.0, False))


def e2m1_encode(v: Tensor) -> Tensor:
    """Already-scaled values -> uint8 e2m1 codes (0..15), RNE with ties to the even code.

    Args:
        v: float tensor, any shape (upcast to fp32). Magnitudes above 6 saturate to 6 (code 7).

    Returns:
        uint8 tensor of ``v``'s shape. The sign bit (8) is ``signbit(v)``, so -0.0 and negatives
        that round to zero give code 8. NaN gives code 0 or 8 (by its sign bit).
    """
    if not torch.is_floating_point(v):
        raise ValueError(f"e2m1_encode: v must be a floating-point tensor, got dtype {v.dtype}")
    mag = v.to(torch.float32).abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid, tie_up in _MIDPOINTS:
        step = (mag >= mid) if tie_up else (mag > mid)  # NaN compares False: stays 0
        code = code + step.to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 e2m1 codes -> fp32 values (only the low 4 bits of each byte are read).

    Code 8 decodes to -0.0.
    """
    check_dtype("e2m1_decode", "codes", codes, torch.uint8)
    # Arithmetic, not a table: building a table would copy host -> device, which a CUDA graph
    # capture refuses. |v| = m/2 for exponent e = 0, else 2^(e-1) * (1 + m/2); exact in fp32.
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).to(torch.float32)) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def pack_fp4(codes: Tensor) -> Tensor:
    """uint8 codes [..., K] (K even) -> uint8 [..., K // 2]; byte i = codes[2i] | codes[2i+1] << 4.

    Only the low 4 bits of each code are used.
    """
    fn = "pack_fp4"
    check_dtype(fn, "codes", codes, torch.uint8)
    if codes.dim() < 1:
        raise ValueError(f"{fn}: codes must have at least 1 dimension, got a scalar")
    check_last_dim(fn, "codes", codes.shape[-1], 1, even=True)
    lo = codes[..., 0::2] & 0x0F
    hi = codes[..., 1::2] & 0x0F
    return (lo | (hi << 4)).contiguous()


def unpack_fp4(packed: Tensor) -> Tensor:
    """uint8 [..., K // 2] -> uint8 codes [..., K]; the low nibble is the even element."""
    fn = "unpack_fp4"
    check_dtype(fn, "packed", packed, torch.uint8)
    if packed.dim() < 1:
        raise ValueError(f"{fn}: packed must have at least 1 dimension, got a scalar")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def _encode_blocks(g: Tensor, s: Tensor) -> Tensor:
    """fp32 [..., nb, block] / fp32 scales [..., nb] -> packed codes [..., nb * block // 2]."""
    v = (g / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    return pack_fp4(e2m1_encode(v).flatten(-2))


# e2m1 value pair of each packed byte (low nibble first), from e2m1_decode itself: on the CPU one
# lookup instead of the elementwise decode, same bits.
_BYTE_PAIRS = e2m1_decode(unpack_fp4(torch.arange(256, dtype=torch.uint8).view(256, 1)))


def _decode_blocks(packed: Tensor, s: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    """packed [..., K // 2] and fp32 scales [..., K // block] -> values [..., K] of ``dtype``."""
    if packed.is_cpu:
        values = _BYTE_PAIRS[packed.long()].flatten(-2)
    else:  # a host table would be a copy, which a CUDA graph capture refuses
        values = e2m1_decode(unpack_fp4(packed))
    return (blocked(values, block) * s.unsqueeze(-1)).flatten(-2).to(dtype)


def _check_packed(fn: str, packed: Tensor, scales: Tensor, block: int) -> None:
    check_block(fn, block)
    check_dtype(fn, "packed", packed, torch.uint8)
    if packed.dim() < 1:
        raise ValueError(f"{fn}: packed must have at least 1 dimension, got a scalar")
    k = 2 * packed.shape[-1]
    check_last_dim(fn, "2 * packed", k, block)
    check_shape(fn, "scales", scales, (*packed.shape[:-1], k // block))


def quant_mxfp4(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """MXFP4: e2m1 codes with one UE8M0 scale per ``block`` values (indexer q/k rule).

    Args:
        x: float tensor [..., K], K a multiple of ``block`` and even (e.g. expert weights [N, K]).
        block: values per scale (32).

    Returns:
        ``(packed, scales)``: packed uint8 [..., K // 2]; scales uint8 UE8M0 [..., K // block].
    """
    fn = "quant_mxfp4"
    check_block(fn, block)
    check_float(fn, "x", x)
    check_last_dim(fn, "x", x.shape[-1], block, even=True)
    g = blocked(x.to(torch.float32), block)
    amax = abs_block_max(g).clamp_min(MXFP4_AMAX_FLOOR)
    s = pow2_scale_ceil(amax, 1.0 / FP4_MAX)
    return _encode_blocks(g, s), ue8m0_encode(s)


def dequant_mxfp4(
    packed: Tensor, scales: Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quant_mxfp4`: ``e2m1 * 2^(scale - 127)``; scale byte 0xFF gives NaN.

    Args:
        packed: uint8 [..., K // 2]. scales: uint8 [..., K // block].
        dtype: output dtype (product formed in fp32).

    Returns:
        tensor [..., K] of ``dtype``.
    """
    fn = "dequant_mxfp4"
    _check_packed(fn, packed, scales, block)
    check_dtype(fn, "scales", scales, torch.uint8)
    return _decode_blocks(packed, ue8m0_decode(scales), block, dtype)


def qdq_mxfp4(x: Tensor, block: int = 32) -> Tensor:
    """MXFP4 quantise-dequantise (the reference's in-place ``fp4_act_quant``, E8M0); x's dtype."""
    packed, scales = quant_mxfp4(x, block)
    return dequant_mxfp4(packed, scales, block, dtype=x.dtype)


def quant_nvfp4(x: Tensor, block: int = 16) -> tuple[Tensor, Tensor]:
    """NVFP4-style (compressed KV): e2m1 codes with one e4m3 scale per ``block`` values.

    ``s = e4m3_RNE(fp32(max(amax, 6*2^-9) / 6))`` (IEEE division, saturating cast); there is no
    second-level (per-tensor) scale. ``s >= 2^-9`` always, so ``x / s`` is finite for finite x.

    Args:
        x: float tensor [..., K], K a multiple of ``block`` and even.
        block: values per scale (16).

    Returns:
        ``(packed, scales)``: packed uint8 [..., K // 2]; scales ``float8_e4m3fn`` [..., K // block].
    """
    fn = "quant_nvfp4"
    check_block(fn, block)
    check_float(fn, "x", x)
    check_last_dim(fn, "x", x.shape[-1], block, even=True)
    g = blocked(x.to(torch.float32), block)
    amax = abs_block_max(g).clamp_min(NVFP4_AMAX_FLOOR)
    # A tensor divisor keeps this an IEEE division on CUDA too (torch turns division by a CPU
    # scalar into a multiply by its reciprocal there).
    s8 = e4m3_saturate(amax / torch.full_like(amax, FP4_MAX))
    return _encode_blocks(g, s8.to(torch.float32)), s8


def dequant_nvfp4(
    packed: Tensor, scales: Tensor, block: int = 16, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quant_nvfp4`: ``e2m1 * fp32(scale)``; a NaN scale gives a NaN block.

    Args:
        packed: uint8 [..., K // 2]. scales: ``float8_e4m3fn`` (or its uint8 bytes) [..., K // block].
        dtype: output dtype (product formed in fp32).

    Returns:
        tensor [..., K] of ``dtype``.
    """
    fn = "dequant_nvfp4"
    check_dtype(fn, "scales", scales, torch.float8_e4m3fn, torch.uint8)
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    _check_packed(fn, packed, scales, block)
    return _decode_blocks(packed, scales.to(torch.float32), block, dtype)


def qdq_nvfp4(x: Tensor, block: int = 16) -> Tensor:
    """NVFP4-style quantise-dequantise (reference ``fp4_act_quant``, e4m3 scales); x's dtype."""
    packed, scales = quant_nvfp4(x, block)
    return dequant_nvfp4(packed, scales, block, dtype=x.dtype)
