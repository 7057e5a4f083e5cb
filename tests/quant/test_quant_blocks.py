"""Block quantisers (FP8 act/weight, MXFP4, NVFP4-style) against the numpy oracle, bit for bit.

Random inputs span ~2^-140..2^120 per block (fp32 and bf16, subnormals included); edge cases cover
the amax floors, all-zero blocks, e2m1/e4m3 ties inside real blocks, saturation at the format
maxima, the IEEE division by a non-power-of-two e4m3 scale, NaN/inf, empty and batched shapes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.quant import (
    dequant_fp8_act,
    dequant_fp8_weight,
    dequant_mxfp4,
    dequant_nvfp4,
    qdq_fp8_act,
    qdq_mxfp4,
    qdq_nvfp4,
    quant_fp8_act,
    quant_fp8_weight,
    quant_mxfp4,
    quant_nvfp4,
    unpack_fp4,
)

F32 = np.float32
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
]
DTYPES = [torch.float32, torch.bfloat16]


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t.cpu().numpy()


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=F32).view(np.uint32)


def _assert_f32_identical(got: torch.Tensor, want: np.ndarray) -> None:
    g = _np(got.float())
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(g), nan)
    np.testing.assert_array_equal(_bits(np.where(nan, 0, g)), _bits(np.where(nan, 0, want)))


def _input(ref, seed, shape, dtype, device, block):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(ref.random_values(rng, shape, block=block)).to(dtype).to(device)
    return x, _np(x.float())


# ------------------------------------------------------------------------------------ random


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [32, 128])
def test_fp8_act_random(ref, seed, device, dtype, block):
    x, xf = _input(ref, seed, (3, 5, 256), dtype, device, block)
    codes, scales = quant_fp8_act(x, block)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scales.dtype == torch.uint8 and scales.shape == (3, 5, 256 // block)
    rc, rs, rd = ref.fp8_act(xf, block)
    np.testing.assert_array_equal(_np(scales), rs)
    np.testing.assert_array_equal(_np(codes), rc)
    _assert_f32_identical(dequant_fp8_act(codes, scales, block), rd)
    y = qdq_fp8_act(x, block)
    assert y.dtype == dtype and y.device == x.device
    _assert_f32_identical(y, rd)  # exact in bf16 too


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_random(ref, seed, device, dtype):
    x, xf = _input(ref, seed, (4, 3, 128), dtype, device, 32)
    packed, scales = quant_mxfp4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 3, 64)
    assert scales.dtype == torch.uint8 and scales.shape == (4, 3, 4)
    rp, rs, rd = ref.mxfp4(xf)
    np.testing.assert_array_equal(_np(scales), rs)
    np.testing.assert_array_equal(_np(packed), rp)
    _assert_f32_identical(dequant_mxfp4(packed, scales), rd)
    y = qdq_mxfp4(x)
    assert y.dtype == dtype
    _assert_f32_identical(y, rd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_random(ref, seed, device, dtype):
    x, xf = _input(ref, seed, (6, 2, 64), dtype, device, 16)
    # also a band of blocks whose amax / 6 lands in e4m3's normal range with many mantissas
    rng = np.random.default_rng(seed + 7)
    band = torch.from_numpy(rng.uniform(-300, 300, (64, 64)).astype(F32)).to(dtype).to(device)
    for xx, xxf in ((x, xf), (band, _np(band.float()))):
        packed, scales = quant_nvfp4(xx)
        assert packed.dtype == torch.uint8 and packed.shape == (*xx.shape[:-1], 32)
        assert scales.dtype == torch.float8_e4m3fn and scales.shape == (*xx.shape[:-1], 4)
        rp, rs, rd = ref.nvfp4(xxf)
        np.testing.assert_array_equal(_np(scales), rs)
        np.testing.assert_array_equal(_np(packed), rp)
        _assert_f32_identical(dequant_nvfp4(packed, scales), rd)
        _assert_f32_identical(dequant_nvfp4(packed, scales.view(torch.uint8)), rd)
        y = qdq_nvfp4(xx)
        assert y.dtype == dtype
        _assert_f32_identical(y, rd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(64, 96), (70, 100), (2, 33, 31), (1, 1)])
def test_fp8_weight_random(ref, seed, device, shape):
    x, xf = _input(ref, seed, shape, torch.bfloat16, device, 32)
    codes, scales = quant_fp8_weight(x)
    nb, kb = -(-shape[-2] // 32), -(-shape[-1] // 32)
    assert codes.shape == x.shape and scales.shape == (*shape[:-2], nb, kb)
    rc, rs, rd = ref.fp8_weight(xf)
    np.testing.assert_array_equal(_np(scales), rs)
    np.testing.assert_array_equal(_np(codes), rc)
    _assert_f32_identical(dequant_fp8_weight(codes, scales), rd)
    assert dequant_fp8_weight(codes, scales, dtype=torch.bfloat16).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------ edges


def test_floors_and_zero_blocks(ref):
    tiny = [0.0] * 31 + [1e-6]
    x = torch.tensor([[0.0] * 32 + tiny, [-0.0] * 32 + [-1e-40] * 32])  # 1e-40: fp32 subnormal
    codes, scales = quant_fp8_act(x)
    # 1e-4 floor: 2^ceil(log2(fp32(1e-4) * fp32(1/448))) = 2^-22 -> byte 105
    assert scales.tolist() == [[105, 105], [105, 105]]
    assert _np(codes)[1, :32].tolist() == [0x80] * 32  # -0.0 keeps its sign
    np.testing.assert_array_equal(_np(codes), ref.fp8_act(_np(x))[0])

    p, s = quant_mxfp4(x)
    rp, rs, _ = ref.mxfp4(_np(x))
    assert s[1].tolist() == [1, 1] and s[0, 0] == 1  # floor 6 * 2^-126 -> 2^-126
    np.testing.assert_array_equal(_np(s), rs)
    np.testing.assert_array_equal(_np(p), rp)

    p, s = quant_nvfp4(x)
    assert _np(s).tolist() == [[1, 1, 1, 1]] * 2  # floor 6 * 2^-9 -> e4m3 2^-9 (byte 0x01)
    np.testing.assert_array_equal(_np(p), ref.nvfp4(_np(x))[0])
    assert (qdq_nvfp4(x)[0, :32] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_format_maxima(ref, device):
    big = [448.0, -448.0, 449.0, 3.3895314e38, -3.4028235e38, 1e38, 65504.0, 1.0]
    row = np.array(big * 4, dtype=F32)
    x = torch.from_numpy(np.stack([row, row * F32(2.0**-100)])).to(device)
    for fn, oracle in ((quant_fp8_act, ref.fp8_act), (quant_mxfp4, ref.mxfp4),
                       (quant_nvfp4, ref.nvfp4)):
        q, s = fn(x)
        rq, rs, _ = oracle(_np(x))
        np.testing.assert_array_equal(_np(s), rs)
        np.testing.assert_array_equal(_np(q), rq)
    # a block whose amax is exactly 448 * 2^k has scale 2^k and keeps 448 as code 0x7E
    c, s = quant_fp8_act(torch.tensor([[448.0, -448.0] + [1.0] * 30]).to(device))
    assert s.item() == 127 and _np(c)[0, :2].tolist() == [0x7E, 0xFE]


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_ties_inside_fp8_block(ref, device):
    pos = ref.E4M3_POS
    mids = ((pos[:-1] + pos[1:]) / 2).astype(F32)  # all 126 ties; the block max fixes s = 1
    vals = np.concatenate([mids, -mids])
    vals = np.concatenate([vals, np.zeros(-vals.size % 31, F32)]).reshape(-1, 31)
    x = np.concatenate([np.full((vals.shape[0], 1), 448, F32), vals], axis=1)
    x = torch.from_numpy(x).to(device)
    codes, scales = quant_fp8_act(x)
    assert (scales == 127).all()
    np.testing.assert_array_equal(_np(codes), ref.fp8_act(_np(x))[0])
    np.testing.assert_array_equal(_np(codes)[:, 1:], ref.e4m3_encode(vals))


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_ties_inside_blocks(ref, device):
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=F32)
    want = [0, 2, 2, 4, 4, 6, 6]  # ties to the even code
    row = np.concatenate([[6.0], ties, -ties, np.zeros(1)]).astype(F32)  # 16 values
    # MXFP4: amax 6 * 2^k gives scale exactly 2^k
    x = np.stack([np.tile(row, 2) * F32(2.0**k) for k in (-100, -3, 0, 5, 90)])
    p, s = quant_mxfp4(torch.from_numpy(x).to(device))
    assert [b for b in _np(s)[:, 0]] == [27, 124, 127, 132, 217]
    codes = _np(unpack_fp4(p))[:, :16]
    assert (codes[:, 1:8] == want).all() and (codes[:, 8:15] == np.array(want) | 8).all()
    np.testing.assert_array_equal(_np(p), ref.mxfp4(x)[0])
    # NVFP4-style: amax 6 * s for a non-power-of-two e4m3 s gives x / s exactly at the ties
    for sv in (0.8125, 2.0**-9 * 3, 13.0, 448.0):
        xs = (row * F32(sv)).astype(F32)
        p, s = quant_nvfp4(torch.from_numpy(xs[None]).to(device))
        assert s.float().item() == sv
        codes = _np(unpack_fp4(p))[0]
        assert (codes[1:8] == want).all() and (codes[8:15] == np.array(want) | 8).all()


def _find_div_vs_recip(ref):
    """fp32 (x, s) pairs, s a non-power-of-two e4m3 value, where e2m1(x / s) != e2m1(x * 1/s)."""
    pos = ref.E4M3_POS[9:127].astype(F32)  # normal e4m3 values 2^-6 .. 448
    s = pos[(pos.view(np.uint32) & 0x7FFFFF) != 0]  # not powers of two
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=F32)
    t = (ties[None, :] * s[:, None]).astype(F32)
    x = np.concatenate([np.nextafter(t, F32(np.inf)), np.nextafter(t, F32(0)), t], axis=1)
    ss = np.concatenate([np.broadcast_to(s[:, None], t.shape)] * 3, axis=1)
    div = ref.e2m1_encode(x / ss)
    rec = ref.e2m1_encode(x * (F32(1) / ss))
    k = np.nonzero(div != rec)
    return x[k], ss[k], div[k], rec[k]


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_divides_by_the_scale(ref, device):
    """x / s is an IEEE division; multiplying by fp32(1/s) would change codes at boundaries."""
    x, s, div, rec = _find_div_vs_recip(ref)
    assert x.size >= 10, "no discriminating values found; the test would be vacuous"
    blocks = np.zeros((x.size, 16), F32)
    blocks[:, 0] = 6 * s  # exact: pins amax / 6 = s
    blocks[:, 1] = x
    p, sc = quant_nvfp4(torch.from_numpy(blocks).to(device))
    np.testing.assert_array_equal(_np(sc.float())[:, 0], s)
    codes = _np(unpack_fp4(p))[:, 1]
    np.testing.assert_array_equal(codes, div)
    assert (codes != rec).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_scale_is_division_then_e4m3_rne(ref, device):
    """s = e4m3_RNE(fp32(amax / 6)): at amax = 6 * (an e4m3 midpoint) the tie goes to the even
    code; in the few ulps around it a multiply by fp32(1/6) would pick other scales."""
    pos = ref.E4M3_POS[1:127]
    mids = ((pos[:-1] + pos[1:]) / 2).astype(F32)
    centre = (mids * F32(6)).astype(F32)
    assert np.array_equal(centre.astype(np.float64), mids.astype(np.float64) * 6)  # exact
    amax = (centre.view(np.uint32)[:, None] + np.arange(-40, 41, dtype=np.int64)[None, :])
    amax = amax.astype(np.uint32).view(F32).reshape(-1)
    amax = amax[amax > 6 * 2.0**-9]
    blocks = np.zeros((amax.size, 16), F32)
    blocks[:, 3] = -amax
    _, sc = quant_nvfp4(torch.from_numpy(blocks).to(device))
    want = ref.e4m3_encode(amax / F32(6))
    np.testing.assert_array_equal(_np(sc)[:, 0], want)
    at_tie = np.isin(amax, centre)
    assert (want[at_tie] % 2 == 0).all()  # every exact tie went to the even code
    recip = ref.e4m3_encode(amax * F32(1.0 / 6.0))
    assert (recip != want).any()  # a multiply by fp32(1/6) would have differed


# ------------------------------------------------------------------------------- NaN and inf


@pytest.mark.parametrize("device", DEVICES)
def test_nan_poisons_only_its_block(device):
    x = torch.full((2, 64), 3.0, device=device)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    c, s = quant_fp8_act(x)
    assert s.tolist() == [[255, 120], [120, 255]]  # NaN and inf blocks get the NaN scale byte
    y = dequant_fp8_act(c, s)
    assert torch.isnan(y[0, :32]).all() and torch.isnan(y[1, 32:]).all()
    assert (y[0, 32:] == 3).all() and (y[1, :32] == 3).all()
    assert torch.isnan(qdq_fp8_act(x.bfloat16())[0, :32]).all()

    p, s = quant_mxfp4(x)
    assert s.tolist() == [[255, 126], [126, 255]]
    y = dequant_mxfp4(p, s)
    assert torch.isnan(y[0, :32]).all() and torch.isnan(y[1, 32:]).all()
    assert (y[0, 32:] == 3).all() and (y[1, :32] == 3).all()

    p, s = quant_nvfp4(x)
    assert torch.isnan(s[0, 0].float()) and not torch.isnan(s.float()).flatten()[1:].any()
    y = dequant_nvfp4(p, s)
    assert torch.isnan(y[0, :16]).all() and (y[0, 16:] == 3).all()
    # NVFP4-style inf follows the reference's saturating cast: scale 448, inf -> 6 * 448
    assert s[1, 2].float().item() == 448.0
    assert y[1, 40].item() == 6 * 448.0 and y[1, 32].item() == 0.0 and (y[1, :32] == 3).all()


def test_overflow_near_fp32_max_dequantises_to_inf():
    """Documented: the bf16 maximum = 255 * 2^120 rounds to code 256 (fp8) / 4 (mxfp4) times
    2^120 / 2^126, i.e. 2^128 = inf; the NVFP4-style scale saturates at 448 instead."""
    x = torch.tensor([[3.3895314e38] + [0.0] * 31, [2.5e38] + [0.0] * 31]).bfloat16()
    assert torch.isinf(qdq_fp8_act(x)[0, 0]) and torch.isinf(qdq_mxfp4(x)[0, 0])
    assert torch.isfinite(qdq_fp8_act(x)[1]).all() and torch.isfinite(qdq_mxfp4(x)[1]).all()
    assert (qdq_nvfp4(x[:, :16])[:, 0] == 6 * 448.0).all()


def test_nan_ue8m0_byte_in_input_scales():
    codes = torch.ones(1, 64).to(torch.float8_e4m3fn)
    y = dequant_fp8_act(codes, torch.tensor([[255, 127]], dtype=torch.uint8))
    assert torch.isnan(y[0, :32]).all() and (y[0, 32:] == 1).all()


# ---------------------------------------------------------------------------- shapes, errors


@pytest.mark.parametrize("shape", [(0, 64), (2, 0), (0,), (3, 0, 32), (1, 2, 3, 64)])
def test_empty_and_batched_shapes(ref, seed, shape):
    x, xf = _input(ref, seed, shape, torch.float32, "cpu", 16)
    k = shape[-1]
    c, s = quant_fp8_act(x)
    assert c.shape == shape and s.shape == (*shape[:-1], k // 32)
    assert dequant_fp8_act(c, s).shape == shape and qdq_fp8_act(x).shape == shape
    p, s = quant_mxfp4(x)
    assert p.shape == (*shape[:-1], k // 2) and s.shape == (*shape[:-1], k // 32)
    assert qdq_mxfp4(x).shape == shape
    p, s = quant_nvfp4(x)
    assert p.shape == (*shape[:-1], k // 2) and s.shape == (*shape[:-1], k // 16)
    assert qdq_nvfp4(x).shape == shape
    if x.numel():
        np.testing.assert_array_equal(_np(qdq_fp8_act(x)), ref.fp8_act(xf)[2])
    w = torch.zeros(0, 40)
    c, s = quant_fp8_weight(w)
    assert c.shape == (0, 40) and s.shape == (0, 2) and dequant_fp8_weight(c, s).shape == (0, 40)


def test_inputs_not_modified(seed):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    before = x.clone()
    for fn in (quant_fp8_act, quant_mxfp4, quant_nvfp4, qdq_fp8_act, qdq_mxfp4, qdq_nvfp4,
               quant_fp8_weight):
        fn(x)
        assert torch.equal(x, before)


def test_errors():
    with pytest.raises(ValueError, match="multiple of block"):
        quant_fp8_act(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="block"):
        quant_mxfp4(torch.zeros(2, 32), block=0)
    with pytest.raises(ValueError, match="floating-point"):
        quant_nvfp4(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="scales.shape"):
        dequant_fp8_act(torch.zeros(2, 64).to(torch.float8_e4m3fn), torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales.dtype"):
        dequant_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="at least 2"):
        quant_fp8_weight(torch.zeros(32))
