"""Element formats: UE8M0 scales, e4m3 saturating RNE, e2m1 codes and nibble packing.

Each result is compared bit for bit with the numpy oracle in conftest.py (tables + explicit tie
rules + np.frexp), plus a few hand-written golden values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.quant import (
    e2m1_decode,
    e2m1_encode,
    e4m3_saturate,
    pack_fp4,
    pow2_scale_ceil,
    ue8m0_decode,
    ue8m0_encode,
    unpack_fp4,
)

F32 = np.float32
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
]


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=F32).view(np.uint32)


def _t(a, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=F32)).to(device)


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t.cpu().numpy()


def _neighbours(v) -> np.ndarray:
    """v and its fp32 neighbours on both sides, with both signs."""
    v = np.asarray(v, dtype=F32)
    out = np.concatenate([v, np.nextafter(v, F32(np.inf)), np.nextafter(v, F32(-np.inf))])
    return np.concatenate([out, -out]).astype(F32)


# ---------------------------------------------------------------------------------------- UE8M0


@pytest.mark.parametrize("device", DEVICES)
def test_pow2_scale_ceil_edges(ref, device):
    pows = np.ldexp(F32(1), np.arange(-126, 128)).astype(F32)
    p = np.concatenate([
        pows, np.nextafter(pows, F32(np.inf)), np.nextafter(pows, F32(0)),
        [0.0, 1e-45, 1e-40, 2.0**-127, 3.0e38, np.finfo(F32).max, np.inf, np.nan],
    ]).astype(F32)
    got = pow2_scale_ceil(_t(p, device), 1.0)
    want, _ = ref.pow2_ceil(p)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(_bits(_np(got)), _bits(want))
    # golden values of the rule itself
    assert pow2_scale_ceil(torch.tensor([1.0, 1.5, 0.75, 2.0**-130, 2.0**127 * 1.5]), 1.0).tolist() \
        == [1.0, 2.0, 1.0, 2.0**-126, float("inf")]


@pytest.mark.parametrize("device", DEVICES)
def test_pow2_scale_ceil_random_inv_max(ref, seed, device):
    rng = np.random.default_rng(seed)
    amax = np.abs(ref.random_values(rng, (4096,), block=1))
    for inv in (1.0 / 448.0, 1.0 / 6.0):
        got = pow2_scale_ceil(_t(amax, device), inv)
        want, _ = ref.pow2_ceil(amax * F32(inv))  # the product is formed in fp32
        np.testing.assert_array_equal(_bits(_np(got)), _bits(want))


@pytest.mark.parametrize("fmt_max", [448.0, 6.0])
def test_pow2_scale_ceil_product_rule_near_powers(ref, fmt_max):
    """Every fp32 amax within 0.1% of fmt_max * 2^j: the kernel's fp32-product rule matches the
    oracle, and (a fact kernels may rely on) equals the exact ceil(log2(amax / fmt_max))."""
    for j in (-30, 0, 17):
        lo, hi = np.array([fmt_max * 0.999 * 2.0**j, fmt_max * 1.001 * 2.0**j], dtype=F32)
        amax = np.arange(lo.view(np.uint32), hi.view(np.uint32), dtype=np.uint32).view(F32)
        got = pow2_scale_ceil(torch.from_numpy(amax), 1.0 / fmt_max).numpy()
        want, _ = ref.pow2_ceil(amax * F32(1.0 / fmt_max))
        np.testing.assert_array_equal(_bits(got), _bits(want))
        exact = np.ceil(np.log2(amax.astype(np.float64) / fmt_max))
        np.testing.assert_array_equal(np.log2(got.astype(np.float64)), exact)


@pytest.mark.parametrize("device", DEVICES)
def test_ue8m0_all_bytes_round_trip(ref, device):
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    v = ue8m0_decode(b)
    np.testing.assert_array_equal(_bits(_np(v))[:255], _bits(ref.ue8m0_value(np.arange(255))))
    assert torch.isnan(v[255]).item()
    assert v[0].item() == 2.0**-127 and v[1].item() == 2.0**-126 and v[127].item() == 1.0
    assert v[254].item() == 2.0**127
    assert torch.equal(ue8m0_encode(v), b)
    assert ue8m0_encode(torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])).tolist() \
        == [255, 255, 255, 0]


def test_ue8m0_decode_rejects_non_uint8():
    with pytest.raises(ValueError, match="uint8"):
        ue8m0_decode(torch.zeros(3, dtype=torch.int32))


# ----------------------------------------------------------------------------------------- e4m3


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_ties_and_edges(ref, device):
    pos = ref.E4M3_POS
    mids = ((pos[:-1] + pos[1:]) / 2).astype(F32)  # exact in fp32: 5 significant bits
    assert np.array_equal(mids.astype(np.float64), (pos[:-1] + pos[1:]) / 2)
    x = np.concatenate([
        _neighbours(mids), _neighbours(pos[1:].astype(F32)),
        [0.0, -0.0, 448, -448, 449, 463.9, 464, 470, 480, 1e4, 3e38, np.inf, -np.inf, 1e-45, -1e-45,
         2.0**-10, 3 * 2.0**-10, 2.0**-126, np.nan],
    ]).astype(F32)
    got = _np(e4m3_saturate(_t(x, device)))
    want = ref.e4m3_encode(x)
    np.testing.assert_array_equal(ref.norm_e4m3_nan(got), ref.norm_e4m3_nan(want))
    # golden: ties go to the even code, saturation, signed zero, NaN
    g = _np(e4m3_saturate(torch.tensor(
        [2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 464.0, 1e9, -1e9, -0.0, -1e-9, float("nan")]
    ).to(device)))
    assert g.tolist()[:9] == [0x00, 0x02, 0x38, 0x3A, 0x7E, 0x7E, 0xFE, 0x80, 0x80]
    assert g[9] & 0x7F == 0x7F


def test_e4m3_all_bytes_exact(ref):
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = [i for i in range(256) if (i & 0x7F) != 0x7F]
    vals = b.view(torch.float8_e4m3fn).float()
    np.testing.assert_array_equal(vals.numpy()[finite], ref.E4M3[finite].astype(F32))
    assert torch.equal(e4m3_saturate(vals[finite]).view(torch.uint8), b[finite])


# ----------------------------------------------------------------------------------------- e2m1

E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_ties_golden(device):
    x = torch.tensor(E2M1_TIES + [-t for t in E2M1_TIES], device=device)
    # ties go up at 0.75, 1.75, 3.5 (the upper code is even), down at the others
    up = [0, 2, 2, 4, 4, 6, 6]
    assert e2m1_encode(x).tolist() == up + [c | 8 for c in up]


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_encode_vs_oracle(ref, seed, device):
    rng = np.random.default_rng(seed)
    grid = ref.E2M1.astype(F32)
    x = np.concatenate([
        _neighbours(np.array(E2M1_TIES, dtype=F32)), _neighbours(grid), rng.uniform(-7, 7, 4096),
        [0.0, -0.0, 6.0, 6.5, 1e30, -1e30, np.inf, -np.inf, 1e-45, -1e-45],
    ]).astype(F32)
    got = _np(e2m1_encode(_t(x, device)))
    np.testing.assert_array_equal(got, ref.e2m1_encode(x))
    np.testing.assert_array_equal(_bits(_np(e2m1_decode(_t(got, device).to(torch.uint8)))),
                                  _bits(ref.e2m1_decode(got)))


def test_e2m1_nan_encodes_as_zero():
    nan = torch.tensor([float("nan")])
    assert e2m1_encode(nan).item() & 7 == 0
    assert e2m1_encode(torch.copysign(nan, torch.tensor([1.0]))).item() == 0


def test_e2m1_decode_all_codes(ref):
    c = torch.arange(16, dtype=torch.uint8)
    np.testing.assert_array_equal(_bits(e2m1_decode(c).numpy()), _bits(ref.e2m1_decode(np.arange(16))))
    assert e2m1_decode(c).tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(e2m1_decode(torch.tensor([8], dtype=torch.uint8))).item()


# ------------------------------------------------------------------------------------- packing


@pytest.mark.parametrize("device", DEVICES)
def test_pack_unpack_all_bytes(ref, device):
    p = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    codes = unpack_fp4(p)
    assert codes.shape == (512,) and codes.dtype == torch.uint8
    np.testing.assert_array_equal(_np(codes), ref.unpack(np.arange(256, dtype=np.uint8)))
    assert torch.equal(pack_fp4(codes), p)
    # low nibble = even element
    assert pack_fp4(torch.tensor([0x3, 0xA], dtype=torch.uint8, device=device)).item() == 0xA3


def test_pack_shapes_and_errors(seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 16, (2, 3, 8), generator=g).to(torch.uint8)
    p = pack_fp4(c)
    assert p.shape == (2, 3, 4) and torch.equal(unpack_fp4(p), c)
    assert pack_fp4(torch.zeros(0, 6, dtype=torch.uint8)).shape == (0, 3)
    assert unpack_fp4(torch.zeros(4, 0, dtype=torch.uint8)).shape == (4, 0)
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_fp4(torch.zeros(4, dtype=torch.int64))
