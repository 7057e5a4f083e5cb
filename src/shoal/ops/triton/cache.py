"""Triton (sm_90) cache-record writers (model.md §4, §5.4): `swa_write` (MXFP8),
`compressed_write` (NVFP4-style) and `index_k_write` (MXFP4), plus the bit-exact encoders they
share with the indexer (`e4m3_code`, `e2m1_code`, `ue8m0_pow2`).

One program quantises one token row and stores its record bytes at `cache[rows[t]]`; rows[t] < 0
is skipped (no write: the compressor's non-closing tokens, padded rows of a CUDA graph); nothing
else in the cache is touched. All encodings are integer bit manipulation on fp32 (no float8
dtypes, so the same code runs in the Triton interpreter): e4m3 round-to-nearest-even,
saturating at 448, with subnormals; e2m1 with the reference's midpoint/tie rules; UE8M0 as
`exponent(p) + (mantissa(p) != 0)`. Divisions are IEEE (`div_rn`), as the reference's.
Invariant: records are bit-identical to `shoal.quant.records.pack_*_record` for finite input
(NaN/inf inputs are unspecified here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.norm import on_device
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait


@triton.jit
def e4m3_code(v):
    """fp32 v with |v| <= 448 -> (int32 e4m3fn code incl. sign, fp32 value of the code's
    magnitude). Round to nearest even; subnormals (|v| < 2^-6) on the 2^-9 grid."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    r = a + 0x7FFFF + ((a >> 20) & 1)  # RNE to 3 mantissa bits (carry may bump the exponent)
    code_n = tl.minimum((r >> 20) - (120 << 3), 0x7E)
    val_n = ((code_n + (120 << 3)) << 20).to(tl.float32, bitcast=True)
    sub = (a.to(tl.float32, bitcast=True) * 512.0 + 8388608.0) - 8388608.0  # RNE to integer
    normal = a >= (121 << 23)  # |v| >= 2^-6
    code = tl.where(normal, code_n, sub.to(tl.int32))
    val = tl.where(normal, val_n, sub * 0.001953125)
    return code | sign, val


@triton.jit
def e2m1_code(v):
    """fp32 v (already clamped to +/-6) -> int32 e2m1 code (bit 3 = sign of v), ties to even."""
    m = tl.abs(v)
    c = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
         + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
         + (m > 5.0).to(tl.int32))
    return c | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def e2m1_value(c):
    """int32 e2m1 code -> fp32 value (code 8 gives -0.0)."""
    m = c & 7
    mag = tl.where(m < 4, m.to(tl.float32) * 0.5, tl.where(m == 7, 6.0, m.to(tl.float32) - 2.0))
    return (mag.to(tl.int32, bitcast=True) | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_pow2(p):
    """fp32 p >= 0 -> (int32 biased exponent e of 2^ceil(log2 p), fp32 2^(e - 127))."""
    bits = p.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return e, (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_block(xe, xo, amax):
    """Even/odd fp32 halves [NB, B/2] of blocks with abs max amax [NB] -> (codes_e, codes_o,
    UE8M0 exponent [NB], fp32 scale [NB]) by the MXFP4 rule (model.md §5.4)."""
    e, s = ue8m0_pow2(tl.maximum(amax, 7.052966104933725e-38) * (1.0 / 6.0))
    ce = e2m1_code(tl.clamp(tl.div_rn(xe, s[:, None]), -6.0, 6.0))
    co = e2m1_code(tl.clamp(tl.div_rn(xo, s[:, None]), -6.0, 6.0))
    return ce, co, e, s


@triton.jit
def _swa_kernel(x_ptr, rows_ptr, c_ptr, sx_t, sx_d, sc_r, D: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    nb: tl.constexpr = D // 32
    b = tl.arange(0, nb)
    col = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + t * sx_t + col * sx_d).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    e, _ = ue8m0_pow2(amax * (1.0 / 448.0))
    inv = ((254 - tl.minimum(e, 253)) << 23).to(tl.float32, bitcast=True)  # exact 1 / s
    code, _ = e4m3_code(tl.clamp(x * inv[:, None], -448.0, 448.0))
    row = tl.load(rows_ptr + t).to(tl.int64)
    base = c_ptr + tl.maximum(row, 0) * sc_r
    tl.store(base + col, code.to(tl.uint8), mask=(row >= 0) & (col >= 0))
    tl.store(base + D + b, e.to(tl.uint8), mask=(row >= 0) & (b >= 0))


@triton.jit
def _fp4_kernel(x_ptr, rows_ptr, c_ptr, sx_t, sx_d, sc_r, D: tl.constexpr, BLOCK: tl.constexpr,
                NV: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    nb: tl.constexpr = D // BLOCK
    hb: tl.constexpr = BLOCK // 2
    b = tl.arange(0, nb)
    pair = b[:, None] * hb + tl.arange(0, hb)[None, :]  # byte index of each (even, odd) pair
    xb = x_ptr + t * sx_t
    xe = tl.load(xb + (2 * pair) * sx_d).to(tl.float32)
    xo = tl.load(xb + (2 * pair + 1) * sx_d).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
    if NV:
        sc = tl.div_rn(tl.maximum(amax, 0.01171875), 6.0)
        sbyte, s = e4m3_code(tl.minimum(sc, 448.0))
        ce = e2m1_code(tl.clamp(tl.div_rn(xe, s[:, None]), -6.0, 6.0))
        co = e2m1_code(tl.clamp(tl.div_rn(xo, s[:, None]), -6.0, 6.0))
    else:
        ce, co, sbyte, _ = mxfp4_block(xe, xo, amax)
    row = tl.load(rows_ptr + t).to(tl.int64)
    base = c_ptr + tl.maximum(row, 0) * sc_r
    tl.store(base + pair, (ce | (co << 4)).to(tl.uint8), mask=(row >= 0) & (pair >= 0))
    tl.store(base + D // 2 + b, sbyte.to(tl.uint8), mask=(row >= 0) & (b >= 0))


def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _supports_for(block: int, record: int):
    def supports(*, x: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, **_) -> bool:
        d = x.shape[-1] if x.dim() == 2 else 0
        return (on_device(x) and x.dim() == 2 and x.is_floating_point() and d % block == 0
                and _pow2(d // block) and cache.dtype == torch.uint8 and cache.dim() == 2
                and cache.shape[1] == record(d) and cache.stride(1) == 1
                and rows.shape == (x.shape[0],))

    return supports


def _launch(kernel, x: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, **meta) -> None:
    t, d = x.shape
    if t:
        kernel[(t,)](x, rows, cache, x.stride(0), x.stride(1), cache.stride(0), D=d,
                     num_warps=4, **meta, **PDL_LAUNCH)


@REGISTRY.implement("triton", "swa_write", supports=_supports_for(32, lambda d: d + d // 32))
def swa_write(*, x: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor) -> None:
    """kv [T, D] -> MXFP8 records (D e4m3 + D/32 UE8M0 bytes) at cache[rows] (in place)."""
    _launch(_swa_kernel, x, cache, rows)


@REGISTRY.implement("triton", "compressed_write",
                    supports=_supports_for(16, lambda d: d // 2 + d // 16))
def compressed_write(*, x: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor) -> None:
    """latent [T, D] -> NVFP4 records (D/2 e2m1 pairs + D/16 e4m3 scales) at cache[rows]."""
    _launch(_fp4_kernel, x, cache, rows, BLOCK=16, NV=True)


@REGISTRY.implement("triton", "index_k_write",
                    supports=_supports_for(32, lambda d: d // 2 + d // 32))
def index_k_write(*, x: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor) -> None:
    """k [T, Di] -> MXFP4 records (Di/2 e2m1 pairs + Di/32 UE8M0 bytes) at cache[rows]."""
    _launch(_fp4_kernel, x, cache, rows, BLOCK=32, NV=False)
