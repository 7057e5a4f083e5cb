"""Indexer ops (model.md §2.7): query quantisation, scores over paged FP4 index keys, the
level-1 candidate block filter, masking, and the top-k row selection.

Invariant: scores round where the official code's bf16 tensors round (model.md §2.7): the
per-head dot, the weighted ReLU and the head sum are each rounded to bf16 (returned in an fp32
tensor, so -inf and the selections' inputs keep one dtype); rows j >= n_p (not yet visible
to the query) score -inf; the selection returns the top min(k, n_p) visible rows in ascending
position order, -1 padded.
"""

from __future__ import annotations

import torch

from shoal.ops.reference._cases import randn
from shoal.ops.registry import REGISTRY, OpCase, Tolerance
from shoal.quant.fp4 import qdq_mxfp4
from shoal.quant.records import pack_index_k_record, unpack_index_k_record


@REGISTRY.define("index_q_quant", tolerances={torch.bfloat16: Tolerance()}, cases=[
    OpCase(f"T{t}xH{h}xD{d}", (lambda t, h, d: lambda g, dev: {
        "q": randn(g, t, h, d, device=dev)})(t, h, d))
    for t, h, d in ((1, 4, 32), (7, 4, 32), (0, 4, 32), (83, 32, 128))])
def index_q_quant(*, q: torch.Tensor) -> torch.Tensor:
    """MXFP4 quantise-dequantise of the roped index query [T, H, Di] bf16 (blocks of 32)."""
    return qdq_mxfp4(q, 32).to(torch.bfloat16)


def _paged_rows(block_table: torch.Tensor, req: torch.Tensor, j: torch.Tensor,
                rows_per_block: int) -> torch.Tensor:
    """Physical row of logical row j of request req[t]: table[req, j // rpb] * rpb + j % rpb."""
    blk = block_table[req.unsqueeze(1), (j // rows_per_block)].long()
    return blk * rows_per_block + j % rows_per_block


def _scores_case(t: int, heads: int, dim: int, n_req: int, rows: int) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        rpb = 4
        nb = (rows + rpb - 1) // rpb
        table = torch.randperm(n_req * nb, generator=g).view(n_req, nb).to(torch.int32)
        cache = pack_index_k_record(randn(g, n_req * nb * rpb, dim, dtype=torch.float32))
        return {"q": randn(g, t, heads, dim, device=d),
                "weights": randn(g, t, heads, device=d).float(),
                "k_cache": cache.to(d), "block_table": table.to(d),
                "req": torch.randint(0, n_req, (t,), generator=g).to(d),
                "n_visible": torch.randint(0, rows + 1, (t,), generator=g).to(d),
                "num_rows": rows, "rows_per_block": rpb}

    return OpCase(f"T{t}xH{heads}xD{dim}-R{n_req}-N{rows}", make)


@REGISTRY.define("index_scores", tolerances={torch.float32: Tolerance(atol=1e-6, rtol=2**-7)},
                 cases=[_scores_case(1, 4, 32, 1, 5), _scores_case(7, 4, 32, 2, 13),
                        _scores_case(0, 4, 32, 1, 4), _scores_case(83, 32, 128, 3, 70)])
def index_scores(*, q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                 block_table: torch.Tensor, req: torch.Tensor, n_visible: torch.Tensor,
                 num_rows: int, rows_per_block: int) -> torch.Tensor:
    """logit[t, j] = sum_h w[t, h] * relu(q[t, h] . k_j) over the request's index keys.

    Rounded as the official code: s = bf16(q . k) (exact accumulation), bf16(relu(s) * w_h),
    bf16(sum over h). q [T, H, Di] bf16 (QDQ'd); weights [T, H] fp32 holding the bf16 head
    weights (weights_proj output times Di^-0.5 * H^-0.5, rounded to bf16); k_cache uint8
    [rows, Di/2 + Di/32] MXFP4 records; block_table [R, nb] int32; req [T] request of each
    query; n_visible [T] = (p + 1) // r; num_rows = Nmax columns. Returns [T, Nmax] fp32,
    -inf where j >= n_visible.
    """
    t, _, dim = q.shape
    j = torch.arange(num_rows, device=q.device)
    if t == 0 or num_rows == 0:
        return torch.full((t, num_rows), -torch.inf, device=q.device)
    phys = _paged_rows(block_table, req, j.unsqueeze(0).expand(t, -1), rows_per_block)
    keys = unpack_index_k_record(k_cache[phys.reshape(-1)], dim).view(t, num_rows, dim)
    s = torch.einsum("thd,tnd->thn", q.double(), keys.double()).float().bfloat16().relu()
    s = (s.float() * weights.unsqueeze(-1)).bfloat16()
    logits = s.double().sum(dim=1).float().bfloat16().float()
    return logits.masked_fill(j.unsqueeze(0) >= n_visible.unsqueeze(1), -torch.inf)


def _stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim with exact ties broken towards the lower index.

    The official reference leaves ties to torch.topk (implementation-defined, and they are
    common: a row whose every head is rectified to 0 scores exactly 0). Pinning them makes the
    selection independent of the tensor width, so chunked, decode and batched runs agree.
    """
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def _logits_case(t: int, rows: int) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        n = torch.randint(0, rows + 1, (t,), generator=g)
        logits = torch.randn(t, rows, generator=g)
        logits = logits.masked_fill(torch.arange(rows) >= n.unsqueeze(1), -torch.inf)
        return {"logits": logits.to(d), "n_visible": n.to(d)}

    return OpCase(f"T{t}xN{rows}", make)


@REGISTRY.define("candidate_mask",
                 cases=[OpCase(c.name, (lambda c: lambda g, d: {
                     **c.make(g, d), "block_size": 2, "topk_blocks": 5})(c))
                     for c in (_logits_case(1, 9), _logits_case(7, 23), _logits_case(0, 4),
                               _logits_case(83, 64))])
def candidate_mask(*, logits: torch.Tensor, n_visible: torch.Tensor, block_size: int,
                   topk_blocks: int) -> torch.Tensor:
    """Level-1 filter at the candidate source: keep the best `topk_blocks` blocks per query.

    Block score = max logit of its `block_size` rows (last block padded with -inf); the block of
    the newest visible row (n_p - 1) // block_size is pinned (+inf); blocks that come back -inf
    are dropped; exact ties go to the lower block. Returns a bool mask [T, N] over rows.
    """
    t, width = logits.shape
    pad = (-width) % block_size
    scores = torch.nn.functional.pad(logits, (0, pad), value=-torch.inf)
    scores = scores.unflatten(-1, (-1, block_size)).amax(dim=-1)
    n_blocks = scores.shape[-1]
    newest = (n_visible - 1).div(block_size, rounding_mode="floor")
    scores = scores.masked_fill(torch.arange(n_blocks, device=logits.device) == newest.unsqueeze(1),
                                torch.inf)
    top_vals, top_idx = _stable_topk(scores, min(topk_blocks, n_blocks))
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top_idx, top_vals > -torch.inf)
    return keep.repeat_interleave(block_size, dim=-1)[:, :width]


@REGISTRY.define("mask_logits", cases=[OpCase(c.name, (lambda c: lambda g, d: {
    "logits": c.make(g, d)["logits"],
    "mask": torch.rand(c.make(g, d)["logits"].shape, generator=g).to(d) > 0.5})(c))
    for c in (_logits_case(1, 9), _logits_case(7, 23), _logits_case(0, 4))])
def mask_logits(*, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reindex layers: logits outside the published candidate mask become -inf."""
    return logits.masked_fill(~mask, -torch.inf)


def _topk_compare(out, ref, case) -> None:
    """Top-k sets are equal modulo exact ties; tests use continuous random logits (no ties)."""
    assert torch.equal(out.cpu(), ref.cpu()), "top-k index sets differ"


@REGISTRY.define("topk_rows", compare=_topk_compare,
                 cases=[OpCase(c.name, (lambda c: lambda g, d: {**c.make(g, d), "k": 8})(c))
                        for c in (_logits_case(1, 5), _logits_case(7, 23), _logits_case(0, 4),
                                  _logits_case(83, 700))])
def topk_rows(*, logits: torch.Tensor, n_visible: torch.Tensor, k: int) -> torch.Tensor:
    """Select the top min(k, n_p) rows per query, ascending, -1 padded -> [T, k] int32.

    Fast path (as the reference): when n_p <= k the result is rows 0 .. n_p - 1 regardless of
    the scores. Otherwise rows scoring -inf (filtered out) are never selected, and exact ties
    go to the lower row.
    """
    t, width = logits.shape
    rows = torch.arange(max(width, k), device=logits.device)
    fast = (rows.unsqueeze(0) < n_visible.unsqueeze(1))[:, :k]  # n_p <= k: rows 0 .. n_p - 1
    if width < k:
        logits = torch.nn.functional.pad(logits, (0, k - width), value=-torch.inf)
    top_vals, top_idx = _stable_topk(logits, k)
    idx = torch.where(top_vals > -torch.inf, top_idx, torch.iinfo(torch.int64).max)
    idx = idx.sort(dim=-1).values
    idx = torch.where(idx == torch.iinfo(torch.int64).max, -1, idx)
    idx = torch.where((n_visible <= k).unsqueeze(1),
                      torch.where(fast, rows[:k].unsqueeze(0), -1), idx)
    return idx.to(torch.int32)
