"""UE8M0 power-of-two scales: the rounding rule and the byte encoding.

Owns the one rule every power-of-two block scale in the model uses (model.md §5.2 step 2, §5.4):
``s = 2^ceil(log2(amax * fp32(inv_max)))``, computed from the fp32 bits of the product (the
exponent field, plus one when any mantissa bit is set), exactly as the reference kernel's
``fast_round_scale`` does. A UE8M0 byte is the biased exponent ``e + 127`` of such a scale; the byte
0xFF means NaN.

Invariant: ``ue8m0_decode(ue8m0_encode(pow2_scale_ceil(a, m)))`` equals ``pow2_scale_ceil(a, m)``
bit for bit for every finite non-negative ``a`` whose scale lies in [2^-126, 2^127]; non-finite
scales (NaN, +inf) encode to 0xFF and decode to NaN.
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

__all__ = ["UE8M0_NAN", "pow2_scale_ceil", "ue8m0_decode", "ue8m0_encode"]

UE8M0_NAN = 0xFF  # the one NaN byte of UE8M0
_MANTISSA_MASK = (1 << 23) - 1
_MAGNITUDE_MASK = (1 << 31) - 1
_EXPONENT_MASK = -(1 << 23)  # int32 0xFF800000: sign and exponent fields


def _as_fp32(x: float) -> float:
    """x rounded to the nearest fp32 value (still a Python float)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _fp32_bits(x: Tensor) -> Tensor:
    """int32 bit pattern of an fp32 tensor (a fresh contiguous tensor)."""
    return x.to(torch.float32).contiguous().view(torch.int32)


def pow2_scale_ceil(amax: Tensor, inv_max: float) -> Tensor:
    """``2^ceil(log2(amax * fp32(inv_max)))`` as fp32, computed from the fp32 exponent bits.

    Args:
        amax: block absolute maxima, any shape, any float dtype (upcast to fp32), expected >= 0.
            The caller applies the format's amax floor first.
        inv_max: the reciprocal of the element format's max (1/448 for e4m3, 1/6 for e2m1). It is
            rounded to fp32 once, as the reference kernel's ``fp8_max_inv``/``fp4_max_inv`` are,
            and multiplied (not divided) into ``amax`` in fp32.

    Returns:
        fp32 tensor of ``amax``'s shape. With ``p = fp32(amax * fp32(inv_max))``:
        - ``p`` a power of two: ``p`` itself; otherwise the next power of two above ``p``;
        - ``p`` fp32-subnormal: ``2^-126`` (exponent field 0, mantissa nonzero), ``p == 0``: ``0.0``;
        - ``p > 2^127`` or ``+inf``: ``+inf`` (2^128 overflows);
        - NaN in ``amax``: NaN (the reference's bit formula would wrap to -0.0; we keep NaN so a
          poisoned block stays visible).
        The sign bit of ``p`` is ignored (magnitude only).
    """
    # A Python scalar (already an fp32 value), not a device tensor: no host -> device copy, so
    # this runs inside a CUDA graph capture; the product is formed in fp32 either way.
    p = amax.to(torch.float32) * _as_fp32(inv_max)
    # |p|'s bits plus a full mantissa carry into the exponent exactly when a mantissa bit is set;
    # clearing the mantissa leaves 2^(exponent field + carry - 127), the rule above in three
    # integer ops (a decode step quantises a hundred activations)
    bits = torch.bitwise_and(_fp32_bits(p), _MAGNITUDE_MASK)
    out = bits.add_(_MANTISSA_MASK).bitwise_and_(_EXPONENT_MASK).view(torch.float32)
    return out.masked_fill_(p != p, float("nan"))  # a fill value, not a host tensor


def ue8m0_encode(pow2: Tensor) -> Tensor:
    """fp32 power of two -> uint8 UE8M0 byte (the biased exponent ``e + 127``).

    Args:
        pow2: fp32 (or any float dtype, upcast) powers of two in [2^-127, 2^127], any shape.

    Returns:
        uint8 tensor of the same shape: the fp32 exponent field of ``pow2``. So 2^-126 -> 1,
        1.0 -> 127, 2^127 -> 254, +/-inf and NaN -> 0xFF (decodes to NaN), 2^-127 (subnormal) -> 0.
        A value that is not a power of two is truncated to its exponent field (0.0 and any
        subnormal give 0, i.e. 2^-127); the sign is ignored.
    """
    # the cast to uint8 keeps the low 8 bits: the exponent field, without the sign
    return torch.bitwise_right_shift(_fp32_bits(pow2), 23).to(torch.uint8)


def ue8m0_decode(e: Tensor) -> Tensor:
    """uint8 UE8M0 bytes -> fp32 ``2^(e - 127)``; byte 0xFF -> NaN, byte 0 -> 2^-127 (subnormal).

    Args:
        e: uint8 tensor, any shape.

    Returns:
        fp32 tensor of the same shape.
    """
    if e.dtype != torch.uint8:
        raise ValueError(f"ue8m0_decode: e.dtype must be torch.uint8, got {e.dtype}")
    if e.is_cpu:
        return _UE8M0_VALUES[e.long()]
    # elsewhere from the bits: a host table would be a copy, which a CUDA graph capture refuses
    return _decode_by_bits(e)


def _decode_by_bits(e: Tensor) -> Tensor:
    """ue8m0_decode from the bit layout (the CPU lookup table is built from it)."""
    field = e.to(torch.int32)
    bits = torch.where(field == 0, torch.full_like(field, 1 << 22), field << 23)
    out = bits.view(torch.float32)
    return torch.where(field == UE8M0_NAN, torch.full_like(out, float("nan")), out)


# fp32 value of every UE8M0 byte: on the CPU one lookup instead of four elementwise ops (same bits)
_UE8M0_VALUES = _decode_by_bits(torch.arange(256, dtype=torch.uint8))
