"""FP8 (e4m3fn) block quantisation with UE8M0 power-of-two scales (model.md §5.1, §5.2, §5.4).

Owns the reference definitions of
- the activation quantiser used at every FP8/FP4 GEMM and for the SWA KV record: per row, per
  ``block`` (32) contiguous values, ``amax = max(max|x|, 1e-4)``,
  ``s = 2^ceil(log2(amax * fp32(1/448)))`` (:func:`shoal.quant.ue8m0.pow2_scale_ceil`),
  ``q = e4m3_RNE(clamp(x / s, -448, 448))`` with an IEEE fp32 division (exact here: s is a power
  of two);
- the dense-weight quantiser (32x32 blocks, same rule per block) used by synthetic checkpoints.

Codes are ``torch.float8_e4m3fn`` tensors, scales are uint8 UE8M0 bytes. All functions are pure,
work on CPU and CUDA, on any leading shape and on empty tensors; inputs are computed on as fp32.

NaN/inf: a block containing NaN gets scale NaN and one containing +/-inf gets scale +inf; both
encode to the UE8M0 byte 0xFF, so the whole block dequantises to NaN, and the codes of such a
block are unspecified. (A deliberate choice: the reference's bit trick would turn a NaN amax into
a -0.0 scale, and its CUDA max-reduction may skip NaNs; a healthy forward has none.)
Overflow: near the fp32 maximum a code can round up so that ``q * s = 2^128``, which dequantises
to +/-inf (e.g. the bf16 maximum 3.39e38), as in the reference.

Invariant: for finite input, ``dequant(quant(x))`` is ``q * s`` with ``|q| <= 448``, exact in bf16
(barring the overflow above), and ``qdq_fp8_act(x)`` equals the reference's in-place ``act_quant``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
from shoal.quant.ue8m0 import pow2_scale_ceil, ue8m0_decode, ue8m0_encode

__all__ = [
    "FP8_AMAX_FLOOR",
    "FP8_MAX",
    "dequant_fp8_act",
    "dequant_fp8_weight",
    "e4m3_saturate",
    "qdq_fp8_act",
    "quant_fp8_act",
    "quant_fp8_weight",
]

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4  # rounded to fp32 by the comparison, as in the reference kernel


def e4m3_saturate(v: Tensor) -> Tensor:
    """fp32 -> ``float8_e4m3fn`` with round-to-nearest-even, saturating at +/-448.

    torch's own cast maps large values to NaN, so values are clamped first. NaN stays NaN (code
    0x7F, or 0xFF with the sign bit); -0.0 and negatives that round to zero keep the sign (0x80).
    """
    return v.to(torch.float32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _as_e4m3(fn: str, codes: Tensor) -> Tensor:
    check_dtype(fn, "codes", codes, torch.float8_e4m3fn, torch.uint8)
    return codes.view(torch.float8_e4m3fn) if codes.dtype == torch.uint8 else codes


def quant_fp8_act(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Per-row, per-``block`` FP8 activation quantisation (model.md §5.2).

    Args:
        x: float tensor [..., K], K a multiple of ``block``.
        block: contiguous values sharing one scale (32 in V4.1; 128 in V4).

    Returns:
        ``(codes, scales)``: codes ``float8_e4m3fn`` [..., K]; scales uint8 UE8M0 [..., K // block].
    """
    fn = "quant_fp8_act"
    check_block(fn, block)
    check_float(fn, "x", x)
    check_last_dim(fn, "x", x.shape[-1], block)
    g = blocked(x.to(torch.float32), block)
    amax = abs_block_max(g).clamp_min(FP8_AMAX_FLOOR)
    s = pow2_scale_ceil(amax, 1.0 / FP8_MAX)
    q = e4m3_saturate(g / s.unsqueeze(-1))
    return q.flatten(-2), ue8m0_encode(s)


def dequant_fp8_act(
    codes: Tensor, scales: Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quant_fp8_act`: ``codes * 2^(scale - 127)`` per block.

    Args:
        codes: ``float8_e4m3fn`` (or its uint8 bytes) [..., K].
        scales: uint8 UE8M0 [..., K // block]; byte 0xFF makes the block NaN.
        block: block size used to quantise.
        dtype: output dtype (the product is formed in fp32, then cast).

    Returns:
        tensor [..., K] of ``dtype``.
    """
    fn = "dequant_fp8_act"
    check_block(fn, block)
    codes = _as_e4m3(fn, codes)
    check_dtype(fn, "scales", scales, torch.uint8)
    k = codes.shape[-1]
    check_last_dim(fn, "codes", k, block)
    check_shape(fn, "scales", scales, (*codes.shape[:-1], k // block))
    v = blocked(codes.to(torch.float32), block) * ue8m0_decode(scales).unsqueeze(-1)
    return v.flatten(-2).to(dtype)


def qdq_fp8_act(x: Tensor, block: int = 32) -> Tensor:
    """Quantise then dequantise (the reference's in-place ``act_quant``); same dtype as ``x``.

    Values are exact in bf16 (an e4m3 value times a power of two); for fp16 input they are cast
    from fp32 and may round or overflow.
    """
    codes, scales = quant_fp8_act(x, block)
    return dequant_fp8_act(codes, scales, block, dtype=x.dtype)


def quant_fp8_weight(w: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Block FP8 weight quantisation: ``block`` x ``block`` tiles, the activation rule per tile.

    Edge tiles (N or K not a multiple of ``block``) take their amax over the existing values only.

    Args:
        w: float tensor [..., N, K].
        block: tile edge (32 in V4.1's checkpoint).

    Returns:
        ``(codes, scales)``: codes ``float8_e4m3fn`` [..., N, K]; scales uint8 UE8M0
        [..., ceil(N / block), ceil(K / block)].
    """
    fn = "quant_fp8_weight"
    check_block(fn, block)
    check_float(fn, "w", w)
    if w.dim() < 2:
        raise ValueError(f"{fn}: w must have at least 2 dimensions [..., N, K], got {w.dim()}")
    n, k = w.shape[-2], w.shape[-1]
    nb, kb = -(-n // block), -(-k // block)
    wp = F.pad(w.to(torch.float32), (0, kb * block - k, 0, nb * block - n))
    g = wp.unflatten(-1, (kb, block)).unflatten(-3, (nb, block))  # [..., nb, b, kb, b]
    amax = g.abs().amax(dim=(-3, -1)).clamp_min(FP8_AMAX_FLOOR)  # [..., nb, kb]
    s = pow2_scale_ceil(amax, 1.0 / FP8_MAX)
    q = e4m3_saturate(g / s[..., :, None, :, None])
    q = q.flatten(-2).flatten(-3, -2)[..., :n, :k]
    return q.contiguous(), ue8m0_encode(s)


def dequant_fp8_weight(
    codes: Tensor, scales: Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quant_fp8_weight`: ``q[n, k] * 2^(scales[n // b, k // b] - 127)``.

    Args:
        codes: ``float8_e4m3fn`` (or uint8 bytes) [..., N, K].
        scales: uint8 UE8M0 [..., ceil(N / block), ceil(K / block)].
        block: tile edge.
        dtype: output dtype (product formed in fp32).

    Returns:
        tensor [..., N, K] of ``dtype``.
    """
    fn = "dequant_fp8_weight"
    check_block(fn, block)
    codes = _as_e4m3(fn, codes)
    check_dtype(fn, "scales", scales, torch.uint8)
    if codes.dim() < 2:
        raise ValueError(f"{fn}: codes must have at least 2 dimensions, got {codes.dim()}")
    n, k = codes.shape[-2], codes.shape[-1]
    check_shape(fn, "scales", scales, (*codes.shape[:-2], -(-n // block), -(-k // block)))
    s = ue8m0_decode(scales).repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return (codes.to(torch.float32) * s[..., :n, :k]).to(dtype)
