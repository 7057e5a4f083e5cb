"""Triton (sm_90) per-step attention metadata: `swa_indices` (the SWA key rows of each query,
model.md §2.5), `paged_rows` (physical rows of paged compressed / index-key rows: one launch
where the torch expression took about ten) and `mask_logits` (reindex layers: logits outside
the published candidate mask become -inf, §2.7).

All are element-wise: one program per tile of ROWS queries x BW (or BN) columns (paged_rows:
BLOCK flat elements), int64 index arithmetic, no reductions; mask_logits moves the logits as
integer bits (any float dtype).
Invariant: bit-identical to the reference (ring rows use the floor modulo of the reference's
`remainder`; -1 marks no key; NaN logits pass through where the mask is True, as
`masked_fill`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.norm import on_device
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait


@triton.jit
def _swa_kernel(pos_ptr, tok_ptr, cs_ptr, rb_ptr, fl_ptr, o_ptr, T, W, ring_size, scratch_base,
                s_pos, s_tok, s_cs, s_rb, s_fl, ROWS: tl.constexpr, BW: tl.constexpr):
    pdl_wait()
    q = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    qmask = q < T
    p = tl.load(pos_ptr + q * s_pos, mask=qmask, other=0).to(tl.int64)
    tok = tl.load(tok_ptr + q * s_tok, mask=qmask, other=0).to(tl.int64)
    cs = tl.load(cs_ptr + q * s_cs, mask=qmask, other=0).to(tl.int64)
    rb = tl.load(rb_ptr + q * s_rb, mask=qmask, other=0).to(tl.int64)
    lo = tl.maximum(tl.load(fl_ptr + q * s_fl, mask=qmask, other=0).to(tl.int64), 0)
    w = tl.program_id(1) * BW + tl.arange(0, BW).to(tl.int64)
    offs = W - 1 - w  # column w holds position p - (W - 1 - w): oldest first
    key = p[:, None] - offs[None, :]
    scratch = scratch_base + tok[:, None] - offs[None, :]
    ring = rb[:, None] + ((key % ring_size) + ring_size) % ring_size
    rows = tl.where(key >= cs[:, None], scratch, ring)
    rows = tl.where(key >= lo[:, None], rows, -1)
    mask = qmask[:, None] & (w < W)[None, :]
    tl.store(o_ptr + q[:, None] * W + w[None, :], rows.to(tl.int32), mask=mask)


def _supports_swa(*, positions: torch.Tensor, token_index: torch.Tensor,
                  chunk_start: torch.Tensor, ring_base: torch.Tensor, floor: torch.Tensor,
                  window: int, ring_size: int, **_) -> bool:
    t = positions.shape[0] if positions.dim() == 1 else -1
    return (on_device(positions) and t >= 0 and window >= 1 and ring_size >= 1
            and all(x.shape == (t,) and not x.is_floating_point()
                    for x in (positions, token_index, chunk_start, ring_base, floor)))


@REGISTRY.implement("triton", "swa_indices", supports=_supports_swa)
def swa_indices(*, positions: torch.Tensor, token_index: torch.Tensor, chunk_start: torch.Tensor,
                ring_base: torch.Tensor, floor: torch.Tensor, window: int, ring_size: int,
                scratch_base: int) -> torch.Tensor:
    """SWA key rows of each query (positions max(floor, p - window + 1) .. p): scratch rows for
    keys of this step, ring rows for older ones -> [T, window] int32, oldest first, -1 empty."""
    t = positions.shape[0]
    out = torch.empty(t, window, dtype=torch.int32, device=positions.device)
    if t:
        bw = min(triton.next_power_of_2(window), 256)
        rows = max(1, min(64, 2048 // bw))
        _swa_kernel[(triton.cdiv(t, rows), triton.cdiv(window, bw))](
            positions, token_index, chunk_start, ring_base, floor, out, t, window, ring_size,
            scratch_base, positions.stride(0), token_index.stride(0), chunk_start.stride(0),
            ring_base.stride(0), floor.stride(0), ROWS=rows, BW=bw, num_warps=4, **PDL_LAUNCH)
    return out


@triton.jit
def _paged_kernel(l_ptr, r_ptr, t_ptr, o_ptr, N, K, W, RPB, s_r, s_t, BLOCK: tl.constexpr):
    pdl_wait()
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    j = tl.load(l_ptr + i, mask=m, other=-1).to(tl.int64)
    q = tl.load(r_ptr + (i // K) * s_r, mask=m, other=0).to(tl.int64)
    safe = tl.maximum(j, 0)
    col = safe // RPB
    ok = m & (j >= 0) & (col < W)
    blk = tl.load(t_ptr + q * s_t + col, mask=ok, other=-1).to(tl.int64)
    rows = tl.where(ok & (blk >= 0), blk * RPB + safe % RPB, -1)
    tl.store(o_ptr + i, rows.to(tl.int32), mask=m)


def _supports_paged(*, logical: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor,
                    rows_per_block: int) -> bool:
    return (on_device(logical) and logical.dim() in (1, 2) and not logical.is_floating_point()
            and req.dim() == 1 and req.shape[0] == logical.shape[0]
            and not req.is_floating_point() and block_table.dim() == 2
            and block_table.dtype == torch.int32 and block_table.stride(1) == 1
            and rows_per_block >= 1)


@REGISTRY.implement("triton", "paged_rows", supports=_supports_paged)
def paged_rows(*, logical: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor,
               rows_per_block: int) -> torch.Tensor:
    """Physical rows (int32, logical's shape; -1 where logical < 0, past the table or in an
    unassigned block) of logical rows [F] / [F, K] of requests req [F] (reference contract)."""
    out = torch.empty(logical.shape, dtype=torch.int32, device=logical.device)
    n = logical.numel()
    if n:
        k = logical.shape[1] if logical.dim() == 2 else 1
        block = 1024
        _paged_kernel[(triton.cdiv(n, block),)](
            logical.contiguous(), req, block_table, out, n, k, block_table.shape[1],
            rows_per_block, req.stride(0), block_table.stride(0), BLOCK=block, num_warps=4, **PDL_LAUNCH)
    return out


_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _mask_kernel(x_ptr, m_ptr, o_ptr, T, N, neg_inf, sx_t, sx_n, sm_t, sm_n,
                 ROWS: tl.constexpr, BN: tl.constexpr):
    pdl_wait()
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    mask = (r < T)[:, None] & (c < N)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx_t + c[None, :] * sx_n, mask=mask)
    keep = tl.load(m_ptr + r[:, None] * sm_t + c[None, :] * sm_n, mask=mask, other=0)
    y = tl.where(keep != 0, x, neg_inf)  # on the bits: exact for every float dtype
    tl.store(o_ptr + r[:, None] * N + c[None, :], y.to(x.dtype), mask=mask)


def _supports_mask(*, logits: torch.Tensor, mask: torch.Tensor, **_) -> bool:
    return (on_device(logits) and logits.dim() == 2 and logits.is_floating_point()
            and logits.dtype.itemsize >= 2 and mask.dtype == torch.bool
            and mask.shape == logits.shape and mask.device == logits.device)


@REGISTRY.implement("triton", "mask_logits", supports=_supports_mask)
def mask_logits(*, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [T, N] float, mask [T, N] bool -> logits where mask else -inf (new tensor)."""
    t, n = logits.shape
    out = torch.empty(t, n, dtype=logits.dtype, device=logits.device)
    if t * n:
        bn = min(triton.next_power_of_2(n), 1024)
        rows = max(1, min(32, 4096 // bn))
        keep = mask.view(torch.uint8)
        bits = _INT_OF[logits.dtype.itemsize]
        neg_inf = int(torch.tensor(-torch.inf, dtype=logits.dtype).view(bits))
        _mask_kernel[(triton.cdiv(t, rows), triton.cdiv(n, bn))](
            logits.view(bits), keep, out.view(bits), t, n, neg_inf, logits.stride(0),
            logits.stride(1), keep.stride(0),
            keep.stride(1), ROWS=rows, BN=bn, num_warps=4, **PDL_LAUNCH)
    return out
