"""Independent numpy oracle for shoal.quant, and per-run random seeds.

The oracle never calls shoal or torch casts: e4m3 and e2m1 are decoded from explicit tables and
encoded by searching the nearest representable value with explicit tie rules; power-of-two
exponents come from ``np.frexp``. Arithmetic that the format defines in fp32 (amax * fp32(1/448),
x / s) is done in numpy float32, which is IEEE.

Seeds: every test taking ``seed`` runs with fresh seeds each session; the id shows the seed. Set
``SHOAL_TEST_SEED=<n>`` to reproduce a failure (the run then uses n and n + 1).
"""

from __future__ import annotations

import os
import secrets
import sys

import numpy as np
import pytest

_BASE_SEED = int(os.environ.get("SHOAL_TEST_SEED", secrets.randbits(31)))
SEEDS = [_BASE_SEED, _BASE_SEED + 1]

_THIS = sys.modules[__name__]  # at import: other folders' conftest modules share the name


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "seed" in metafunc.fixturenames:
        metafunc.parametrize("seed", SEEDS, ids=[f"seed={s}" for s in SEEDS])


@pytest.fixture
def ref():
    """This module, as the numpy oracle namespace."""
    return _THIS


F32 = np.float32

# ----------------------------------------------------------------------------------------- e4m3


def _e4m3_table() -> np.ndarray:
    vals = np.empty(256, dtype=np.float64)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            vals[b] = np.nan
        elif e == 0:
            vals[b] = sign * (m / 8.0) * 2.0**-6
        else:
            vals[b] = sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return vals


E4M3 = _e4m3_table()  # float64 value of every byte
E4M3_POS = E4M3[:127]  # 0 .. 448, strictly increasing, code == index
assert np.all(np.diff(E4M3_POS) > 0) and E4M3_POS[-1] == 448.0


def e4m3_encode(x) -> np.ndarray:
    """float32 -> e4m3 bytes: clamp to +/-448, nearest value, ties to the even code; NaN -> 0x7F."""
    x = np.asarray(x, dtype=F32)
    a = np.minimum(np.abs(x).astype(np.float64), 448.0)
    hi = np.clip(np.searchsorted(E4M3_POS, a, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    dlo, dhi = np.abs(a - E4M3_POS[lo]), np.abs(E4M3_POS[hi] - a)
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = code | (np.signbit(x).astype(np.uint8) << 7)
    return np.where(np.isnan(x), np.uint8(0x7F), code).astype(np.uint8)


def e4m3_decode(b) -> np.ndarray:
    return E4M3[np.asarray(b, dtype=np.int64)].astype(F32)


def norm_e4m3_nan(b) -> np.ndarray:
    """Map both NaN bytes (0x7F, 0xFF) to 0x7F: the sign of a NaN is not part of the contract."""
    b = np.asarray(b, dtype=np.uint8)
    return np.where((b & 0x7F) == 0x7F, np.uint8(0x7F), b)


# ----------------------------------------------------------------------------------------- e2m1

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_encode(v) -> np.ndarray:
    """float32 -> e2m1 codes: clamp at 6, nearest grid value, ties to the even code; sign bit 3."""
    v = np.asarray(v, dtype=F32)
    a = np.minimum(np.abs(v).astype(np.float64), 6.0)
    d = np.abs(a[..., None] - E2M1)
    best = d.min(axis=-1, keepdims=True)
    cand = d == best
    even = (np.arange(8) % 2 == 0)
    has_even = (cand & even).any(-1)
    idx = np.where(has_even, np.argmax(cand & even, -1), np.argmax(cand, -1))
    idx = np.where(np.isnan(v), 0, idx).astype(np.uint8)
    return idx | (np.signbit(v).astype(np.uint8) << 3)


def e2m1_decode(c) -> np.ndarray:
    c = np.asarray(c, dtype=np.int64)
    mag = E2M1[c & 7]
    return np.where(c & 8, -mag, mag).astype(F32)


def pack(codes) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack(p) -> np.ndarray:
    p = np.asarray(p, dtype=np.uint8)
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


# ---------------------------------------------------------------------------------------- ue8m0


def pow2_ceil(p) -> tuple[np.ndarray, np.ndarray]:
    """float32 p >= 0 -> (scale float32, UE8M0 byte), the exponent-bit rule via np.frexp.

    p a power of two keeps its exponent, otherwise the next one up; fp32-subnormal p gives 2^-126;
    0 gives scale 0 and byte 0; NaN gives (NaN, 255); results above 2^127 or inf give (inf, 255).
    """
    p = np.asarray(p, dtype=F32)
    m, e = np.frexp(p)
    k = np.where(m == 0.5, e - 1, e).astype(np.int64)
    k = np.where((p > 0) & (p < F32(2.0**-126)), -126, k)
    with np.errstate(over="ignore"):
        s = np.ldexp(F32(1.0), np.clip(k, -126, 128).astype(np.int32)).astype(F32)
    byte = np.clip(k + 127, 0, 255)
    s = np.where(p == 0, F32(0.0), s)
    byte = np.where(p == 0, 0, byte)
    nonfinite = ~np.isfinite(p) | (k >= 128)
    s = np.where(np.isnan(p), F32(np.nan), np.where(nonfinite, F32(np.inf), s)).astype(F32)
    byte = np.where(nonfinite, 255, byte).astype(np.uint8)
    return s, byte


def ue8m0_value(b) -> np.ndarray:
    b = np.asarray(b, dtype=np.int64)
    with np.errstate(over="ignore"):
        v = np.ldexp(1.0, b - 127).astype(F32)
    return np.where(b == 255, F32(np.nan), v).astype(F32)


# ----------------------------------------------------------------------------------- quantisers


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _absmax(g: np.ndarray) -> np.ndarray:
    if g.size == 0:
        return np.zeros(g.shape[:-1], dtype=F32)
    return np.max(np.abs(g), axis=-1).astype(F32)  # np.max propagates NaN


def fp8_act(x, block=32):
    """-> (e4m3 bytes [..., K], UE8M0 bytes [..., K // block], dequantised float32 [..., K])."""
    g = _blocks(np.asarray(x, dtype=F32), block)
    amax = np.maximum(_absmax(g), F32(1e-4))
    s, byte = pow2_ceil(amax * F32(1.0 / 448.0))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        v = np.clip(g / s[..., None], F32(-448), F32(448))
    codes = e4m3_encode(v)
    with np.errstate(over="ignore", invalid="ignore"):  # e.g. 256 * 2^120 from fp32 max -> inf
        deq = e4m3_decode(codes) * ue8m0_value(byte)[..., None]
    return codes.reshape(np.shape(x)), byte, deq.reshape(np.shape(x)).astype(F32)


def fp8_weight(w, block=32):
    """Block x block tiles of [..., N, K] (edge tiles partial) -> (codes, scale bytes, dequant)."""
    w = np.asarray(w, dtype=F32)
    n, k = w.shape[-2:]
    nb, kb = -(-n // block), -(-k // block)
    codes = np.zeros(w.shape, dtype=np.uint8)
    scales = np.zeros(w.shape[:-2] + (nb, kb), dtype=np.uint8)
    deq = np.zeros(w.shape, dtype=F32)
    for i in range(nb):
        for j in range(kb):
            t = w[..., i * block:(i + 1) * block, j * block:(j + 1) * block]
            flat = t.reshape(t.shape[:-2] + (t.shape[-2] * t.shape[-1],))
            c, b, d = fp8_act(flat, block=flat.shape[-1])
            codes[..., i * block:(i + 1) * block, j * block:(j + 1) * block] = c.reshape(t.shape)
            deq[..., i * block:(i + 1) * block, j * block:(j + 1) * block] = d.reshape(t.shape)
            scales[..., i, j] = b[..., 0]
    return codes, scales, deq


def mxfp4(x, block=32):
    """-> (packed bytes [..., K // 2], UE8M0 bytes [..., K // block], dequant float32 [..., K])."""
    x = np.asarray(x, dtype=F32)
    g = _blocks(x, block)
    amax = np.maximum(_absmax(g), F32(6 * 2.0**-126))
    s, byte = pow2_ceil(amax * F32(1.0 / 6.0))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        v = np.clip(g / s[..., None], F32(-6), F32(6))
    codes = e2m1_encode(v)
    with np.errstate(over="ignore", invalid="ignore"):
        deq = e2m1_decode(codes) * ue8m0_value(byte)[..., None]
    return pack(codes.reshape(x.shape)), byte, deq.reshape(x.shape).astype(F32)


def nvfp4(x, block=16):
    """-> (packed bytes [..., K // 2], e4m3 scale bytes [..., K // block], dequant float32)."""
    x = np.asarray(x, dtype=F32)
    g = _blocks(x, block)
    amax = np.maximum(_absmax(g), F32(6 * 2.0**-9))
    with np.errstate(invalid="ignore", over="ignore"):
        sbyte = e4m3_encode(amax / F32(6.0))
    s = e4m3_decode(sbyte)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        v = np.clip(g / s[..., None], F32(-6), F32(6))
    codes = e2m1_encode(v)
    deq = e2m1_decode(codes) * s[..., None]
    return pack(codes.reshape(x.shape)), sbyte, deq.reshape(x.shape).astype(F32)


# ------------------------------------------------------------------------------------ test data


def random_values(rng: np.random.Generator, shape, block: int = 16) -> np.ndarray:
    """float32 values whose magnitude varies per block of ``block`` over ~2^-140 .. 2^120.

    Mixes normal, uniform and heavy-tailed draws, exact zeros, exact small integers and
    (through the smallest block scales) fp32 and bf16 subnormals.
    """
    shape = tuple(shape)
    n = int(np.prod(shape))
    base = rng.standard_normal(n)
    kind = rng.integers(0, 4, n)
    base = np.where(kind == 1, rng.uniform(-1, 1, n), base)
    base = np.where(kind == 2, rng.standard_cauchy(n), base)
    base = np.where(kind == 3, rng.integers(-8, 9, n) * 0.25, base)
    base = np.where(rng.random(n) < 0.03, 0.0, base)
    nblk = -(-n // block)
    exps = rng.choice(
        np.concatenate([rng.integers(-20, 20, 64), rng.integers(-140, 120, 16)]), nblk
    )
    scale = np.repeat(np.ldexp(1.0, exps), block)[:n]
    with np.errstate(over="ignore"):
        out = (base * scale).astype(F32)
    out = np.where(np.isfinite(out), out, F32(0))
    return out.reshape(shape)
