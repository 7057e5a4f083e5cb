"""Triton (sm_90) indexer ops (model.md §2.7): `index_q_quant` (MXFP4 QDQ), `index_scores`
over paged MXFP4 index-key records, and the exact selections `topk_rows` and `candidate_mask`.

- index_q_quant: one program per (token, head) row; the shared bit-exact MXFP4 encoder.
- index_scores: one program per (block of TB tokens, 64-row tile): records are gathered
  through the block table as int32 words (a 68-B record is 17 words; record offsets are only
  4-byte aligned, so every load is one scalar word) and dequantised to bf16 in registers
  (e2m1 * 2^e is exact); the tile then serves the block's tokens of its request, G = 64 / HP
  at a time as the 64 rows (tokens x heads) of one q . k^T product on the matrix unit (fp32
  accumulation), then relu, the head-weighted sum and the visibility mask; tiles the block's
  tokens cannot see (the causal triangle of a prefill chunk) are stored as -inf unread. TB = G
  for decode-sized batches, 16 G for prefill (H200, T 2048 x N 8192 of one request: 2.73 /
  2.09 / 1.81 ms at TB = 4 G / 8 G / 16 G; in a mini 8K prefill chunk 5.5 ms per call at
  4 G, against 12.2 ms for the kernel before, which took one token at a time: an M = 32
  product per token).
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
def _index_k_tile(kw_ptr, bt_ptr, r, j, valid, RPB, bt_r, bt_c, DI: tl.constexpr,
                  BN: tl.constexpr):
    """Dequantise the index-key records of logical rows j of request r -> bf16 [BN, DI].

    The records are read as int32 words (a 68-B record = 17 words), one scalar load per word:
    a record offset is only a multiple of 4 bytes, and nothing here lets the compiler assume
    more (RPB is not specialised, see _scores_kernel). Word w of the nibble area holds values
    8w .. 8w + 7 at bit offsets 0, 4, .., 28 (byte 4w + i // 2, low nibble = even value); the
    UE8M0 scale of value v (block v // 32 = w // 4) is byte w // 4 of the scale words."""
    NW: tl.constexpr = DI // 8
    RW: tl.constexpr = NW + DI // 128
    blk = tl.load(bt_ptr + r * bt_r + (j // RPB) * bt_c, mask=valid, other=0).to(tl.int64)
    row = (blk * RPB + j % RPB) * RW
    wi = tl.arange(0, NW)
    words = tl.load(kw_ptr + row[:, None] + wi[None, :], mask=valid[:, None], other=0)
    if NW == 16:
        sw = tl.load(kw_ptr + row + NW, mask=valid, other=0x7F7F7F7F)[:, None]
    else:
        sw = tl.load(kw_ptr + row[:, None] + NW + wi[None, :] // 16, mask=valid[:, None],
                     other=0x7F7F7F7F)
    e = (sw >> (((wi // 4) % 4) * 8)[None, :]) & 255  # [BN, NW] scale byte of each word
    sc = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
    sc = tl.where(e == 255, float("nan"), sc)
    nib = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 15
    kv = e2m1_value(nib) * sc[:, :, None]  # exact: e2m1 * 2^e
    return tl.reshape(kv, (BN, DI)).to(tl.bfloat16)


@triton.jit(do_not_specialize=["RPB"])
def _scores_kernel(q_ptr, w_ptr, kw_ptr, bt_ptr, req_ptr, nv_ptr, o_ptr, T, H, N, RPB, sq_t,
                   sq_h, sq_d, sw_t, sw_h, bt_r, bt_c, HP: tl.constexpr, DI: tl.constexpr,
                   BN: tl.constexpr, TB: tl.constexpr, G: tl.constexpr):
    """One program per (block of TB tokens, tile of BN rows), the tokens taken G at a time:
    G tokens x HP heads are the M = G * HP rows of one q . k^T product on the matrix unit
    (fp32 sums of exact bf16 products), then relu, the head-weighted sum per token and the
    visibility mask. A tile no token of the block sees is stored as -inf without a product (a
    prefill chunk's causal upper triangle). The key tile is dequantised once per request met
    in the block (a prefill chunk: once) and covers the rows visible to any of that request's
    tokens in the block (the block table is allocated that far); a group whose G tokens span
    several requests takes one product per request, each storing its own tokens' rows. Every
    token goes through the same [G * HP, DI] x [DI, BN] product whatever TB and the batch, so
    its logits do not depend on the batch (TB only sets how many tokens share a key tile).

    RPB must not be specialised: Triton's axis analysis gives blk * RPB + j % RPB the
    divisibility of RPB when RPB % 16 == 0 (although the sum is not a multiple of 16), then
    emits 16-byte vector loads at 68-byte record offsets: the "misaligned address" fault."""
    t0 = tl.program_id(0).to(tl.int64) * TB
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    jmask = j < N
    tt = t0 + tl.arange(0, TB)
    req_v = tl.load(req_ptr + tt, mask=tt < T, other=-1).to(tl.int64)
    nv_v = tl.load(nv_ptr + tt, mask=tt < T, other=0)
    hh = tl.arange(0, HP)
    hmask = hh < H
    dd = tl.arange(0, DI)
    if tl.program_id(1) * BN >= tl.max(nv_v, axis=0):  # no token of the block sees the tile
        ninf = tl.full((TB, BN), float("-inf"), tl.float32)
        tl.store(o_ptr + tt[:, None] * N + j[None, :], ninf,
                 mask=(tt < T)[:, None] & jmask[None, :])
    else:
        r_cur = tl.full((), -1, tl.int64)
        k = tl.zeros((BN, DI), dtype=tl.bfloat16)
        gi = tl.arange(0, G)
        q_off = gi[:, None, None] * sq_t + hh[None, :, None] * sq_h + dd[None, None, :] * sq_d
        for g in range(TB // G):
            tg0 = t0 + g * G  # int64 bases, int32 offsets within the group (registers)
            tg = tg0 + gi
            gmask = tg < T
            rg = tl.load(req_ptr + tg, mask=gmask, other=-1).to(tl.int64)
            nvg = tl.load(nv_ptr + tg, mask=gmask, other=0)
            pending = gmask
            while tl.max(pending.to(tl.int32), axis=0) > 0:
                r = tl.max(tl.where(pending, rg, -1), axis=0)
                if r != r_cur:
                    nv_r = tl.max(tl.where(req_v == r, nv_v, 0), axis=0)
                    k = _index_k_tile(kw_ptr, bt_ptr, r, j, (j < nv_r) & jmask, RPB, bt_r,
                                      bt_c, DI, BN)
                    r_cur = r
                sel = pending & (rg == r)
                q = tl.load(q_ptr + tg0 * sq_t + q_off,
                            mask=sel[:, None, None] & hmask[None, :, None], other=0.0)
                sc = tl.dot(tl.reshape(q, (G * HP, DI)), tl.trans(k))  # [G * HP, BN] fp32
                w = tl.load(w_ptr + tg0 * sw_t + gi[:, None] * sw_t + hh[None, :] * sw_h,
                            mask=sel[:, None] & hmask[None, :], other=0.0).to(tl.float32)
                sc = tl.reshape(tl.maximum(sc, 0.0), (G, HP, BN)) * w[:, :, None]
                logit = tl.sum(sc, axis=1)  # [G, BN]
                logit = tl.where(j[None, :] < nvg[:, None], logit, float("-inf"))
                tl.store(o_ptr + tg0 * N + gi[:, None] * N + j[None, :], logit,
                         mask=sel[:, None] & jmask[None, :])
                pending = pending & (rg != r)


SCORE_ROWS = 64  # tokens x heads per q . k^T product (G = SCORE_ROWS / HP tokens; sm_90 build
# at HP = 32, BN = 64, 8 warps: no spills, where 128 rows spill 200-600 B per thread)


def _supports_scores(*, q: torch.Tensor, k_cache: torch.Tensor, **_) -> bool:
    d = q.shape[-1]
    return (on_device(q) and q.dim() == 3 and q.dtype == torch.bfloat16 and d in (128, 256)
            and q.shape[1] <= 128 and k_cache.dtype == torch.uint8 and k_cache.dim() == 2
            and k_cache.stride(1) == 1 and k_cache.stride(0) == d // 2 + d // 32
            and k_cache.data_ptr() % 4 == 0)


def index_scores_tuned(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                       block_table: torch.Tensor, req: torch.Tensor, n_visible: torch.Tensor,
                       num_rows: int, rows_per_block: int, *, tb: int | None = None,
                       bn: int = 64, num_warps: int | None = None) -> torch.Tensor:
    """The op with its tiling exposed: tb tokens per program (rounded up to a multiple of the
    group size G = SCORE_ROWS / HP tokens; each key tile is reused by the block's tokens of its
    request; None = G for decode-sized T, else 16 G), bn rows per tile."""
    t, h, d = q.shape
    out = torch.empty(t, num_rows, dtype=torch.float32, device=q.device)
    if t == 0 or num_rows == 0:
        return out.fill_(float("-inf"))
    hp = max(16, triton.next_power_of_2(h))
    grp = max(1, SCORE_ROWS // hp)
    if tb is None:
        tb = grp if t <= 64 else 16 * grp
    tb = triton.cdiv(tb, grp) * grp
    if num_warps is None:
        num_warps = 8
    kw = k_cache.view(torch.int32)  # [rows, record / 4]; records are 4-byte aligned
    _scores_kernel[(triton.cdiv(t, tb), triton.cdiv(num_rows, bn))](
        q, weights, kw, block_table, req, n_visible, out, t, h, num_rows, rows_per_block,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        block_table.stride(0), block_table.stride(1), HP=hp, DI=d, BN=bn, TB=tb, G=grp,
        num_warps=num_warps)
    return out


@REGISTRY.implement("triton", "index_scores", supports=_supports_scores)
def index_scores(*, q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                 block_table: torch.Tensor, req: torch.Tensor, n_visible: torch.Tensor,
                 num_rows: int, rows_per_block: int) -> torch.Tensor:
    """logit[t, j] = sum_h w[t, h] * relu(q[t, h] . k_j) -> [T, num_rows] fp32 (-inf if not
    visible); k_j dequantised from the request's paged MXFP4 records (Di = 128 or 256, whose
    records are whole int32 words)."""
    return index_scores_tuned(q, weights, k_cache, block_table, req, n_visible, num_rows,
                              rows_per_block)


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
