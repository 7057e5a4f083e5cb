"""Independent checks of the reference indexer ops (model.md §2.6): index scores over paged
MXFP4 keys, the MXFP4 query quantiser, block-max candidate selection, masking and top-k rows.

Every test compares the op against a naive computation written here (explicit loops or float64
formulas). Seeds: fresh each session; the test id shows the seed (``SHOAL_TEST_SEED=<n>``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shoal.ops.reference import indexer
from shoal.quant.records import pack_index_k_record, unpack_index_k_record
from support.rand import f64 as _f64
from support.rand import gen as _gen
from support.rand import randn as _randn

# ---------------------------------------------------------------------------------- index_scores


@pytest.mark.parametrize("t", [0, 1, 7])
def test_index_scores_over_paged_keys(seed: int, t: int):
    g = _gen(seed, t)
    h, dim, n_req, rows, rpb = 3, 32, 2, 13, 4
    nb = -(-rows // rpb)
    table = torch.randperm(n_req * nb, generator=g).view(n_req, nb).to(torch.int32)
    k_cache = pack_index_k_record(_randn(g, n_req * nb * rpb, dim, dtype=torch.float32))
    q = _randn(g, t, h, dim)
    w = _randn(g, t, h).float()  # bf16 head weights, as the model passes them
    req = torch.randint(0, n_req, (t,), generator=g)
    n_vis = torch.randint(0, rows + 1, (t,), generator=g)
    if t:
        n_vis[0] = rows
    out = indexer.index_scores(q=q, weights=w, k_cache=k_cache, block_table=table, req=req,
                               n_visible=n_vis, num_rows=rows, rows_per_block=rpb)
    assert out.shape == (t, rows) and out.dtype == torch.float32
    ref = np.full((t, rows), -np.inf)
    for i in range(t):
        for j in range(int(n_vis[i])):
            phys = int(table[int(req[i]), j // rpb]) * rpb + j % rpb
            key = _f64(unpack_index_k_record(k_cache[phys], dim))
            # the official rounding points: bf16 dot, bf16 weighted ReLU, bf16 head sum
            terms = [_bf16(float(w[i, hh]) * max(0.0, _bf16(np.dot(_f64(q[i, hh]), key))))
                     for hh in range(h)]
            ref[i, j] = _bf16(math.fsum(terms))
    np.testing.assert_array_equal(_f64(out), ref)


def _bf16(v: float) -> float:
    """v rounded to fp32, then to bf16 (nearest, ties to even)."""
    return float(torch.tensor(v, dtype=torch.float32).bfloat16())


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _naive_e2m1(v: float) -> float:
    """Nearest e2m1 value to v (|v| <= 6), ties to the even code; keeps the sign."""
    a = abs(v)
    best = min(range(8), key=lambda c: (abs(_E2M1[c] - a), c % 2))
    return math.copysign(_E2M1[best], v)


@pytest.mark.parametrize("t", [0, 1, 5])
def test_index_q_quant_is_mxfp4_qdq(seed: int, t: int):
    g = _gen(seed, t)
    q = _randn(g, t, 3, 64, scale=2.0)
    out = indexer.index_q_quant(q=q)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    qs = _f64(q)
    for i in range(t):
        for h in range(3):
            for b in range(2):
                blk = qs[i, h, 32 * b:32 * b + 32]
                p = float(np.float32(max(np.abs(blk).max(), 6 * 2.0**-126))
                          * np.float32(1 / 6))
                mant, e = math.frexp(p)
                s = 2.0 ** (e - 1 if mant == 0.5 else e)
                want = [_naive_e2m1(max(-6.0, min(6.0, v / s))) * s for v in blk]
                np.testing.assert_array_equal(_f64(out[i, h, 32 * b:32 * b + 32]), want)


# ---------------------------------------------------------------- candidate_mask / mask / topk


def _tied_logits(g: torch.Generator, t: int, width: int, n_vis: torch.Tensor) -> torch.Tensor:
    """Small integers (many exact ties), a few extra -inf, -inf beyond n_visible."""
    x = torch.randint(-2, 3, (t, width), generator=g).float()
    x[torch.rand(t, width, generator=g) < 0.15] = -torch.inf
    return x.masked_fill(torch.arange(width) >= n_vis.unsqueeze(1), -torch.inf)


@pytest.mark.parametrize("block,k_blocks", [(2, 3), (3, 2), (4, 5)])
def test_candidate_mask_vs_explicit_blocks(seed: int, block: int, k_blocks: int):
    g = _gen(seed, block)
    t, width = 9, 13
    n_vis = torch.randint(0, width + 1, (t,), generator=g)
    n_vis[0], n_vis[1] = 0, width
    logits = _tied_logits(g, t, width, n_vis)
    out = indexer.candidate_mask(logits=logits, n_visible=n_vis, block_size=block,
                                 topk_blocks=k_blocks)
    assert out.shape == (t, width) and out.dtype == torch.bool
    nb = -(-width // block)
    for i in range(t):
        score = []
        for b in range(nb):
            score.append(max(float(logits[i, j]) for j in range(b * block,
                                                                min(width, b * block + block))))
        n = int(n_vis[i])
        if n > 0:
            score[(n - 1) // block] = math.inf
        order = sorted(range(nb), key=lambda b: (-score[b], b))[:min(k_blocks, nb)]
        keep = {b for b in order if score[b] > -math.inf}
        want = [j // block in keep for j in range(width)]
        assert out[i].tolist() == want, (i, score, n)


def test_candidate_mask_empty_batch():
    out = indexer.candidate_mask(logits=torch.zeros(0, 7), n_visible=torch.zeros(0,
                                 dtype=torch.int64), block_size=2, topk_blocks=2)
    assert out.shape == (0, 7) and out.dtype == torch.bool


def test_mask_logits(seed: int):
    g = _gen(seed)
    logits = torch.randn(5, 11, generator=g)
    mask = torch.rand(5, 11, generator=g) > 0.5
    out = indexer.mask_logits(logits=logits, mask=mask)
    for i in range(5):
        for j in range(11):
            want = float(logits[i, j]) if mask[i, j] else -math.inf
            assert float(out[i, j]) == want


def _naive_topk(row: list[float], k: int) -> list[int]:
    cand = [j for j, v in enumerate(row) if v > -math.inf]
    picked = sorted(sorted(cand, key=lambda j: (-row[j], j))[:k])
    return picked + [-1] * (k - len(picked))


@pytest.mark.parametrize("width,k", [(13, 5), (3, 5), (40, 8)])
def test_topk_rows_vs_explicit_sort(seed: int, width: int, k: int):
    g = _gen(seed, width)
    t = 11
    n_vis = torch.randint(0, width + 1, (t,), generator=g)
    n_vis[0] = width
    logits = _tied_logits(g, t, width, n_vis)
    out = indexer.topk_rows(logits=logits, n_visible=n_vis, k=k)
    assert out.shape == (t, k) and out.dtype == torch.int32
    for i in range(t):
        n = int(n_vis[i])
        expected = (list(range(n)) + [-1] * (k - n) if n <= k  # the reference's fast path
                    else _naive_topk(logits[i].tolist(), k))
        assert out[i].tolist() == expected, (i, n, logits[i].tolist())


def test_topk_rows_fast_path_and_empty(seed: int):
    g = _gen(seed)
    k, width = 8, 20
    n_vis = torch.tensor([0, 1, 5, 8])
    logits = torch.randn(4, width, generator=g).masked_fill(
        torch.arange(width) >= n_vis.unsqueeze(1), -torch.inf)
    out = indexer.topk_rows(logits=logits, n_visible=n_vis, k=k)
    for i, n in enumerate(n_vis.tolist()):
        assert out[i].tolist() == list(range(n)) + [-1] * (k - n)
    empty = indexer.topk_rows(logits=torch.zeros(0, width), n_visible=torch.zeros(0,
                              dtype=torch.int64), k=k)
    assert empty.shape == (0, k) and empty.dtype == torch.int32


def test_topk_rows_fast_path_ignores_minus_inf_visible_rows():
    k = 8
    logits = torch.tensor([[0.5, -math.inf, 0.25, -math.inf, 1.0]])
    out = indexer.topk_rows(logits=logits, n_visible=torch.tensor([5]), k=k)
    assert out[0].tolist() == [0, 1, 2, 3, 4] + [-1] * 3
