"""Independent checks of the reference ops: attention, SWA indices, cache writers, compressor
pooling and Engram (model.md §2.5-§2.7, §2.10, §4, §7).

Every test compares the op (called directly from its module with keyword arguments) against a
naive computation written here with explicit Python loops or elementwise float64 formulas. Dense
ops (mHC, norms, RoPE, GEMMs, MoE, heads) live in `test_reference_ops_dense.py`, the indexer's
(scores, query quantiser, candidate blocks, masks, top-k) in `test_reference_indexer_ops.py`.

Seeds: fresh each session; the test id shows the seed. Set ``SHOAL_TEST_SEED=<n>`` to reproduce.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shoal.ops.reference import attention, cache, engram
from shoal.quant.fp4 import qdq_mxfp4, qdq_nvfp4
from shoal.quant.fp8 import qdq_fp8_act
from shoal.quant.records import (
    compressed_record_bytes,
    index_k_record_bytes,
    pack_compressed_record,
    pack_swa_record,
    swa_record_bytes,
    unpack_compressed_record,
    unpack_index_k_record,
    unpack_swa_record,
)
from support.bf16 import assert_bf16_close
from support.rand import f64 as _f64
from support.rand import gen as _gen
from support.rand import randn as _randn

# ------------------------------------------------------------------------------ sparse_attn_sink


def _naive_attention(q, swa_cache, swa_idx, comp_cache, comp_idx, sink, scale) -> np.ndarray:
    t_n, h_n, d = q.shape
    qn, sk = _f64(q), _f64(sink)
    out = np.zeros((t_n, h_n, d))
    for t in range(t_n):
        keys = [_f64(unpack_swa_record(swa_cache[i], d)) for i in swa_idx[t].tolist() if i >= 0]
        if comp_idx is not None:
            keys += [_f64(unpack_compressed_record(comp_cache[i], d))
                     for i in comp_idx[t].tolist() if i >= 0]
        if not keys:
            continue  # all-empty row: output 0
        for h in range(h_n):
            s = [float(np.dot(qn[t, h], k)) * scale for k in keys]
            m = max(max(s), sk[h])
            num = sum(math.exp(si - m) * k for si, k in zip(s, keys, strict=True))
            den = sum(math.exp(si - m) for si in s) + math.exp(sk[h] - m)
            out[t, h] = num / den
    return out


@pytest.mark.parametrize("t,n_swa,n_comp", [(0, 5, 3), (1, 7, 0), (7, 13, 70), (3, 70, 13)])
def test_sparse_attn_sink_vs_explicit_softmax(seed: int, t: int, n_swa: int, n_comp: int):
    g = _gen(seed, t * 100 + n_swa)
    h, d, pool = 3, 64, 50
    swa_cache = pack_swa_record(_randn(g, pool, d, dtype=torch.float32))
    comp_cache = pack_compressed_record(_randn(g, pool, d, dtype=torch.float32))
    swa_idx = torch.randint(-1, pool, (t, n_swa), generator=g, dtype=torch.int32)
    comp_idx = torch.randint(-1, pool, (t, n_comp), generator=g, dtype=torch.int32)
    if t >= 2:
        swa_idx[1] = -1  # every index empty (with compressed rows only when n_comp > 0)
        comp_idx[1] = -1
        swa_idx[0, :2] = swa_idx[0, 2]  # repeated index: counted twice (no deduplication)
    q = _randn(g, t, h, d, scale=3.0)  # peaky softmax
    sink = _randn(g, h, scale=2.0, dtype=torch.float32)
    kw = {"q": q, "swa_cache": swa_cache, "swa_idx": swa_idx,
          "comp_cache": comp_cache if n_comp else None,
          "comp_idx": comp_idx if n_comp else None, "sink": sink, "scale": d**-0.5}
    out = attention.sparse_attn_sink(**kw)
    ref = _naive_attention(q, swa_cache, swa_idx, kw["comp_cache"], kw["comp_idx"], sink,
                           d**-0.5)
    assert out.shape == (t, h, d) and out.dtype == torch.bfloat16
    np.testing.assert_allclose(_f64(out), ref, atol=2e-2, rtol=2e-2)
    if t >= 2:
        assert torch.equal(out[1], torch.zeros(h, d, dtype=torch.bfloat16))


def test_sparse_attn_sink_dominant_sink_and_sink_unscaled(seed: int):
    """One key k with score s: o = e^s k / (e^s + e^sink); the sink is not multiplied by scale."""
    g = _gen(seed, 7)
    d = 64
    k = _randn(g, 1, d, dtype=torch.float32)
    rec = pack_swa_record(k)
    kq = _f64(unpack_swa_record(rec[0], d))
    q = torch.zeros(1, 2, d, dtype=torch.bfloat16)
    sink = torch.tensor([5.0, -5.0])
    out = attention.sparse_attn_sink(q=q, swa_cache=rec, swa_idx=torch.zeros(1, 1,
                                     dtype=torch.int32), comp_cache=None, comp_idx=None,
                                     sink=sink, scale=d**-0.5)
    for h, s in enumerate((5.0, -5.0)):  # q = 0 -> score 0
        np.testing.assert_allclose(_f64(out[0, h]), kq / (1 + math.exp(s)), atol=2e-3, rtol=1e-2)


# ---------------------------------------------------------------------------------- swa_indices


@pytest.mark.parametrize("window", [1, 7, 16])
def test_swa_indices_point_at_the_right_positions(seed: int, window: int):
    """Simulate rings (history, newest wins) and scratch rows (this step) holding position tags;
    each query's rows must hold positions max(floor, 0, p - W + 1) .. p, oldest first."""
    rng = np.random.default_rng(seed + window)
    ring_size = window + 5
    n_slots = 4
    slots = rng.permutation(n_slots)[:3]
    reqs = []  # (slot, history length, chunk length, floor)
    for s in slots:
        hist = int(rng.choice([0, 3, window + 9, 2 * ring_size + 1]))
        n = int(rng.integers(0, 2 * window + 3))
        floor = int(rng.integers(0, hist + 1)) if rng.random() < 0.5 else 0
        reqs.append((int(s), hist, n, floor))
    scratch_base = n_slots * ring_size
    total = sum(r[2] for r in reqs)
    storage = np.full(scratch_base + total, -999, dtype=np.int64)
    pos, tok, cstart, rbase, floors, owner = [], [], [], [], [], []
    ti = 0
    for r, (s, hist, n, floor) in enumerate(reqs):
        for k in range(hist):  # ring writes in position order
            storage[s * ring_size + k % ring_size] = r * 100000 + k
        for k in range(hist, hist + n):
            storage[scratch_base + ti] = r * 100000 + k
            pos.append(k), tok.append(ti), cstart.append(hist), rbase.append(s * ring_size)
            floors.append(floor), owner.append(r)
            ti += 1
    lt = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    out = attention.swa_indices(positions=lt(pos), token_index=lt(tok), chunk_start=lt(cstart),
                                ring_base=lt(rbase), floor=lt(floors), window=window,
                                ring_size=ring_size, scratch_base=scratch_base)
    assert out.shape == (total, window) and out.dtype == torch.int32
    for t in range(total):
        p, lo = pos[t], max(floors[t], 0)
        for w in range(window):
            k = p - window + 1 + w
            row = int(out[t, w])
            if k < lo:
                assert row == -1, (t, w, row)
            else:
                assert 0 <= row < storage.size and storage[row] == owner[t] * 100000 + k, (
                    f"query {t} (p={p}) column {w}: row {row} holds {storage[row]}, want {k}")


# ---------------------------------------------------------------------------------- cache writers


@pytest.mark.parametrize("op,nbytes,dim,qdq", [
    (cache.swa_write, swa_record_bytes, 64, lambda x: qdq_fp8_act(x.float(), 32)),
    (cache.compressed_write, compressed_record_bytes, 64, lambda x: qdq_nvfp4(x.float(), 16)),
    (cache.index_k_write, index_k_record_bytes, 32, lambda x: qdq_mxfp4(x.float(), 32)),
], ids=["swa", "compressed", "index_k"])
@pytest.mark.parametrize("t", [0, 1, 7])
def test_cache_writers_touch_only_named_rows(seed: int, op, nbytes, dim, qdq, t: int):
    g = _gen(seed, t)
    n_rows = 2 * t + 5
    poison = torch.randint(0, 256, (n_rows, nbytes(dim)), generator=g, dtype=torch.uint8)
    cache_t = poison.clone()
    rows = torch.randperm(n_rows, generator=g)[:t]
    x = _randn(g, t, dim, scale=4.0)
    op(x=x, cache=cache_t, rows=rows)
    unpack = {swa_record_bytes: unpack_swa_record, compressed_record_bytes:
              unpack_compressed_record, index_k_record_bytes: unpack_index_k_record}[nbytes]
    written = set(rows.tolist())
    for r in range(n_rows):
        if r not in written:
            assert torch.equal(cache_t[r], poison[r]), f"row {r} changed"
    for i, r in enumerate(rows.tolist()):
        assert torch.equal(unpack(cache_t[r], dim), qdq(x[i])), f"row {r} is not QDQ(x[{i}])"


def test_swa_write_record_is_mxfp8_of_input(seed: int):
    """Naive MXFP8: per 32 values s = 2^ceil(log2(max(amax, 1e-4) / 448)); record value = x
    rounded to the e4m3 grid at scale s (relative error <= 2^-4)."""
    g = _gen(seed, 3)
    x = _randn(g, 5, 64, scale=10.0)
    c = torch.zeros(5, swa_record_bytes(64), dtype=torch.uint8)
    cache.swa_write(x=x, cache=c, rows=torch.arange(5))
    for t in range(5):
        for b in range(2):
            blk = _f64(x[t, 32 * b:32 * b + 32])
            amax = max(np.abs(blk).max(), 1e-4)
            p = float(np.float32(amax) * np.float32(1 / 448))
            mant, e = math.frexp(p)
            s_exp = e - 1 if mant == 0.5 else e
            assert int(c[t, 64 + b]) == s_exp + 127
            vals = _f64(c[t, 32 * b:32 * b + 32].view(torch.float8_e4m3fn).float()) * 2.0**s_exp
            assert np.all(np.abs(vals - blk) <= np.abs(blk) * 2**-4 + 2.0**(s_exp - 10))


# -------------------------------------------------------------------------------- compress_pool


def _pool_schedule(rng: np.random.Generator, ratio: int):
    """Requests (slot, start, length) and a list of steps, each a list of (request, a, b)."""
    reqs = [(2, 0, int(rng.integers(11, 21))), (0, 0, int(rng.integers(9, 17))),
            (1, 8, int(rng.integers(6, 14)))]  # request 2 starts at a group boundary (8)
    cuts = []
    for r, (_, start, n) in enumerate(reqs):
        lens = [5, 1] if r == 0 else []  # 2nd chunk of request 0 starts at odd p = 5
        while sum(lens) < n:
            lens.append(int(rng.integers(0, 5)))
        lens[-1] -= sum(lens) - n
        pts, a = [], start
        for ln in lens:
            pts.append((a, a + ln))
            a += ln
        cuts.append(pts)
    steps = []
    for s in range(max(len(c) for c in cuts)):
        step = [(r, *cuts[r][s]) for r in range(len(reqs)) if s < len(cuts[r])]
        steps.append([step[i] for i in rng.permutation(len(step))])
    steps.append([])  # an empty step
    return reqs, steps


@pytest.mark.parametrize("ratio", [2, 4])
def test_compress_pool_equals_whole_prompt_pooling(seed: int, ratio: int):
    rng = np.random.default_rng(seed + ratio)
    g = _gen(seed, ratio)
    dim = 16
    reqs, steps = _pool_schedule(rng, ratio)
    state_kv = torch.full((4, ratio, dim), float("nan"))  # never-written state is never read
    state_sc = torch.full((4, ratio, dim), float("nan"))
    hist: list[dict[int, tuple[np.ndarray, np.ndarray]]] = [{} for _ in reqs]
    emitted = 0
    for step in steps:
        pos, slot, owner = [], [], []
        for r, a, b in step:
            pos += list(range(a, b))
            slot += [reqs[r][0]] * (b - a)
            owner += [r] * (b - a)
        t = len(pos)
        kv = _randn(g, t, dim, scale=2.0, dtype=torch.float32)
        sc = _randn(g, t, dim, scale=3.0, dtype=torch.float32)
        pooled, rows = cache.compress_pool(
            kv=kv, score=sc, positions=torch.tensor(pos, dtype=torch.int64),
            slots=torch.tensor(slot, dtype=torch.int64), state_kv=state_kv,
            state_score=state_sc, ratio=ratio)
        want_tok, want_row, want_val = [], [], []
        for i in range(t):
            hist[owner[i]][pos[i]] = (_f64(kv[i]), _f64(sc[i]))
        for i in range(t):
            p = pos[i]
            if (p + 1) % ratio:
                continue
            members = [hist[owner[i]][m] for m in range(p - ratio + 1, p + 1)]
            val = np.zeros(dim)
            for c in range(dim):
                ss = [mem[1][c] for mem in members]
                mx = max(ss)
                den = sum(math.exp(v - mx) for v in ss)
                val[c] = sum(math.exp(mem[1][c] - mx) / den * mem[0][c] for mem in members)
            want_tok.append(i), want_row.append(p // ratio), want_val.append(val)
        # one output row per token: row id -1 and a zero row where no group closes
        assert rows.shape == (t,) and pooled.shape == (t, dim)
        assert pooled.dtype == torch.bfloat16
        closing = [i for i in range(t) if rows[i] >= 0]
        assert closing == want_tok
        assert rows[closing].tolist() == want_row
        rest = [i for i in range(t) if rows[i] < 0]
        assert rows[rest].eq(-1).all() and pooled[rest].eq(0).all()
        if want_val:
            assert_bf16_close(pooled[closing], np.stack(want_val), atol=1e-4,
                              msg=f"step {step}")
        emitted += len(want_tok)
    assert emitted > 0


# ---------------------------------------------------------------------------------------- engram


@pytest.mark.parametrize("t", [0, 1, 7])
def test_engram_gather_explicit_dequant(seed: int, t: int):
    g = _gen(seed, t)
    rows_n, dh, n = 29, 64, 5
    codes = torch.randint(0, 256, (rows_n, dh), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3A  # no NaN codes
    scales = torch.randint(110, 140, (rows_n, dh // 32), generator=g, dtype=torch.uint8)
    row_ids = torch.randint(0, rows_n, (t, n), generator=g)
    out = engram.engram_gather(table=codes.view(torch.float8_e4m3fn), table_scale=scales,
                               row_ids=row_ids)
    assert out.shape == (t, n * dh) and out.dtype == torch.bfloat16
    e4m3 = codes.view(torch.float8_e4m3fn).double()
    for i in range(t):
        for c in range(n):
            r = int(row_ids[i, c])
            for col in range(dh):
                want = float(e4m3[r, col]) * 2.0 ** (int(scales[r, col // 32]) - 127)
                got = float(out[i, c * dh + col])
                assert got == float(torch.tensor(want).to(torch.bfloat16)), (i, c, col)


@pytest.mark.parametrize("t", [0, 1, 7])
def test_engram_mix_explicit_formula(seed: int, t: int):
    g = _gen(seed, t)
    hc, d = 4, 24
    stream = _randn(g, t, hc, d)
    kv = _randn(g, t, (hc + 1) * d, scale=2.0)
    qw = _randn(g, hc, d, scale=0.3) + 1
    kw = _randn(g, hc, d, scale=0.3) + 1
    mask = torch.rand(t, generator=g) > 0.3
    if t:
        mask[0] = False
    out = engram.engram_mix(stream=stream, kv=kv, q_weight=qw, k_weight=kw, eps=1e-20,
                            gate_mask=mask)
    assert out.shape == (t, hc, d) and out.dtype == torch.bfloat16
    ref = np.zeros((t, hc, d))
    for i in range(t):
        value = _f64(kv[i, hc * d:])
        for s in range(hc):
            r = _f64(stream[i, s])
            key = _f64(kv[i, s * d:(s + 1) * d])
            w = _f64(qw[s]) * _f64(kw[s])
            dot = (float(np.sum(r * w * key)) / math.sqrt(np.mean(r * r) + 1e-20)
                   / math.sqrt(np.mean(key * key) + 1e-20) / math.sqrt(d))
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            if not bool(mask[i]):
                gate = 0.0
            ref[i, s] = r + gate * value
    assert_bf16_close(out, ref, atol=1e-4)
    for i in range(t):
        if not bool(mask[i]):
            assert torch.equal(out[i], stream[i])


def test_paged_rows_rejects_mismatched_shapes() -> None:
    """paged_rows names the shapes it expects instead of failing inside torch indexing."""
    paged_rows = attention.paged_rows
    table = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="paged_rows"):
        paged_rows(logical=torch.zeros(4, 2, dtype=torch.long), req=torch.zeros(3, dtype=torch.long),
                   block_table=table, rows_per_block=16)
    with pytest.raises(ValueError, match="rows_per_block"):
        paged_rows(logical=torch.zeros(4, dtype=torch.long), req=torch.zeros(4, dtype=torch.long),
                   block_table=table, rows_per_block=0)
