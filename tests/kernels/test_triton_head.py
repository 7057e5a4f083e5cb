"""Triton decode hot-path kernels against the reference: the split-K mHC coefficients
(`hc_coeffs`), the bf16-weight GEMM (`gemm_bf16`) and the heads built on it (`lm_head`,
`markov_bias`, `confidence`), `embed`, `stream_mean` and `swiglu_clamp`.

Checked: every case of the ops' conformance grids (contiguous and strided); batch invariance
bit for bit (a row alone equals the row in a batch; the parallel-chunk and the in-program chunk
paths of the GEMM agree; decode-sized and prefill-sized batches agree); the exact 3xBF16 split
of fp32 inputs (error at fp32 accumulation level, far below TF32's); bit-exactness of embed,
stream_mean and swiglu_clamp on hard values. On an H200 also the real Flash shapes.

Runs on CUDA (sm_90), or on the CPU under the Triton interpreter (TRITON_INTERPRET=1 set before
the run). Under the interpreter three of its defects are patched for this module only: fp32->bf16
casts truncate (the GPU rounds to nearest even), bf16 `tl.dot` multiplies the raw uint16 bits,
and a scalar's `__index__` fails with NumPy 2 (runtime `range` bounds).
"""

from __future__ import annotations

import zlib

import pytest
import torch

triton = pytest.importorskip("triton")

from support.triton_interpreter import (  # noqa: E402
    DEV,
    INTERP,
    ON_GPU,
    needs_kernels,
    patch_interpreter,
)

pytestmark = needs_kernels

from shoal.ops import reference  # noqa: E402, F401  (registers the definitions)
from shoal.ops.reference import hyper_connections as rhc  # noqa: E402
from shoal.ops.reference._math import matmul_nt  # noqa: E402
from shoal.ops.registry import REGISTRY  # noqa: E402
from shoal.ops.triton import gemm_nt as tgemm  # noqa: E402
from shoal.ops.triton import head as thead  # noqa: E402, F401
from shoal.ops.triton import hyper_connections as thc  # noqa: E402
from shoal.ops.triton import moe_swiglu as tswiglu  # noqa: E402

OPS = ("hc_coeffs", "gemm_bf16", "lm_head", "markov_bias", "confidence", "embed",
       "stream_mean", "swiglu_clamp")
BIT_EXACT = ("embed", "stream_mean", "swiglu_clamp")


@pytest.fixture(autouse=True)
def _interpreter_shims(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERP and not ON_GPU:
        patch_interpreter(monkeypatch)


# ----------------------------------------------------------------------------- helpers


def _to(kw: dict, device: torch.device) -> dict:
    return {k: v.detach().to(device).clone() if isinstance(v, torch.Tensor) else v
            for k, v in kw.items()}


def _strided(kw: dict) -> dict:
    """Float tensors of >= 2 dims -> same values in transposed storage (as in conformance)."""
    out = {}
    for k, v in kw.items():
        if (isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.dim() >= 2
                and v.shape[-1] > 1 and v.shape[-2] > 1 and v.numel()):
            v = v.transpose(-1, -2).contiguous().transpose(-1, -2)
        out[k] = v
    return out


def _tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
        return a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))
    return torch.equal(a, b)


def _assert_close(name: str, out: str, got: torch.Tensor, want: torch.Tensor,
                  exact: bool) -> None:
    got = got.detach().cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{name}/{out}: {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}")
    if exact or not want.dtype.is_floating_point:
        assert _bits_equal(got, want), f"{name}/{out}: not bit-identical"
        return
    tol = REGISTRY.ops[name].tolerances[want.dtype]
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan()), f"{name}/{out}: NaN positions differ"
    err = (g - w).abs()
    lim = tol.atol + tol.rtol * w.abs()
    assert (err <= lim).all(), f"{name}/{out}: worst excess {(err - lim).max():.3g}"


def _run_both(name: str, kw: dict, strided: bool = False, exact: bool | None = None) -> None:
    impl = REGISTRY.impl("triton", name)
    run_kw = _to(kw, DEV)
    if strided:
        run_kw = _strided(run_kw)
    assert impl.supports(**run_kw), f"{name}: triton declined the inputs"
    got = _tuple(impl.fn(**run_kw))
    want = _tuple(REGISTRY.ops[name].reference(**_to(kw, torch.device("cpu"))))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_close(name, f"out[{i}]", g, w, name in BIT_EXACT if exact is None else exact)


# ----------------------------------------------------------------------------- case grids


def _grid() -> list:
    params = []
    for name in OPS:
        for case in REGISTRY.ops[name].cases:
            if case.heavy and not ON_GPU:
                continue
            for strided in (False, True):
                params.append(pytest.param(name, case, strided,
                                           id=f"{name}-{case.name}{'-strided' * strided}"))
    return params


@pytest.mark.parametrize("name,case,strided", _grid())
def test_case_grid(name: str, case, strided: bool) -> None:
    seed = zlib.crc32(f"{name}/{case.name}".encode()) & 0x7FFFFFFF
    _run_both(name, case.make(torch.Generator().manual_seed(seed), torch.device("cpu")),
              strided)


def test_triton_implements_every_op() -> None:
    for name in OPS:
        assert REGISTRY.impl("triton", name) is not None, name


# ----------------------------------------------------------------------------- hc_coeffs


def _coeff_inputs(seed: int, t: int, d: int) -> dict:
    return rhc._coeff_case(t, d).make(torch.Generator().manual_seed(seed), DEV)


@pytest.mark.parametrize("d", [32, 96, 256])
def test_hc_coeffs_split_is_a_function_of_d(d: int) -> None:
    bk, iters, split = thc.coeff_split(d)
    assert d % bk == 0 and (split - 1) * iters * bk < 4 * d <= split * iters * bk


@pytest.mark.parametrize("t,d", [(13, 96), (7, 256)])
def test_hc_coeffs_batch_invariant(t: int, d: int) -> None:
    """Every row alone (T = 1, the decode shape) is bit-identical to the row in the batch, and
    to the row inside a larger batch with other tokens around it."""
    kw = _coeff_inputs(t * 7 + d, t, d)
    whole = thc.hc_coeffs(**kw)
    bigger = thc.hc_coeffs(**{**kw, "stream": torch.cat([kw["stream"].flip(0),
                                                         kw["stream"]])})
    for i in (0, 1, t // 2, t - 1):
        alone = thc.hc_coeffs(**{**kw, "stream": kw["stream"][i:i + 1]})
        for a, w, b in zip(alone, whole, bigger, strict=True):
            assert _bits_equal(a[0], w[i]) and _bits_equal(b[t + i], w[i]), f"row {i}"


def test_hc_coeffs_against_reference_wide_rows() -> None:
    """Rows of very different magnitudes (the rsqrt statistic) and a zero row."""
    kw = _coeff_inputs(3, 9, 128)
    s = kw["stream"].float() * torch.exp2(torch.arange(-8, 10, 2, device=DEV).float())[:, None,
                                                                                       None]
    s[4] = 0
    kw["stream"] = s.to(torch.bfloat16)
    _run_both("hc_coeffs", kw)


# ----------------------------------------------------------------------------- gemm


def _gemm_inputs(seed: int, m: int, n: int, k: int, x_dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(x_dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16).to(DEV)
    return x, w


@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.float32)])
def test_gemm_nt_batch_invariant(x_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """K split in chunks (split > 1): the parallel-chunk path (decode) and the in-program path
    (large M) give the same bits, and a row alone equals the row in a batch of 70 (> the
    parallel-chunk limit, so the two paths are crossed)."""
    m, n, k = 70, 40, 1100
    cfg = tgemm.nt_config(n, k)
    assert cfg.split > 1
    x, w = _gemm_inputs(5, m, n, k, x_dtype)
    whole = tgemm.gemm_nt(x, w, out_dtype)
    assert _bits_equal(whole, tgemm.gemm_nt(x, w, out_dtype, partial=True))
    for i in (0, 17, m - 1):
        assert _bits_equal(tgemm.gemm_nt(x[i:i + 1], w, out_dtype)[0], whole[i]), f"row {i}"
    assert _bits_equal(tgemm.gemm_nt(x[:5], w, out_dtype), whole[:5])
    want = matmul_nt(x.cpu().float(), w.cpu().float()).to(out_dtype)
    _assert_close("gemm_bf16", "out", whole, want, exact=False)


def test_gemm_fp32_input_split_is_exact() -> None:
    """fp32 x with 24 significant bits over a wide exponent range: the 3xBF16 split keeps every
    product exact, so the error is fp32 accumulation only (tensor cores: about one ulp of the
    accumulator per K/16 step, ~1e-6 of sum|x w| here); a TF32 or bf16 rounding of x would
    leave ~2^-11 or ~2^-9 of it."""
    g = torch.Generator().manual_seed(9)
    m, n, k = 5, 24, 512
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    x = (x * torch.exp2(torch.randint(-20, 20, (m, k), generator=g).double())).float()
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    got = tgemm.gemm_nt(x.to(DEV), w.to(DEV), torch.float32).cpu().double()
    exact = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    rel = ((got - exact).abs() / scale).max().item()
    assert rel < 3e-5, f"relative error {rel:.3g} (exact products give <~ 4e-6)"


def test_gemm_odd_shapes_and_strides() -> None:
    for m, n, k in ((1, 1, 5), (3, 130, 47), (17, 65, 513)):
        x, w = _gemm_inputs(m + n + k, m, n, k, torch.float32)
        for od in (torch.float32, torch.bfloat16):
            _run_both("gemm_bf16", {"x": x, "weight": w, "out_dtype": od})
            _run_both("gemm_bf16", {"x": x.t().contiguous().t(), "weight": w.t().contiguous().t(),
                                    "out_dtype": od})
    xb, w = _gemm_inputs(2, 4, 33, 200, torch.bfloat16)
    _run_both("lm_head", {"h": xb, "weight": w})


def test_markov_and_confidence_larger() -> None:
    g = torch.Generator().manual_seed(13)
    v, r = 700, 64
    kw = {"prev": torch.randint(0, v, (9,), generator=g).to(torch.int32),
          "embed": torch.randn(v, r, generator=g).to(torch.bfloat16),
          "head": (torch.randn(v, r, generator=g) * r**-0.5).to(torch.bfloat16)}
    _run_both("markov_bias", kw)
    kw = {"hidden": torch.randn(3, 4, 200, generator=g).to(torch.bfloat16),
          "markov_embed": torch.randn(3, 4, r, generator=g).to(torch.bfloat16),
          "proj": (torch.randn(1, 200 + r, generator=g) * 0.05).to(torch.bfloat16)}
    _run_both("confidence", kw)


# ----------------------------------------------------------------------------- bit-exact ops


def _hard_bf16(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Values over 2^-60..2^60, bf16 rounding ties, zeros, -0.0 and subnormals."""
    x = torch.randn(*shape, generator=g) * torch.exp2(
        torch.randint(-60, 60, shape, generator=g).float())
    x = x.flatten()
    x[::5] = (torch.randint(-64, 64, x[::5].shape, generator=g).float() / 16)
    x[::11] = 0.0
    x[::13] = -0.0
    x[::17] = 3e-39  # a bf16 subnormal
    return x.view(*shape).to(torch.bfloat16)


def test_embed_every_bit_pattern() -> None:
    table = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(512, 128)
    table = table.view(torch.bfloat16)
    g = torch.Generator().manual_seed(17)
    for ids in (torch.randint(0, 512, (40,), generator=g),
                torch.randint(0, 512, (3,), generator=g).to(torch.int32),
                torch.tensor([511, 0, -1, -512])):
        got = thc.embed(ids=ids.to(DEV), table=table.to(DEV))
        assert _bits_equal(got, rhc.embed(ids=ids, table=table))


def test_stream_mean_hard_values_bit_exact() -> None:
    g = torch.Generator().manual_seed(19)
    _run_both("stream_mean", {"stream": _hard_bf16(g, 33, 4, 160)})
    # four values whose fp32 mean sits on a bf16 rounding tie (double rounding in the reference)
    s = torch.tensor([1.0, 2**-8, 2**-30, 0.0]).repeat(5, 1)
    s[1] = torch.tensor([1.0, 2**-8, -(2**-30), 0.0])
    s[2] = torch.tensor([3.0, 3 * 2**-8, 0.0, 2**-60])
    _run_both("stream_mean", {"stream": s.to(torch.bfloat16).unsqueeze(-1).repeat(1, 1, 16)})


@pytest.mark.parametrize("with_weight", [True, False])
def test_swiglu_clamp_hard_values_bit_exact(with_weight: bool) -> None:
    g = torch.Generator().manual_seed(23)
    t, i = 21, 300
    gate = torch.randn(t, i, generator=g) * 12
    up = torch.randn(t, i, generator=g) * 12
    gate[:, :8] = torch.tensor([10.0, -10.0, 10.5, 0.0, -0.0, -90.0, 88.0, 1e-30])
    up[:, :8] = torch.tensor([10.0, -10.0, -10.5, 1.0, 2.0, 3.0, -1e-30, 7.0])
    w = torch.rand(t, generator=g) if with_weight else None
    _run_both("swiglu_clamp", {"gate": gate, "up": up, "weight": w, "limit": 10.0})
    _run_both("swiglu_clamp", {"gate": gate, "up": up, "weight": w, "limit": 7.0}, strided=True)
    assert tswiglu.swiglu_clamp is REGISTRY.impl("triton", "swiglu_clamp").fn


# ----------------------------------------------------------------------------- real shapes (GPU)


@pytest.mark.skipif(not ON_GPU, reason="real Flash shapes: H200 only")
def test_real_shapes_batch_invariant_on_gpu() -> None:
    """hc_coeffs D=5120 at T=1 vs 4096; lm_head [129280, 5120] at M=1 vs 256; the compressor
    gemm_bf16 (fp32, [512, 5120]) at M=1 vs 300: rows bit-identical, and against the reference."""
    kw = _coeff_inputs(29, 4096, 5120)
    whole = thc.hc_coeffs(**kw)
    for i in (0, 1, 2047, 4095):
        alone = thc.hc_coeffs(**{**kw, "stream": kw["stream"][i:i + 1]})
        assert all(_bits_equal(a[0], w[i]) for a, w in zip(alone, whole, strict=True)), i
    want = rhc.hc_coeffs(**{**kw, "stream": kw["stream"][:64]})
    for got, ref in zip(whole, want, strict=True):
        _assert_close("hc_coeffs", "out", got[:64], ref.cpu(), exact=False)
    for (n, k, xd, od, m) in ((129280, 5120, torch.bfloat16, torch.float32, 256),
                              (512, 5120, torch.float32, torch.float32, 300),
                              (32, 5120, torch.bfloat16, torch.bfloat16, 300),
                              (128, 512, torch.bfloat16, torch.bfloat16, 300)):
        x, w = _gemm_inputs(n + m, m, n, k, xd)
        whole = tgemm.gemm_nt(x, w, od)
        for i in (0, m // 2, m - 1):
            assert _bits_equal(tgemm.gemm_nt(x[i:i + 1], w, od)[0], whole[i]), (n, k, i)
        want = matmul_nt(x[:16].double(), w.double()).to(od)
        _assert_close("gemm_bf16", "out", whole[:16], want.cpu(), exact=False)
