"""Independent checks of the dense reference ops: mHC, RMSNorm, RoPE, GEMMs and activation
quantisation (model.md §2.1-§2.4, §2.12, §5.2). The router, clamped SwiGLU, MXFP4 experts and
the output heads: `test_reference_moe_head_ops.py`.

Every test compares the op (called directly from its module with keyword arguments) against a
naive computation written here with explicit loops or elementwise float64 formulas.

Seeds: fresh each session; the test id shows the seed. Set ``SHOAL_TEST_SEED=<n>`` to reproduce.
"""

from __future__ import annotations

import cmath
import math

import numpy as np
import pytest
import torch

from shoal.ops.reference import gemm, hyper_connections, norm, rope
from shoal.quant.fp8 import quant_fp8_act, quant_fp8_weight
from support.bf16 import assert_bf16_close
from support.bf16 import bf16_round as _bf16
from support.bf16 import bf16_ulp as _ulp
from support.rand import f64 as _f64
from support.rand import gen as _gen
from support.rand import randn as _randn


def _sigmoid(v: float) -> float:
    return 1 / (1 + math.exp(-v))


# ------------------------------------------------------------------------------------------ mHC


def _naive_hc(x, fn, scale, base, hc_eps, iters):
    f = x.reshape(-1)
    r = 1 / math.sqrt(float(np.mean(f * f)) + 1e-20)
    m = [float(np.dot(fn[k], f)) * r for k in range(24)]
    pre = [_sigmoid(m[i] * scale[0] + base[i]) + hc_eps for i in range(4)]
    post = [2 * _sigmoid(m[4 + i] * scale[1] + base[4 + i]) for i in range(4)]
    c = [[m[8 + 4 * i + j] * scale[2] + base[8 + 4 * i + j] for j in range(4)] for i in range(4)]
    for i in range(4):  # row softmax, + eps
        mx = max(c[i])
        e = [math.exp(v - mx) for v in c[i]]
        c[i] = [v / sum(e) + hc_eps for v in e]

    def cols():
        for j in range(4):
            s = sum(c[i][j] for i in range(4)) + hc_eps
            for i in range(4):
                c[i][j] /= s

    cols()
    for _ in range(iters - 1):
        for i in range(4):
            s = sum(c[i]) + hc_eps
            c[i] = [v / s for v in c[i]]
        cols()
    return pre, post, c


@pytest.mark.parametrize("t,d,iters", [(0, 13, 20), (1, 13, 1), (5, 13, 2), (3, 32, 20)])
def test_hc_coeffs_explicit_sinkhorn(seed: int, t: int, d: int, iters: int):
    g = _gen(seed, t * 10 + iters)
    stream = _randn(g, t, 4, d)
    fn = _randn(g, 24, 4 * d, scale=0.3, dtype=torch.float32)
    scale = _randn(g, 3, dtype=torch.float32).abs() + 0.5
    base = _randn(g, 24, dtype=torch.float32)
    pre, post, comb = hyper_connections.hc_coeffs(stream=stream, fn=fn, scale=scale, base=base,
                                                   norm_eps=1e-20, hc_eps=1e-6, iters=iters)
    assert pre.shape == (t, 4) and post.shape == (t, 4) and comb.shape == (t, 4, 4)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    for i in range(t):
        p, q, c = _naive_hc(_f64(stream[i]), _f64(fn), _f64(scale), _f64(base), 1e-6, iters)
        np.testing.assert_allclose(_f64(pre[i]), p, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(_f64(post[i]), q, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(_f64(comb[i]), np.array(c), atol=1e-5, rtol=1e-4)
        assert np.all(_f64(comb[i]).sum(0) <= 1 + 1e-6)  # column normalisation runs last


@pytest.mark.parametrize("t,iters", [(0, 20), (1, 20), (1, 1), (1, 0), (7, 3), (83, 20),
                                     (1000, 20)])
def test_hc_sinkhorn_on_the_cpu_has_the_torch_expressions_bits(seed: int, t: int, iters: int):
    """The numpy normalisations hc_coeffs runs on the CPU give the bits of the torch ones, on
    softmax rows from narrow to near one-hot (tiny entries, subnormal ones) and with NaN / inf."""
    g = _gen(seed, t * 10 + iters)
    logits = torch.randn(t, 4, 4, generator=g) * torch.tensor([0.1, 3.0, 30.0, 120.0])[
        torch.randint(0, 4, (t, 1, 1), generator=g)]
    comb = torch.exp((logits - logits.amax(-1, keepdim=True)).double()).float()
    if t > 3:
        comb[1, 2, 3], comb[2, 0, 0], comb[3, 1, 1] = float("nan"), float("inf"), 0.0
    for hc_eps in (1e-6, 0.0):
        want = hyper_connections._sinkhorn(comb, hc_eps, iters)
        got = hyper_connections._sinkhorn_cpu(comb, hc_eps, iters)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_hc_collapse_norm_post_mean(seed: int):
    g = _gen(seed, 1)
    t, d = 7, 13
    stream = _randn(g, t, 4, d)
    pre = torch.rand(t, 4, generator=g)
    w = _randn(g, d, scale=0.2) + 1
    y = _randn(g, t, d)
    post = torch.rand(t, 4, generator=g) * 2
    comb = torch.rand(t, 4, 4, generator=g)
    x, p, c, wv = _f64(stream), _f64(pre), _f64(comb), _f64(w)
    col = np.zeros((t, d))
    for i in range(t):
        for s in range(4):
            col[i] += p[i, s] * x[i, s]
    out = hyper_connections.hc_collapse(stream=stream, pre=pre)
    assert_bf16_close(out, col)
    coln = _bf16(col)  # the collapse is rounded to bf16 before the norm
    normed = np.stack([wv * r / math.sqrt(np.mean(r * r) + 1e-20) for r in coln])
    out = hyper_connections.hc_collapse_norm(stream=stream, pre=pre, weight=w, eps=1e-20)
    assert_bf16_close(out, normed, ulps=2)
    ref = np.zeros((t, 4, d))
    for i in range(t):
        for j in range(4):
            ref[i, j] = _f64(post)[i, j] * _f64(y)[i]
            for s in range(4):
                ref[i, j] += c[i, s, j] * x[i, s]  # sum over the FIRST index of comb
    assert_bf16_close(hyper_connections.hc_post(y=y, stream=stream, post=post, comb=comb), ref)
    assert_bf16_close(hyper_connections.stream_mean(stream=stream), x.mean(axis=1))
    for op, kw in ((hyper_connections.hc_collapse, {"pre": pre[:0]}),
                   (hyper_connections.stream_mean, {})):
        assert op(stream=stream[:0], **kw).shape == (0, d)


def test_hc_post_reads_first_index_of_comb(seed: int):
    g = _gen(seed, 2)
    stream = _randn(g, 1, 4, 9)
    comb = torch.zeros(1, 4, 4)
    comb[0, 0, 1] = 1.0  # C[0][1]: stream 0 feeds output stream 1
    out = hyper_connections.hc_post(y=_randn(g, 1, 9), stream=stream, post=torch.zeros(1, 4),
                                    comb=comb)
    assert torch.equal(out[0, 1], stream[0, 0])
    assert torch.equal(out[0, 0], torch.zeros(9, dtype=torch.bfloat16))


def test_embed_rows(seed: int):
    g = _gen(seed, 3)
    table = _randn(g, 31, 12)
    ids = torch.randint(0, 31, (9,), generator=g, dtype=torch.int32)
    out = hyper_connections.embed(ids=ids, table=table)
    for i in range(9):
        assert torch.equal(out[i], table[int(ids[i])])
    assert hyper_connections.embed(ids=ids[:0], table=table).shape == (0, 12)


# -------------------------------------------------------------------------------------- rmsnorm


@pytest.mark.parametrize("t", [0, 1, 7])
def test_rmsnorm_explicit(seed: int, t: int):
    g = _gen(seed, t)
    d = 13
    row_scale = torch.tensor([1e-12, 1.0, 300.0, 1.0, 0.0, 5.0, 1.0])[:t].unsqueeze(1)
    x = (torch.randn(t, d, generator=g) * row_scale).to(torch.bfloat16)
    w = _randn(g, d, scale=0.2) + 1
    out = norm.rmsnorm(x=x, weight=w, eps=1e-20)
    assert out.shape == (t, d) and out.dtype == torch.bfloat16
    xs, ws = _f64(x), _f64(w)
    ref = np.stack([ws * r / math.sqrt(float(np.mean(r * r)) + 1e-20) for r in xs]) if t else \
        np.zeros((0, d))
    assert_bf16_close(out, ref, ulps=0.501, atol=0)
    if t > 4:
        assert torch.equal(out[4], torch.zeros(d, dtype=torch.bfloat16))  # zero row stays zero


def test_rmsnorm_weight_multiplies_before_the_cast(seed: int):
    g = _gen(seed, 9)
    x = _randn(g, 64, 64)
    w = _randn(g, 64, scale=0.3) + 1
    xs, ws = _f64(x), _f64(w)
    xn = np.stack([r / math.sqrt(float(np.mean(r * r)) + 1e-20) for r in xs])
    truth = ws * xn
    out = norm.rmsnorm(x=x, weight=w, eps=1e-20)
    assert_bf16_close(out, truth, ulps=0.501, atol=0)  # one rounding: weight before the cast
    after = _bf16(_bf16(xn) * ws)  # weight after the cast: double rounding
    assert np.any(np.abs(after - truth) > 0.501 * _ulp(truth))


# ----------------------------------------------------------------------------------------- rope


def _naive_freqs(rd: int, theta: float, yarn: bool) -> np.ndarray:
    f = np.array([theta ** (-2 * i / rd) for i in range(rd // 2)])
    if not yarn:
        return f
    low, high = {64: (15, 25), 16: (3, 7)}[rd]  # model.md §2.4 / tiny config
    ramp = np.clip((np.arange(rd // 2) - low) / (high - low), 0, 1)
    return f / 16 * ramp + f * (1 - ramp)


@pytest.mark.parametrize("rd,yarn", [(64, True), (16, True), (16, False), (64, False)])
def test_rope_frequencies_yarn_band(rd: int, yarn: bool):
    params = (rope.RopeParams(rd, 160000.0, 16.0, 65536) if yarn
              else rope.RopeParams(rd, 10000.0))
    freqs = rope.rope_frequencies(params)
    assert freqs.dtype == torch.float32
    np.testing.assert_allclose(_f64(freqs), _naive_freqs(rd, params.theta, yarn), rtol=2e-6)


@pytest.mark.parametrize("shape,rd,yarn,big", [((7, 40), 16, True, False),
                                               ((5, 3, 80), 64, True, True),
                                               ((4, 2, 24), 16, False, True),
                                               ((0, 2, 24), 16, True, True)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_complex_rotation(seed: int, shape, rd: int, yarn: bool, big: bool,
                                    inverse: bool):
    g = _gen(seed, rd + len(shape))
    params = (rope.RopeParams(rd, 160000.0, 16.0, 65536) if yarn
              else rope.RopeParams(rd, 10000.0))
    x = _randn(g, *shape)
    pos = torch.randint(0, (1 << 20) if big else 300, (shape[0],), generator=g)
    out = rope.rope_tail(x=x, positions=pos, params=params, inverse=inverse)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert torch.equal(out[..., :-rd], x[..., :-rd])
    # fp32 angles: fp32(p) * f rounded in fp32 (large p: the fp32 rounding matters)
    f32 = rope.rope_frequencies(params).numpy() if big else \
        _naive_freqs(rd, params.theta, yarn).astype(np.float32)
    xs = _f64(x).reshape(shape[0], math.prod(shape[1:-1]), shape[-1])
    ref = np.array(xs)
    for t in range(shape[0]):
        for h in range(xs.shape[1]):
            for i in range(rd // 2):
                ang = float(np.float32(np.float32(int(pos[t])) * f32[i]))
                c = shape[-1] - rd + 2 * i
                z = complex(xs[t, h, c], xs[t, h, c + 1]) * cmath.exp((-1j if inverse else 1j)
                                                                       * ang)
                ref[t, h, c], ref[t, h, c + 1] = z.real, z.imag
    assert_bf16_close(out, ref.reshape(shape), atol=2e-6)


def test_rope_inverse_undoes_forward(seed: int):
    g = _gen(seed, 5)
    params = rope.RopeParams(64, 160000.0, 16.0, 65536)
    x = _randn(g, 9, 4, 128)
    pos = torch.randint(0, 1 << 20, (9,), generator=g)
    y = rope.rope_tail(x=x, positions=pos, params=params)
    z = rope.rope_tail(x=y, positions=pos, params=params, inverse=True)
    np.testing.assert_allclose(_f64(z), _f64(x), atol=2e-2, rtol=2e-2)
    assert not torch.equal(y, x)


# ------------------------------------------------------------------------------ GEMMs and quant


def _naive_e4m3_codes(v: np.ndarray) -> np.ndarray:
    """float64 -> e4m3 bytes: nearest of the 127 non-negative codes, ties to the even code."""
    grid = _f64(torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn))
    a = np.minimum(np.abs(v), 448.0)
    d = np.abs(a[..., None] - grid)
    best = d.min(-1, keepdims=True)
    cand = d == best
    even = cand & (np.arange(127) % 2 == 0)
    code = np.where(even.any(-1), even.argmax(-1), cand.argmax(-1)).astype(np.uint8)
    return code | (np.signbit(v).astype(np.uint8) << 7)


@pytest.mark.parametrize("t", [0, 1, 7])
def test_act_quant_fp8_round_trip(seed: int, t: int):
    g = _gen(seed, t)
    x = _randn(g, t, 96, scale=3.0)
    if t:
        x[0, :32] = 0  # amax floor 1e-4
        x[-1, 32:64] *= 1e4
    codes, scales = gemm.act_quant_fp8(x=x, block=32)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    assert codes.shape == (t, 96) and scales.shape == (t, 3)
    xs = _f64(x)
    for i in range(t):
        for b in range(3):
            blk = xs[i, 32 * b:32 * b + 32]
            p = float(np.float32(max(np.abs(blk).max(), 1e-4)) * np.float32(1 / 448))
            mant, e = math.frexp(p)
            s_exp = e - 1 if mant == 0.5 else e
            assert int(scales[i, b]) == s_exp + 127
            want = _naive_e4m3_codes(blk / 2.0**s_exp)
            np.testing.assert_array_equal(codes[i, 32 * b:32 * b + 32].view(torch.uint8).numpy(),
                                          want)
            back = _f64(codes[i, 32 * b:32 * b + 32].float()) * 2.0**s_exp
            assert np.all(np.abs(back - blk) <= np.abs(blk) * 2**-4 + 2.0**(s_exp - 10))


def _naive_fp8_weight(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    w = _f64(codes.float())
    for nb in range(scales.shape[0]):
        for kb in range(scales.shape[1]):
            w[32 * nb:32 * nb + 32, 32 * kb:32 * kb + 32] *= 2.0 ** (int(scales[nb, kb]) - 127)
    return w


@pytest.mark.parametrize("t", [0, 1, 5])
def test_gemm_fp8_blockwise(seed: int, t: int):
    g = _gen(seed, t)
    n, k = 37, 96
    wc, ws = quant_fp8_weight(torch.randn(n, k, generator=g) / k**0.5, 32)
    x = _randn(g, t, k)
    out = gemm.gemm_fp8(x=x, weight=wc, weight_scale=ws, block=32)
    assert out.shape == (t, n) and out.dtype == torch.bfloat16
    ac, asc = quant_fp8_act(x, 32)
    a, wq = _f64(ac.float()), _f64(wc.float())
    ref = np.zeros((t, n))
    for i in range(t):
        for j in range(n):
            acc = np.float32(0)
            for kb in range(k // 32):
                sl = slice(32 * kb, 32 * kb + 32)
                part = np.float32(np.dot(a[i, sl], wq[j, sl]))  # exact block dot
                s = 2.0 ** (int(asc[i, kb]) + int(ws[j // 32, kb]) - 254)
                acc = np.float32(acc + np.float32(part * s))
            ref[i, j] = acc
    assert_bf16_close(out, ref, atol=1e-5)


@pytest.mark.parametrize("t", [0, 3])
def test_gemm_grouped_w8a16_block_diagonal(seed: int, t: int):
    g = _gen(seed, t)
    groups, rank, kg = 2, 37, 64
    wc, ws = quant_fp8_weight(torch.randn(groups * rank, kg, generator=g) / kg**0.5, 32)
    o = _randn(g, t, groups, kg)
    out = gemm.gemm_grouped_w8a16(o=o, weight=wc, weight_scale=ws, block=32)
    assert out.shape == (t, groups * rank) and out.dtype == torch.bfloat16
    w, on = _naive_fp8_weight(wc, ws), _f64(o)
    ref = np.zeros((t, groups * rank))
    for i in range(t):
        for gg in range(groups):
            for r in range(rank):
                ref[i, gg * rank + r] = sum(on[i, gg, c] * w[gg * rank + r, c] for c in range(kg))
    assert_bf16_close(out, ref, atol=1e-5)
    if t:  # activations are not quantised: bf16 o goes in as is
        o0 = o.clone()
        o0[:, 0] = 0
        z = gemm.gemm_grouped_w8a16(o=o0, weight=wc, weight_scale=ws, block=32)
        assert torch.equal(z[:, :rank], torch.zeros(t, rank, dtype=torch.bfloat16))
        assert torch.equal(z[:, rank:], out[:, rank:])


@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.float32)])
def test_gemm_bf16(seed: int, x_dtype, out_dtype):
    g = _gen(seed)
    x = _randn(g, 7, 45, dtype=x_dtype)
    w = _randn(g, 13, 45, scale=45**-0.5)
    out = gemm.gemm_bf16(x=x, weight=w, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (7, 13)
    xs, ws = _f64(x), _f64(w)
    ref = np.array([[sum(xs[i, c] * ws[j, c] for c in range(45)) for j in range(13)]
                    for i in range(7)])
    if out_dtype == torch.bfloat16:
        assert_bf16_close(out, ref)
    else:
        np.testing.assert_allclose(_f64(out), ref, atol=1e-5, rtol=1e-5)
    assert gemm.gemm_bf16(x=x[:0], weight=w, out_dtype=out_dtype).shape == (0, 13)
