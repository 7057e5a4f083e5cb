"""Triton (sm_90) indexer ops (model.md §2.7): `index_q_quant` (MXFP4 QDQ), `index_scores`
over paged MXFP4 index-key records, and the exact selections `topk_rows` and `candidate_mask`.

- index_q_quant: one program per (token, head) row; the shared bit-exact MXFP4 encoder.
- index_scores: one program per (block of TB tokens, 64-row tile): records are gathered
  through the block table as int32 words (a 68-B record is 17 words; record offsets are only
  4-byte aligned, so every load is one scalar word) and dequantised to bf16 in registers
  (e2m1 * 2^e is exact); the tile then serves the block's tokens of its request in turn
  (prefill: TB tokens per dequantised tile): q . k on the matrix unit (fp32 accumulation),
  relu, the head-weighted sum and the visibility mask, rounded to bf16 where the reference
  rounds (the dot, the weighted ReLU, the head sum). TB = 1 for decode-sized batches, 32 for
  prefill (was 8); tiles above every token of a block (the causal triangle of a prefill chunk)
  are stored as -inf unread. Not kept: 64 / HP tokens x heads as the rows of one wgmma product
  (faster prefill, slower decode: 8 warps at 255 registers hold one program per SM).
  (measurements: docs/perf/indexer.md)
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
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait


@triton.jit
def _qquant_kernel(q_ptr, o_ptr, H, sq_t, sq_h, sq_d, DI: tl.constexpr):
    pdl_wait()
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
                                 num_warps=1, **PDL_LAUNCH)
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


@triton.jit
def _score_token(q_ptr, w_ptr, o_ptr, k, t, nv, j, H, N, sq_t, sq_h, sq_d, sw_t, sw_h,
                 HP: tl.constexpr, DI: tl.constexpr):
    """Logits of token t against the key tile k [BN, DI] (rows j), stored to o[t, j]."""
    hh = tl.arange(0, HP)
    hmask = hh < H
    q = tl.load(q_ptr + t * sq_t + hh[:, None] * sq_h + tl.arange(0, DI)[None, :] * sq_d,
                mask=hmask[:, None], other=0.0)
    # the official code's bf16 rounding points: the per-head dot, the weighted ReLU, the head sum
    s = tl.maximum(tl.dot(q, tl.trans(k)).to(tl.bfloat16).to(tl.float32), 0.0)  # [HP, BN]
    w = tl.load(w_ptr + t * sw_t + hh * sw_h, mask=hmask, other=0.0).to(tl.float32)
    logit = tl.sum((s * w[:, None]).to(tl.bfloat16).to(tl.float32), axis=0)
    logit = logit.to(tl.bfloat16).to(tl.float32)
    logit = tl.where(j < nv, logit, float("-inf"))
    tl.store(o_ptr + t * N + j, logit, mask=j < N)


@triton.jit(do_not_specialize=["RPB"])
def _scores_kernel(q_ptr, w_ptr, kw_ptr, bt_ptr, req_ptr, nv_ptr, o_ptr, T, H, N, RPB, sq_t,
                   sq_h, sq_d, sw_t, sw_h, bt_r, bt_c, HP: tl.constexpr, DI: tl.constexpr,
                   BN: tl.constexpr, TB: tl.constexpr):
    """One program per (block of TB tokens, tile of BN rows). The key tile is dequantised
    once per request met in the token block (a prefill chunk: once) and feeds the tokens in
    turn; it covers the rows visible to any token of that request in the block (the block
    table is allocated that far), each token masks its own. A tile no token of the block sees
    (a prefill chunk's causal upper triangle) is stored as -inf without being read. TB only
    groups tokens: each token's product is the same [HP, DI] x [DI, BN] one whatever TB and
    the batch (batch invariance).

    RPB must not be specialised: Triton's axis analysis gives blk * RPB + j % RPB the
    divisibility of RPB when RPB % 16 == 0 (although the sum is not a multiple of 16), then
    emits 16-byte vector loads at 68-byte record offsets: the "misaligned address" fault."""
    pdl_wait()
    t0 = tl.program_id(0).to(tl.int64) * TB
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    tt = t0 + tl.arange(0, TB)
    req_v = tl.load(req_ptr + tt, mask=tt < T, other=-1).to(tl.int64)
    nv_v = tl.load(nv_ptr + tt, mask=tt < T, other=0)
    if tl.program_id(1) * BN >= tl.max(nv_v, axis=0):  # no token of the block sees the tile
        ninf = tl.full((TB, BN), float("-inf"), tl.float32)
        tl.store(o_ptr + tt[:, None] * N + j[None, :], ninf,
                 mask=(tt < T)[:, None] & (j < N)[None, :])
    else:
        r_cur = tl.full((), -1, tl.int64)
        k = tl.zeros((BN, DI), dtype=tl.bfloat16)
        for i in range(TB):
            t = t0 + i
            if t < T:
                r = tl.load(req_ptr + t).to(tl.int64)
                if r != r_cur:
                    nv_r = tl.max(tl.where(req_v == r, nv_v, 0), axis=0)
                    k = _index_k_tile(kw_ptr, bt_ptr, r, j, (j < nv_r) & (j < N), RPB, bt_r,
                                      bt_c, DI, BN)
                    r_cur = r
                _score_token(q_ptr, w_ptr, o_ptr, k, t, tl.load(nv_ptr + t), j, H, N, sq_t,
                             sq_h, sq_d, sw_t, sw_h, HP, DI)


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
    """The op with its tiling exposed (tb: tokens per program, each key tile is reused by the
    block's tokens of its request; None = 1 for decode-sized T, else 32)."""
    t, h, d = q.shape
    out = torch.empty(t, num_rows, dtype=torch.float32, device=q.device)
    if t == 0 or num_rows == 0:
        return out.fill_(float("-inf"))
    hp = max(16, triton.next_power_of_2(h))
    if tb is None:
        tb = 1 if t <= 64 else 32
    if num_warps is None:
        # one count for every T: the head sum's order follows the [HP, BN] layout, which
        # depends on the warps (on the H200, 4 warps for decode and 8 for prefill gave a
        # token different bits alone and inside a chunk); sm_90 builds without spills at
        # (TB, BN) = (1, 64) and (32, 64) with 8 warps
        num_warps = 8
    kw = k_cache.view(torch.int32)  # [rows, record / 4]; records are 4-byte aligned
    _scores_kernel[(triton.cdiv(t, tb), triton.cdiv(num_rows, bn))](
        q, weights, kw, block_table, req, n_visible, out, t, h, num_rows, rows_per_block,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        block_table.stride(0), block_table.stride(1), HP=hp, DI=d, BN=bn, TB=tb,
        num_warps=num_warps, **PDL_LAUNCH)
    return out


@REGISTRY.implement("triton", "index_scores", supports=_supports_scores)
def index_scores(*, q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                 block_table: torch.Tensor, req: torch.Tensor, n_visible: torch.Tensor,
                 num_rows: int, rows_per_block: int) -> torch.Tensor:
    """logit[t, j] = sum_h w[t, h] * relu(q[t, h] . k_j) -> [T, num_rows] fp32 holding bf16
    values, rounded as the reference (-inf if not visible); k_j dequantised from the request's
    paged MXFP4 records (Di = 128 or 256, whose records are whole int32 words)."""
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
    pdl_wait()
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
                             KP=triton.next_power_of_2(k), BSP=1, num_warps=4, **PDL_LAUNCH)
    return out


@triton.jit
def _block_score_kernel(x_ptr, nv_ptr, o_ptr, W, NB, BS, sx_t, sx_w, BB: tl.constexpr,
                        BSP: tl.constexpr):
    pdl_wait()
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
            BB=bb, BSP=bsp, num_warps=4, **PDL_LAUNCH)
        _select_kernel[(t,)](scores, n_visible, out, nb, min(topk_blocks, nb), block_size, w,
                             nb, 1, w, MASK_MODE=True,
                             BLOCK=min(1024, triton.next_power_of_2(nb)), KP=1, BSP=bsp,
                             num_warps=4, **PDL_LAUNCH)
    return out.view(torch.bool)
