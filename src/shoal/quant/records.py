"""Byte records of the KV caches: one row = one token (SWA) or one compressed row (model.md §4).

Owns the byte layout of a single record; per-page planes (value rows, then scale rows) are built
by the cache code from these rows.

| record | layout (dim D) | D = 512 / 128 |
|---|---|---|
| SWA | D e4m3 bytes, then D // 32 UE8M0 bytes (scale k covers dims 32k..32k+31) | 528 |
| compressed KV | D // 2 bytes of e2m1 pairs (low nibble = even dim), then D // 16 e4m3 scales | 288 |
| index K | D // 2 bytes of e2m1 pairs, then D // 32 UE8M0 scales | 68 (D = 128) |

The quantisers are :func:`quant_fp8_act` (block 32), :func:`quant_nvfp4` (block 16) and
:func:`quant_mxfp4` (block 32). Invariant: ``unpack_*_record(pack_*_record(x), D)`` equals the
matching ``qdq_*`` of ``x`` in fp32, bit for bit. Records are uint8 [..., bytes] (normally [T, bytes]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from shoal.quant._blocks import check_dtype, check_float, check_shape
from shoal.quant.fp4 import dequant_mxfp4, dequant_nvfp4, quant_mxfp4, quant_nvfp4
from shoal.quant.fp8 import dequant_fp8_act, quant_fp8_act

__all__ = [
    "COMPRESSED_BLOCK",
    "INDEX_K_BLOCK",
    "SWA_BLOCK",
    "compressed_record_bytes",
    "index_k_record_bytes",
    "pack_compressed_record",
    "pack_index_k_record",
    "pack_swa_record",
    "swa_record_bytes",
    "unpack_compressed_record",
    "unpack_index_k_record",
    "unpack_swa_record",
]

SWA_BLOCK = 32
COMPRESSED_BLOCK = 16
INDEX_K_BLOCK = 32


def _check_dim(fn: str, dim: int, multiple: int) -> None:
    if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0 or dim % multiple != 0:
        raise ValueError(f"{fn}: dim must be a positive multiple of {multiple}, got {dim!r}")


def swa_record_bytes(dim: int) -> int:
    """Bytes of one SWA record: ``dim + dim // 32`` (528 for dim 512)."""
    _check_dim("swa_record_bytes", dim, SWA_BLOCK)
    return dim + dim // SWA_BLOCK


def compressed_record_bytes(dim: int) -> int:
    """Bytes of one compressed-KV record: ``dim // 2 + dim // 16`` (288 for dim 512)."""
    _check_dim("compressed_record_bytes", dim, COMPRESSED_BLOCK)
    return dim // 2 + dim // COMPRESSED_BLOCK


def index_k_record_bytes(dim: int) -> int:
    """Bytes of one index-K record: ``dim // 2 + dim // 32`` (68 for dim 128)."""
    _check_dim("index_k_record_bytes", dim, INDEX_K_BLOCK)
    return dim // 2 + dim // INDEX_K_BLOCK


def _split(fn: str, rec: Tensor, dim: int, nbytes: int, first: int) -> tuple[Tensor, Tensor]:
    check_dtype(fn, "rec", rec, torch.uint8)
    if rec.dim() < 1:
        raise ValueError(f"{fn}: rec must have at least 1 dimension, got a scalar")
    check_shape(fn, "rec", rec, (*rec.shape[:-1], nbytes))
    return rec[..., :first].contiguous(), rec[..., first:].contiguous()


def pack_swa_record(kv: Tensor) -> Tensor:
    """[..., D] float (post-RoPE latent) -> uint8 [..., D + D // 32]: e4m3 codes, then UE8M0."""
    fn = "pack_swa_record"
    check_float(fn, "kv", kv)
    _check_dim(fn, kv.shape[-1], SWA_BLOCK)
    codes, scales = quant_fp8_act(kv, SWA_BLOCK)
    return torch.cat([codes.view(torch.uint8), scales], dim=-1)


def unpack_swa_record(rec: Tensor, dim: int) -> Tensor:
    """uint8 [..., D + D // 32] -> fp32 [..., D] (dequantised SWA key/value)."""
    fn = "unpack_swa_record"
    nbytes = swa_record_bytes(dim)
    codes, scales = _split(fn, rec, dim, nbytes, dim)
    return dequant_fp8_act(codes, scales, SWA_BLOCK)


def pack_compressed_record(x: Tensor) -> Tensor:
    """[..., D] float (post-RoPE compressed latent) -> uint8 [..., D // 2 + D // 16]."""
    fn = "pack_compressed_record"
    check_float(fn, "x", x)
    _check_dim(fn, x.shape[-1], COMPRESSED_BLOCK)
    packed, scales = quant_nvfp4(x, COMPRESSED_BLOCK)
    return torch.cat([packed, scales.view(torch.uint8)], dim=-1)


def unpack_compressed_record(rec: Tensor, dim: int) -> Tensor:
    """uint8 [..., D // 2 + D // 16] -> fp32 [..., D]."""
    fn = "unpack_compressed_record"
    nbytes = compressed_record_bytes(dim)
    packed, scales = _split(fn, rec, dim, nbytes, dim // 2)
    return dequant_nvfp4(packed, scales.view(torch.float8_e4m3fn), COMPRESSED_BLOCK)


def pack_index_k_record(x: Tensor) -> Tensor:
    """[..., D] float (post-RoPE index key) -> uint8 [..., D // 2 + D // 32]."""
    fn = "pack_index_k_record"
    check_float(fn, "x", x)
    _check_dim(fn, x.shape[-1], INDEX_K_BLOCK)
    packed, scales = quant_mxfp4(x, INDEX_K_BLOCK)
    return torch.cat([packed, scales], dim=-1)


def unpack_index_k_record(rec: Tensor, dim: int) -> Tensor:
    """uint8 [..., D // 2 + D // 32] -> fp32 [..., D]."""
    fn = "unpack_index_k_record"
    nbytes = index_k_record_bytes(dim)
    packed, scales = _split(fn, rec, dim, nbytes, dim // 2)
    return dequant_mxfp4(packed, scales, INDEX_K_BLOCK)
