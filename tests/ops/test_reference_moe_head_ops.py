"""Independent checks of the reference router, clamped SwiGLU, MXFP4 experts and output heads
(model.md §2.9, §2.11, §7).

Every test compares the op (called directly from its module with keyword arguments) against a
naive computation written here with explicit loops or elementwise float64 formulas.

Seeds: fresh each session; the test id shows the seed. Set ``SHOAL_TEST_SEED=<n>`` to reproduce.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shoal.ops.reference import head, moe
from shoal.quant.fp4 import quant_mxfp4
from shoal.quant.fp8 import quant_fp8_act
from support.bf16 import assert_bf16_close
from support.bf16 import bf16_round as _bf16
from support.rand import f64 as _f64
from support.rand import gen as _gen
from support.rand import randn as _randn

# --------------------------------------------------------------------------------------- router


def _naive_router(x, w, bias, k, route_scale, temp):
    ids_all, w_all = [], []
    for row in x:
        s = []
        for e in range(w.shape[0]):
            lg = sum(row[c] * w[e, c] for c in range(w.shape[1])) / temp
            sp = lg if lg > 20 else math.log1p(math.exp(lg))
            s.append(math.sqrt(sp))
        ids = sorted(range(len(s)), key=lambda e: (-(s[e] + bias[e]), e))[:k]
        ws = [s[e] for e in ids]
        tot = sum(ws) + 1e-20 if k > 1 else 1.0
        ids_all.append(ids)
        w_all.append([v / tot * route_scale for v in ws])
    return np.array(ids_all).reshape(-1, k), np.array(w_all).reshape(-1, k)


@pytest.mark.parametrize("t,k,temp", [(0, 3, 1.0), (1, 1, 1.0), (7, 3, 1.0), (5, 2, 2.0)])
def test_router_explicit(seed: int, t: int, k: int, temp: float):
    g = _gen(seed, t * 10 + k)
    e, d = 13, 40
    x = _randn(g, t, d)
    w = _randn(g, e, d, scale=3 * d**-0.5)
    bias = _randn(g, e, scale=0.3, dtype=torch.float32)
    ids, wts = moe.router(x=x, weight=w, bias=bias, k=k, route_scale=1.5, gate_temp=temp)
    ref_ids, ref_w = _naive_router(_f64(x), _f64(w), _f64(bias), k, 1.5, temp)
    assert ids.shape == (t, k) and wts.shape == (t, k) and wts.dtype == torch.float32
    np.testing.assert_array_equal(ids.numpy(), ref_ids)
    np.testing.assert_allclose(_f64(wts), ref_w, rtol=1e-5, atol=1e-6)


def test_router_ties_bias_and_literal_eps():
    d = 8
    x = torch.zeros(1, d, dtype=torch.bfloat16)
    x[0, 0] = 1
    w = torch.zeros(6, d, dtype=torch.bfloat16)
    w[:, 0] = torch.tensor([-86.0, -85.0, -86.0, -85.0, -200.0, -86.0])  # s ~ 1e-19, tied pairs
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0])  # expert 4: selected by bias alone
    ids, wts = moe.router(x=x, weight=w, bias=bias, k=3, route_scale=1.5)
    assert ids[0].tolist() == [4, 1, 3]  # biased order; the tie 1/3 goes to the lower id
    s = [math.sqrt(math.log1p(math.exp(v))) for v in (-200.0, -85.0, -85.0)]
    want = [v / (sum(s) + 1e-20) * 1.5 for v in s]  # literal 1e-20 matters at this scale
    np.testing.assert_allclose(_f64(wts[0]), want, rtol=1e-4, atol=1e-20)
    assert float(wts[0].sum()) < 1.5 * 0.99


# --------------------------------------------------------------------------------- swiglu / moe


def _naive_swiglu(g: float, u: float, w: float, limit: float) -> float:
    g = min(g, limit)
    u = max(-limit, min(u, limit))
    return g / (1 + math.exp(-g)) * u * w


@pytest.mark.parametrize("t,weighted", [(0, True), (1, False), (7, True)])
def test_swiglu_clamp_explicit(seed: int, t: int, weighted: bool):
    gg = _gen(seed, t)
    gate = torch.randn(t, 29, generator=gg) * 15
    up = torch.randn(t, 29, generator=gg) * 15
    if t:
        gate[0, :3] = torch.tensor([-30.0, 25.0, -12.0])  # gate is clamped from above only
    w = torch.rand(t, generator=gg) if weighted else None
    out = moe.swiglu_clamp(gate=gate, up=up, weight=w, limit=10.0)
    assert out.shape == (t, 29) and out.dtype == torch.bfloat16
    ref = np.array([[_naive_swiglu(float(gate[i, c]), float(up[i, c]),
                                   float(w[i]) if weighted else 1.0, 10.0)
                     for c in range(29)] for i in range(t)]).reshape(t, 29)
    assert_bf16_close(out, ref, ulps=0.501, atol=1e-30)  # one rounding: weight before the cast


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _naive_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    n, half = packed.shape
    out = np.zeros((n, 2 * half))
    for r in range(n):
        for b in range(half):
            byte = int(packed[r, b])
            for c, nib in ((2 * b, byte & 15), (2 * b + 1, byte >> 4)):  # low nibble = even
                v = _E2M1[nib & 7] * (-1 if nib & 8 else 1)
                out[r, c] = v * 2.0 ** (int(scales[r, c // 32]) - 127)
    return out


def _qdq_fp8(v: np.ndarray) -> np.ndarray:
    c, s = quant_fp8_act(torch.from_numpy(v).to(torch.bfloat16), 32)
    return _f64(c.float()) * np.repeat(2.0 ** (s.numpy().astype(np.float64) - 127), 32, axis=-1)


def _naive_expert(x: np.ndarray, w13: np.ndarray, w2: np.ndarray, wt: float, limit: float,
                  weight_after: bool = False) -> np.ndarray:
    inter = w2.shape[1]
    gu = _bf16(w13 @ _qdq_fp8(x))
    h = np.array([_naive_swiglu(gu[c], gu[inter + c], 1.0 if weight_after else wt, limit)
                  for c in range(inter)])
    y = _bf16(w2 @ _qdq_fp8(_bf16(h)))
    return y * wt if weight_after else y


def _moe_inputs(g: torch.Generator, t: int, d: int, inter: int, e: int, k: int):
    w13 = [quant_mxfp4(torch.randn(2 * inter, d, generator=g) / d**0.5, 32) for _ in range(e)]
    w2 = [quant_mxfp4(torch.randn(d, inter, generator=g) / inter**0.5, 32) for _ in range(e)]
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else \
        torch.zeros(0, k, dtype=torch.int64)
    return {"x": _randn(g, t, d, scale=2.0), "ids": ids,
            "weights": torch.rand(t, k, generator=g) + 0.1,
            "w13": torch.stack([a for a, _ in w13]), "w13_scale": torch.stack([b for _, b in w13]),
            "w2": torch.stack([a for a, _ in w2]), "w2_scale": torch.stack([b for _, b in w2]),
            "limit": 10.0}


@pytest.mark.parametrize("t", [0, 1, 5])
def test_moe_mxfp4_per_token_loop(seed: int, t: int):
    g = _gen(seed, t)
    kw = _moe_inputs(g, t, 64, 32, 4, 2)
    out = moe.moe_mxfp4(**kw)
    assert out.shape == (t, 64) and out.dtype == torch.float32
    w13 = [_naive_mxfp4(kw["w13"][e], kw["w13_scale"][e]) for e in range(4)]
    w2 = [_naive_mxfp4(kw["w2"][e], kw["w2_scale"][e]) for e in range(4)]
    ref = np.zeros((t, 64))
    for i in range(t):
        for j in range(2):
            e = int(kw["ids"][i, j])
            ref[i] += _naive_expert(_f64(kw["x"][i]), w13[e], w2[e], float(kw["weights"][i, j]),
                                    10.0)
    np.testing.assert_allclose(_f64(out), ref, atol=2e-2, rtol=2e-2)


def test_moe_weight_applies_before_w2(seed: int):
    """Scaling after w2 is not equivalent (w2 re-quantises its input per 32): the op must match
    the weight-before form and measurably differ from the weight-after form."""
    g = _gen(seed, 77)
    kw = _moe_inputs(g, 4, 64, 64, 1, 1)
    kw["weights"] = torch.full((4, 1), 0.3)
    out = _f64(moe.moe_mxfp4(**kw))
    w13 = _naive_mxfp4(kw["w13"][0], kw["w13_scale"][0])
    w2 = _naive_mxfp4(kw["w2"][0], kw["w2_scale"][0])
    before = np.stack([_naive_expert(_f64(kw["x"][i]), w13, w2, 0.3, 10.0) for i in range(4)])
    after = np.stack([_naive_expert(_f64(kw["x"][i]), w13, w2, 0.3, 10.0, weight_after=True)
                      for i in range(4)])
    err_before = np.abs(out - before).max()
    err_after = np.abs(out - after).max()
    assert err_before < 1e-2 and err_after > 4 * max(err_before, 2e-3), (err_before, err_after)


# ---------------------------------------------------------------------------------------- heads


def test_lm_head_markov_confidence(seed: int):
    g = _gen(seed, 4)
    d, v, r, b, n = 24, 37, 8, 3, 5
    h = _randn(g, b, d)
    wh = _randn(g, v, d, scale=d**-0.5)
    logits = head.lm_head(h=h, weight=wh)
    ref = np.array([[sum(_f64(h)[i, c] * _f64(wh)[j, c] for c in range(d)) for j in range(v)]
                    for i in range(b)])
    assert logits.dtype == torch.float32
    np.testing.assert_allclose(_f64(logits), ref, atol=1e-5, rtol=1e-5)

    prev = torch.randint(0, v, (b,), generator=g, dtype=torch.int32)
    emb, hd = _randn(g, v, r), _randn(g, v, r, scale=r**-0.5)
    bias, e = head.markov_bias(prev=prev, embed=emb, head=hd)
    for i in range(b):
        assert torch.equal(e[i], emb[int(prev[i])])
        want = [sum(_f64(emb)[int(prev[i]), c] * _f64(hd)[j, c] for c in range(r))
                for j in range(v)]
        np.testing.assert_allclose(_f64(bias[i]), want, atol=1e-5, rtol=1e-5)

    hid, me = _randn(g, b, n, d), _randn(g, b, n, r)
    proj = _randn(g, 1, d + r, scale=0.1)
    conf = head.confidence(hidden=hid, markov_embed=me, proj=proj)
    assert conf.shape == (b, n) and conf.dtype == torch.float32
    p = _f64(proj)[0]
    want = [[sum(_f64(hid)[i, j, c] * p[c] for c in range(d))
             + sum(_f64(me)[i, j, c] * p[d + c] for c in range(r)) for j in range(n)]
            for i in range(b)]
    np.testing.assert_allclose(_f64(conf), want, atol=1e-5, rtol=1e-5)
    assert head.lm_head(h=h[:0], weight=wh).shape == (0, v)
