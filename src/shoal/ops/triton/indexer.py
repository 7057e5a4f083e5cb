"""Triton (sm_90) indexer ops (model.md §2.7): `index_q_quant` (MXFP4 QDQ), `index_scores`
over paged MXFP4 index-key records, and the exact selections `topk_rows` and `candidate_mask`.

- index_q_quant: one program per (token, head) row; the shared bit-exact MXFP4 encoder.
- index_scores: one program per (token, 64-row tile): records are gathered through the block
  table and dequantised to bf16 in registers (e2m1 * 2^e is exact), q . k runs on the matrix
  unit (fp32 accumulation), then relu, the head-weighted sum and the visibility mask.
- Selection: one program per query row finds the k-th largest value exactly by a 32-step
  bisection on order-preserving integer keys (counting passes over the row), then one ordered
  pass selects every value above it plus the lowest-index ties (the reference's stable order)
  and writes the result by prefix sums, so indices come out ascending with no sort.
Invariant: reference contracts and tie rules (exact ties to the lower index; -inf never
selected; -0.0 == +0.0). NaN logits are unspecified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.cache import e2m1_value, mxfp4_block
from shoal.ops.triton.norm import on_device


@triton.jit
def _qquant_kernel(q_ptr, o_ptr, H, sq_t, sq_h, sq_d, DI: tl.constexpr):
    pid = tl.program_id(0)
    t = (pid // H).to(tl.int64)
    h = pid % H
    nb: tl.constexpr = DI // 32
    pair = tl.arange(0, nb)[:, None] * 16 + tl.arange(0, 16)[None, :]
    qb = q_ptr + t * sq_t + h * sq_h
    xe = tl.load(qb + (2 * pair) * sq_d).to(tl.float32)
    xo = tl.load(qb + (2 * pair + 1) * sq_d).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
    ce, co, _, s = mxfp4_block(xe, xo, amax)
    ob = o_ptr + pid.to(tl.int64) * DI
    tl.store(ob + 2 * pair, (e2m1_value(ce) * s[:, None]).to(tl.bfloat16))
    tl.store(ob + 2 * pair + 1, (e2m1_value(co) * s[:, None]).to(tl.bfloat16))


def _supports_q(*, q: torch.Tensor) -> bool:
    return (on_device(q) and q.dim() == 3 and q.dtype == torch.bfloat16 and q.shape[2] % 32 == 0
            and (q.shape[2] // 32) & (q.shape[2] // 32 - 1) == 0)


@REGISTRY.implement("triton", "index_q_quant", supports=_supports_q)
def index_q_quant(*, q: torch.Tensor) -> torch.Tensor:
    """MXFP4 QDQ of q [T, H, Di] bf16 (blocks of 32) -> [T, H, Di] bf16, bit-exact."""
    t, h, d = q.shape
    out = torch.empty(t, h, d, dtype=torch.bfloat16, device=q.device)
    if t * h:
        _qquant_kernel[(t * h,)](q, out, h, q.stride(0), q.stride(1), q.stride(2), DI=d,
                                 num_warps=1)
    return out


@triton.jit
def _scores_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, req_ptr, nv_ptr, o_ptr, H, N, RPB, sq_t, sq_h,
                   sq_d, sw_t, sw_h, bt_r, bt_c, HP: tl.constexpr, DI: tl.constexpr,
                   BN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    nv = tl.load(nv_ptr + t)
    valid = (j < nv) & (j < N)
    r = tl.load(req_ptr + t).to(tl.int64)
    blk = tl.load(bt_ptr + r * bt_r + (j // RPB) * bt_c, mask=valid, other=0).to(tl.int64)
    rec: tl.constexpr = DI // 2 + DI // 32
    row = (blk * RPB + j % RPB) * rec
    pk = tl.load(k_ptr + row[:, None] + tl.arange(0, DI // 2)[None, :], mask=valid[:, None],
                 other=0).to(tl.int32)
    kv = tl.reshape(tl.join(e2m1_value(pk & 15), e2m1_value(pk >> 4)), (BN, DI // 32, 32))
    e = tl.load(k_ptr + row[:, None] + DI // 2 + tl.arange(0, DI // 32)[None, :],
                mask=valid[:, None], other=127).to(tl.int32)
    sc = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
    sc = tl.where(e == 255, float("nan"), sc)
    k = tl.reshape(kv * sc[:, :, None], (BN, DI)).to(tl.bfloat16)
    hh = tl.arange(0, HP)
    hmask = hh < H
    q = tl.load(q_ptr + t * sq_t + hh[:, None] * sq_h + tl.arange(0, DI)[None, :] * sq_d,
                mask=hmask[:, None], other=0.0)
    s = tl.maximum(tl.dot(q, tl.trans(k)), 0.0)  # [HP, BN] fp32
    w = tl.load(w_ptr + t * sw_t + hh * sw_h, mask=hmask, other=0.0).to(tl.float32)
    logit = tl.sum(s * w[:, None], axis=0)
    logit = tl.where(valid, logit, float("-inf"))
    tl.store(o_ptr + t * N + j, logit, mask=j < N)


def _supports_scores(*, q: torch.Tensor, k_cache: torch.Tensor, **_) -> bool:
    # Disabled for record sizes that are not a multiple of 16 bytes (the real 68-B index-key
    # record): at Flash shapes (32 heads x 128, 2048 rows) the kernel faults with a misaligned
    # address on the H200 (scripts/probe_triton_ops.py index_scores), most likely vectorised
    # loads from a wrongly inferred record alignment. The reference serves until it is fixed.
    d = q.shape[-1]
    if (d // 2 + d // 32) % 16:
        return False
    return (on_device(q) and q.dim() == 3 and q.dtype == torch.bfloat16 and d in (32, 64, 128)
            and q.shape[1] <= 128 and k_cache.dtype == torch.uint8 and k_cache.dim() == 2
            and k_cache.stride(1) == 1 and k_cache.stride(0) == d // 2 + d // 32)


@REGISTRY.implement("triton", "index_scores", supports=_supports_scores)
def index_scores(*, q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                 block_table: torch.Tensor, req: torch.Tensor, n_visible: torch.Tensor,
                 num_rows: int, rows_per_block: int) -> torch.Tensor:
    """logit[t, j] = sum_h w[t, h] * relu(q[t, h] . k_j) -> [T, num_rows] fp32 (-inf if not
    visible); k_j dequantised from the request's paged MXFP4 records."""
    t, h, d = q.shape
    out = torch.empty(t, num_rows, dtype=torch.float32, device=q.device)
    if t == 0 or num_rows == 0:
        return out.fill_(float("-inf"))
    bn = 64
    _scores_kernel[(t, triton.cdiv(num_rows, bn))](
        q, weights, k_cache, block_table, req, n_visible, out, h, num_rows, rows_per_block,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        block_table.stride(0), block_table.stride(1), HP=max(16, triton.next_power_of_2(h)),
        DI=d, BN=bn, num_warps=4)
    return out


# ----------------------------------------------------------------------------- selection


@triton.jit
def _ukey(x):
    """fp32 -> int64 in [0, 2^32), order-preserving (-0.0 maps with +0.0)."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64) + 2147483648


@triton.jit
def _select_kernel(x_ptr, nv_ptr, o_ptr, W, k, BS, WR, sx_t, sx_w, so_t,
                   MASK_MODE: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr,
                   BSP: tl.constexpr):
    """Top-k of row t of x [T, W]. Index mode: o [T, k] int32 ascending, -1 padded, with the
    n_visible <= k fast path. Mask mode: o [T, WR] uint8 (WR <= W * BS), row r kept iff block r // BS is
    selected (x holds block scores)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    xr = x_ptr + t * sx_t
    n_sel = tl.zeros((), dtype=tl.int32)
    if MASK_MODE:
        fast = False
    else:
        fast = tl.load(nv_ptr + t) <= k
    if fast:
        n_sel = tl.load(nv_ptr + t).to(tl.int32)
        kk = tl.arange(0, KP)
        tl.store(o_ptr + t * so_t + kk, kk, mask=kk < n_sel)
    else:
        ans = tl.zeros((), dtype=tl.int64)
        bit = tl.full((), 1 << 31, tl.int64)
        for _ in range(32):  # bisection: the largest key with count(key >= ans) >= k
            cand = ans | bit
            bit = bit >> 1
            cnt = 0
            for c0 in range(0, W, BLOCK):
                cols = c0 + offs
                x = tl.load(xr + cols * sx_w, mask=cols < W, other=0.0)
                cnt += tl.sum(((_ukey(x) >= cand) & (cols < W)).to(tl.int32), axis=0)
            ans = tl.where(cnt >= k, cand, ans)
        n_gt = 0
        for c0 in range(0, W, BLOCK):
            cols = c0 + offs
            x = tl.load(xr + cols * sx_w, mask=cols < W, other=0.0)
            n_gt += tl.sum(((_ukey(x) > ans) & (cols < W)).to(tl.int32), axis=0)
        need = k - n_gt
        n_eq = 0
        for c0 in range(0, W, BLOCK):
            cols = c0 + offs
            m = cols < W
            x = tl.load(xr + cols * sx_w, mask=m, other=0.0)
            u = _ukey(x)
            eq = (u == ans) & m & (x > float("-inf"))
            rank = n_eq + tl.cumsum(eq.to(tl.int32), axis=0)
            sel = ((u > ans) & m) | (eq & (rank <= need))
            if MASK_MODE:
                rr = tl.arange(0, BSP)
                dst = cols[:, None] * BS + rr[None, :]
                tl.store(o_ptr + t * so_t + dst, tl.broadcast_to(sel[:, None], (BLOCK, BSP)).to(
                    tl.uint8), mask=m[:, None] & (rr[None, :] < BS) & (dst < WR))
            else:
                pos = n_sel + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                tl.store(o_ptr + t * so_t + pos, cols.to(tl.int32), mask=sel)
            n_sel += tl.sum(sel.to(tl.int32), axis=0)
            n_eq += tl.sum(eq.to(tl.int32), axis=0)
    if not MASK_MODE:
        kk = tl.arange(0, KP)
        tl.store(o_ptr + t * so_t + kk, tl.full((KP,), -1, tl.int32),
                 mask=(kk >= n_sel) & (kk < k))


def _supports_topk(*, logits: torch.Tensor, k: int, **_) -> bool:
    return (on_device(logits) and logits.dim() == 2 and logits.dtype == torch.float32
            and 0 < k <= 4096)


@REGISTRY.implement("triton", "topk_rows", supports=_supports_topk)
def topk_rows(*, logits: torch.Tensor, n_visible: torch.Tensor, k: int) -> torch.Tensor:
    """Top min(k, n_p) rows per query, ascending, -1 padded -> [T, k] int32 (reference rules)."""
    t, w = logits.shape
    out = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    if t:
        _select_kernel[(t,)](logits, n_visible, out, w, k, 1, 0, logits.stride(0),
                             logits.stride(1), k, MASK_MODE=False, BLOCK=min(4096, triton.next_power_of_2(max(w, 1))),
                             KP=triton.next_power_of_2(k), BSP=1, num_warps=4)
    return out


@triton.jit
def _block_score_kernel(x_ptr, nv_ptr, o_ptr, W, NB, BS, sx_t, sx_w, BB: tl.constexpr,
                        BSP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BB + tl.arange(0, BB)
    r = tl.arange(0, BSP)
    cols = b[:, None] * BS + r[None, :]
    m = (r[None, :] < BS) & (cols < W)
    s = tl.max(tl.load(x_ptr + t * sx_t + cols * sx_w, mask=m, other=float("-inf")), axis=1)
    n = tl.load(nv_ptr + t)
    newest = tl.where(n > 0, (n - 1) // BS, -1)
    s = tl.where(b == newest, float("inf"), s)
    tl.store(o_ptr + t * NB + b, s, mask=b < NB)


def _supports_cand(*, logits: torch.Tensor, block_size: int, topk_blocks: int, **_) -> bool:
    return (on_device(logits) and logits.dim() == 2 and logits.dtype == torch.float32
            and 0 < block_size <= 64 and topk_blocks > 0)


@REGISTRY.implement("triton", "candidate_mask", supports=_supports_cand)
def candidate_mask(*, logits: torch.Tensor, n_visible: torch.Tensor, block_size: int,
                   topk_blocks: int) -> torch.Tensor:
    """Level-1 block filter -> bool mask [T, N] over rows (reference rules and ties)."""
    t, w = logits.shape
    nb = triton.cdiv(w, block_size)
    out = torch.empty(t, w, dtype=torch.uint8, device=logits.device)
    if t and nb:
        scores = torch.empty(t, nb, dtype=torch.float32, device=logits.device)
        bsp = triton.next_power_of_2(block_size)
        bb = max(1, min(256, 2048 // bsp))
        _block_score_kernel[(t, triton.cdiv(nb, bb))](
            logits, n_visible, scores, w, nb, block_size, logits.stride(0), logits.stride(1),
            BB=bb, BSP=bsp, num_warps=4)
        _select_kernel[(t,)](scores, n_visible, out, nb, min(topk_blocks, nb), block_size, w,
                             nb, 1, w, MASK_MODE=True,
                             BLOCK=min(1024, triton.next_power_of_2(nb)), KP=1, BSP=bsp,
                             num_warps=4)
    return out.view(torch.bool)
