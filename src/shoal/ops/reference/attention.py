"""Sparse MQA with a per-head sink over two record pools: the SWA window (MXFP8 records) and
the selected compressed rows (NVFP4 records), plus the SWA index builder.

Invariant (model.md §2.5 step 7): K = V = the 512-d record; scores in fp32 over the full head
dim; online softmax over blocks of 64 indices (SWA indices first, then compressed), running max
starting at -1e30, P rounded to bf16 relative to the running max before P.V, sink added to the
denominator unscaled; index -1 contributes nothing; all-empty rows give 0; bf16 output.
Deviation: products in fp64 and exp evaluated in fp64, each rounded once to fp32 (the official
fp32 BLAS order and vectorised exp depend on the platform and on the batch).
"""

from __future__ import annotations

import torch

from shoal.ops.reference._cases import randn
from shoal.ops.reference._math import einsum, exp
from shoal.ops.registry import REGISTRY, OpCase, Tolerance
from shoal.quant.records import (
    pack_compressed_record,
    pack_swa_record,
    unpack_compressed_record,
    unpack_swa_record,
)

ATTN_BLOCK = 64


def _gather_records(cache: torch.Tensor, idx: torch.Tensor, unpack, dim: int) -> torch.Tensor:
    """Dequantise the records named by idx [T, n] (-1 -> zeros) into fp32 [T, n, dim]."""
    flat = idx.reshape(-1).long()
    valid = flat >= 0
    rows = unpack(cache[flat.clamp_min(0)], dim)
    rows = rows * valid.unsqueeze(-1)
    return rows.view(*idx.shape, dim)


def _attn_case(t: int, heads: int, dim: int, n_swa: int, n_comp: int, pool: int = 64,
               heavy: bool = False) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        swa = pack_swa_record(randn(g, pool, dim, dtype=torch.float32)).to(d)
        comp = pack_compressed_record(randn(g, pool, dim, dtype=torch.float32)).to(d)
        swa_idx = torch.randint(-1, pool, (t, n_swa), generator=g, dtype=torch.int32)
        comp_idx = torch.randint(-1, pool, (t, n_comp), generator=g, dtype=torch.int32)
        if t:
            swa_idx[0] = -1  # an all-empty SWA row
            if n_comp:
                comp_idx[0] = -1
        return {"q": randn(g, t, heads, dim, device=d), "swa_cache": swa,
                "swa_idx": swa_idx.to(d), "comp_cache": comp if n_comp else None,
                "comp_idx": comp_idx.to(d) if n_comp else None,
                "sink": randn(g, heads, dtype=torch.float32, device=d),
                "scale": dim**-0.5}

    return OpCase(f"T{t}xH{heads}xD{dim}-swa{n_swa}-comp{n_comp}", make, heavy=heavy)


@REGISTRY.define("sparse_attn_sink",
                 tolerances={torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2)},
                 cases=[_attn_case(1, 4, 64, 8, 0), _attn_case(7, 4, 64, 8, 8),
                        _attn_case(0, 4, 64, 8, 8), _attn_case(83, 4, 64, 13, 70),
                        _attn_case(5, 64, 512, 128, 512, pool=700, heavy=True)])
def sparse_attn_sink(*, q: torch.Tensor, swa_cache: torch.Tensor, swa_idx: torch.Tensor,
                     comp_cache: torch.Tensor | None, comp_idx: torch.Tensor | None,
                     sink: torch.Tensor, scale: float) -> torch.Tensor:
    """o = sparse attention of q over gathered records.

    q [T, H, D] bf16 (roped); swa_cache uint8 [rows, D + D/32] (MXFP8 records); swa_idx
    [T, Ws] int32 physical record rows (-1 = empty); comp_cache uint8 [rows, D/2 + D/16]
    (NVFP4 records) or None; comp_idx [T, K] int32 (-1 = empty) or None; sink [H] fp32;
    scale = D^-0.5. Returns o [T, H, D] bf16 (not yet inverse-roped).
    """
    t, h, d = q.shape
    keys = _gather_records(swa_cache, swa_idx, unpack_swa_record, d)
    idx = swa_idx
    if comp_idx is not None and comp_idx.shape[1] > 0:
        assert comp_cache is not None
        keys = torch.cat([keys, _gather_records(comp_cache, comp_idx, unpack_compressed_record,
                                                d)], dim=1)
        idx = torch.cat([swa_idx, comp_idx], dim=1)
    qf = q.float()
    acc = torch.zeros(t, h, d, dtype=torch.float32, device=q.device)
    denom = torch.zeros(t, h, dtype=torch.float32, device=q.device)
    run_max = torch.full((t, h), -1e30, dtype=torch.float32, device=q.device)
    scale_t = torch.tensor(scale, dtype=torch.float32)
    for start in range(0, idx.shape[1], ATTN_BLOCK):
        valid = idx[:, start:start + ATTN_BLOCK] >= 0  # [T, n]
        k_blk = keys[:, start:start + ATTN_BLOCK]  # [T, n, D]
        k_blk = k_blk * valid.unsqueeze(-1)  # empty rows zeroed, as the reference
        s = einsum("thd,tnd->thn", qf, k_blk)
        s = torch.where(valid.unsqueeze(1), s, -torch.inf) * scale_t
        new_max = torch.maximum(run_max, s.amax(dim=-1))
        rescale = exp(run_max - new_max)
        p = exp(s - new_max.unsqueeze(-1))
        denom = denom * rescale + p.double().sum(dim=-1).float()
        p16 = p.to(torch.bfloat16).float()
        acc = acc * rescale.unsqueeze(-1) + einsum("thn,tnd->thd", p16, k_blk)
        run_max = new_max
    denom = denom + exp(sink.float().unsqueeze(0) - run_max)
    return (acc / denom.unsqueeze(-1)).to(torch.bfloat16)


def _paged_case(f: int, k: int, width: int, rpb: int) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        reqs = 3
        table = torch.randint(0, 50, (reqs, width), generator=g, dtype=torch.int32)
        table[torch.rand(reqs, width, generator=g) < 0.2] = -1  # unassigned blocks
        shape = (f, k) if k else (f,)
        logical = torch.randint(-3, width * rpb + 4, shape, generator=g)  # < 0 and past W too
        return {"logical": logical.to(d), "req": torch.randint(0, reqs, (f,), generator=g).to(d),
                "block_table": table.to(d), "rows_per_block": rpb}

    return OpCase(f"F{f}xK{k}-W{width}-rpb{rpb}", make)


@REGISTRY.define("paged_rows", cases=[_paged_case(1, 8, 4, 16), _paged_case(9, 0, 3, 128),
                                      _paged_case(0, 8, 4, 16), _paged_case(83, 512, 6, 64),
                                      _paged_case(5, 3, 1, 256)])
def paged_rows(*, logical: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor,
               rows_per_block: int) -> torch.Tensor:
    """Physical rows of paged cache rows: logical [F] or [F, K] row numbers of the requests
    req [F] (int), block_table [R, W] int32 (-1 = unassigned). Row j of request q lives at
    block_table[q, j // rows_per_block] * rows_per_block + j % rows_per_block. Returns int32
    of logical's shape, -1 where logical < 0, past the table's width, or in an unassigned block
    (a -1 row is skipped by the cache writers and masked by the readers)."""
    if logical.dim() not in (1, 2) or req.shape != (logical.shape[0],) \
            or block_table.dim() != 2 or rows_per_block < 1:
        raise ValueError(f"paged_rows: logical {tuple(logical.shape)} must be [F] or [F, K] with "
                         f"req [F] (got {tuple(req.shape)}), block_table [R, W] (got "
                         f"{tuple(block_table.shape)}) and rows_per_block >= 1 (got "
                         f"{rows_per_block})")
    width = block_table.shape[1]
    if width == 0:
        return torch.full_like(logical, -1, dtype=torch.int32)
    safe = logical.clamp_min(0).long()
    col = safe // rows_per_block
    q = req.long().view(-1, 1).expand_as(logical) if logical.dim() == 2 else req.long()
    blk = block_table[q, col.clamp_max(width - 1)].long()
    ok = (logical >= 0) & (col < width) & (blk >= 0)
    return torch.where(ok, blk * rows_per_block + safe % rows_per_block, -1).to(torch.int32)


def _swa_idx_case(t: int, window: int) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        pos = torch.randint(0, 40, (t,), generator=g)
        return {"positions": pos.to(d), "token_index": torch.arange(t).to(d),
                "chunk_start": (pos - torch.randint(0, 5, (t,), generator=g)).clamp_min(0).to(d),
                "ring_base": torch.randint(0, 3, (t,), generator=g).to(d) * (window + 5),
                "floor": torch.zeros(t, dtype=torch.long).to(d), "window": window,
                "ring_size": window + 5, "scratch_base": 3 * (window + 5)}

    return OpCase(f"T{t}xW{window}", make)


@REGISTRY.define("swa_indices", cases=[_swa_idx_case(1, 8), _swa_idx_case(9, 8),
                                       _swa_idx_case(0, 8), _swa_idx_case(83, 128)])
def swa_indices(*, positions: torch.Tensor, token_index: torch.Tensor, chunk_start: torch.Tensor,
                ring_base: torch.Tensor, floor: torch.Tensor, window: int, ring_size: int,
                scratch_base: int) -> torch.Tensor:
    """SWA key rows of each query: positions max(floor, p - window + 1) .. p.

    positions/token_index/chunk_start/ring_base/floor: [T] int64 per query (chunk_start = the
    first position of this request computed in this step; ring_base = slot * ring_size).
    A key at position k >= chunk_start lives in this step's scratch rows
    (scratch_base + token_index - (p - k)); an older key lives in the request's ring
    (ring_base + k % ring_size). Returns [T, window] int32, oldest first, -1 for no key.
    """
    offs = torch.arange(window - 1, -1, -1, device=positions.device)  # p-(w-1) .. p
    keys = positions.unsqueeze(1) - offs.unsqueeze(0)  # [T, W]
    in_chunk = keys >= chunk_start.unsqueeze(1)
    scratch = scratch_base + token_index.unsqueeze(1) - offs.unsqueeze(0)
    ring = ring_base.unsqueeze(1) + keys.remainder(ring_size)
    rows = torch.where(in_chunk, scratch, ring)
    lo = torch.maximum(floor, torch.zeros_like(floor)).unsqueeze(1)
    rows = torch.where(keys >= lo, rows, -1)
    return rows.to(torch.int32)
