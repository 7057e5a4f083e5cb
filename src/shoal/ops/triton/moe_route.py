"""Token permutation for the grouped MoE GEMMs (moe.py): the T * k (token, slot) rows sorted by
expert id (stable), with per-expert counts, on device and without host synchronisation;
`expert_tile` maps a GEMM program's row block to its expert and rows from those counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait


@triton.jit
def expert_tile(cnt_ptr, pid_m, E, E_P2: tl.constexpr, BM: tl.constexpr):
    """Row block pid_m of the expert-sorted rows -> (expert, first row, end row of expert)."""
    idx = tl.arange(0, E_P2)
    cnt = tl.load(cnt_ptr + idx, mask=idx < E, other=0)
    tiles = (cnt + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)
    e = tl.sum((cum <= pid_m).to(tl.int32), 0)
    sel = idx == e
    t0 = tl.sum(tl.where(sel, cum - tiles, 0), 0)
    n_e = tl.sum(tl.where(sel, cnt, 0), 0)
    start = tl.sum(tl.where(idx < e, cnt, 0), 0)
    return e, start + (pid_m - t0) * BM, start + n_e


@triton.jit
def _route_kernel(ids_ptr, w_ptr, tok_ptr, orow_ptr, rw_ptr, cnt_ptr, R, E, KTOP: tl.constexpr,
                  BI: tl.constexpr, BJ: tl.constexpr):
    """Stable counting sort of the R = T * KTOP (token, slot) rows by expert id, in one launch.

    Programs 0 .. cdiv(R, BI) - 1 take BI rows each: rank(r) = #{r' : e(r') < e(r) or
    (e(r') == e(r) and r' < r)} (exactly the position of a stable argsort), then tok[rank] =
    r // KTOP, orow[rank] = r, rw[rank] = w[r]. The remaining programs count BI experts each.
    Every output element is written by exactly one program (no atomics, no zero-fill)."""
    pdl_wait()
    pid = tl.program_id(0)
    n_i = tl.cdiv(R, BI)
    offs_j = tl.arange(0, BJ)
    if pid < n_i:
        r = pid * BI + tl.arange(0, BI)
        rm = r < R
        e_r = tl.load(ids_ptr + r, mask=rm, other=0)
        rank = tl.zeros((BI,), dtype=tl.int32)
        j0 = R * 0
        while j0 < R:  # (a runtime-bound `range` breaks the interpreter under numpy 2)
            j = j0 + offs_j
            e_j = tl.load(ids_ptr + j, mask=j < R, other=E)
            before = (e_j[None, :] < e_r[:, None]) | (
                (e_j[None, :] == e_r[:, None]) & (j[None, :] < r[:, None]))
            rank += tl.sum(before.to(tl.int32), 1)
            j0 += BJ
        tl.store(tok_ptr + rank, (r // KTOP).to(tl.int32), mask=rm)
        tl.store(orow_ptr + rank, r.to(tl.int32), mask=rm)
        tl.store(rw_ptr + rank, tl.load(w_ptr + r, mask=rm, other=0.0), mask=rm)
    else:
        ex = (pid - n_i) * BI + tl.arange(0, BI)
        cnt = tl.zeros((BI,), dtype=tl.int32)
        j0 = R * 0
        while j0 < R:
            j = j0 + offs_j
            e_j = tl.load(ids_ptr + j, mask=j < R, other=-1)
            cnt += tl.sum((e_j[None, :] == ex[:, None]).to(tl.int32), 1)
            j0 += BJ
        tl.store(cnt_ptr + ex, cnt, mask=ex < E)


ROUTE_KERNEL_MAX_ROWS = 4096  # the one-launch sort is O(R^2); above this torch.argsort is cheaper


def route(ids: torch.Tensor, weights: torch.Tensor, e: int,
          max_kernel_rows: int = ROUTE_KERNEL_MAX_ROWS):
    """Expert-sorted rows: (token of each row int32, slot-major output row int32, routing weight
    fp32, per-expert counts int32); rows of id `e` (no expert) sort last and count nowhere.
    Up to `max_kernel_rows` rows one Triton launch
    (`_route_kernel`, the decode case: fewer graph nodes), else torch's stable argsort; both give
    the identical permutation. No host synchronisation."""
    k = ids.shape[1]
    flat = ids.reshape(-1).contiguous()
    rows = flat.numel()
    if rows <= max_kernel_rows:
        dev = ids.device
        tok = torch.empty(rows, dtype=torch.int32, device=dev)
        orow = torch.empty(rows, dtype=torch.int32, device=dev)
        rw = torch.empty(rows, dtype=torch.float32, device=dev)
        counts = torch.empty(e, dtype=torch.int32, device=dev)
        bi, bj = 64, 128
        grid = (triton.cdiv(rows, bi) + triton.cdiv(e, bi),)
        _route_kernel[grid](flat, weights.reshape(-1).float().contiguous(), tok, orow, rw,
                            counts, rows, e, KTOP=k, BI=bi, BJ=bj, num_warps=4, **PDL_LAUNCH)
        return tok, orow, rw, counts
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e + 1, dtype=torch.int32, device=ids.device)  # + id e: no expert
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    counts = counts[:e]
    tok = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    rw = weights.reshape(-1).float()[order].contiguous()
    return tok, order.to(torch.int32), rw, counts
