"""The D-chunked sparse-attention kernel (`sparse_attn(variant="chunked")` in attention.py, the
registered op's kernel at D >= 128; same records, partition and numerics as the "flat" kernel
there, whose docstring has them).

D in 4 chunks of D/4: the score dot sums 4 chunk dots, P.V updates 4 [H, D/4] accumulators (or
DSPLIT programs own 4/DSPLIT of them: the column groups). p_mem=True passes P and the rescale
factors through a small per-program scratch so Triton does not treat score and P.V dots as a
chain: a chained dot gets warps [num_warps, 1], and with M = 64 heads and 8 warps both
warpgroups then compute the same scores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shoal.ops.triton.pdl import pdl_wait


@triton.jit
def _e2m1_pair(b):
    """Bytes b (int32 0..255, two e2m1 codes, low nibble first) -> (low, high) code values *
    2^-14 as fp32, exactly: one multiply places the byte twice so that the low and high
    codes' sign bits land on the sign bits of an fp16 pair (15, 31), another so that their
    magnitudes land on its exponent-and-mantissa bits (9-11, 25-27: e2m1's subnormal 0.5 is
    fp16's subnormal 2^-15), two masks merge them, and the hardware widens each half. The
    per-field decode with selects it replaced took ~10 integer ops per code (sm_90 SASS of the
    chunked kernel's compressed-row loop: 4984 -> 2085 instructions per 64-row block)."""
    t = b * 0x01001000  # the byte at bits 12 and 24 (disjoint: the sum is an or)
    u = b * 0x00200200  # the byte at bits 9 and 21
    h2 = (t & -2147450880) | (u & 0x0E000E00)  # -2147450880 = 0x80008000
    lo = h2.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h2 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _ue8m0(e):
    """int32 UE8M0 byte -> fp32 2^(e - 127) (byte 0 -> 2^-127)."""
    return tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _swa_chunk(swa_ptr, row, valid, c0, BLOCK_N: tl.constexpr, DC: tl.constexpr,
               D: tl.constexpr):
    """SWA records (row byte offsets [N]) at columns c0 .. c0 + DC -> bf16 [N, DC]; each
    UE8M0 byte is loaded once and broadcast over its 32 columns."""
    codes = tl.load(swa_ptr + row[:, None] + c0 + tl.arange(0, DC)[None, :],
                    mask=valid[:, None], other=0)
    e = tl.load(swa_ptr + row[:, None] + D + c0 // 32 + tl.arange(0, DC // 32)[None, :],
                mask=valid[:, None], other=127)
    v = tl.reshape(codes.to(tl.float8e4nv, bitcast=True).to(tl.float32),
                   (BLOCK_N, DC // 32, 32))
    return tl.reshape(v * _ue8m0(e.to(tl.int32))[:, :, None], (BLOCK_N, DC)).to(tl.bfloat16)


@triton.jit
def _comp_chunk(comp_ptr, row, valid, c0, BLOCK_N: tl.constexpr, DC: tl.constexpr,
                D: tl.constexpr):
    """Compressed records at columns c0 .. c0 + DC -> bf16 [N, DC]; each e4m3 scale byte is
    loaded once and broadcast over its 16 columns."""
    packed = tl.load(comp_ptr + row[:, None] + c0 // 2 + tl.arange(0, DC // 2)[None, :],
                     mask=valid[:, None], other=0).to(tl.int32)
    lo, hi = _e2m1_pair(packed)
    v = tl.reshape(tl.join(lo, hi), (BLOCK_N, DC // 16, 16))
    sb = tl.load(comp_ptr + row[:, None] + D // 2 + c0 // 16 + tl.arange(0, DC // 16)[None, :],
                 mask=valid[:, None], other=0)
    sc = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0  # undoes the 2^-14
    return tl.reshape(v * sc[:, :, None], (BLOCK_N, DC)).to(tl.bfloat16)


@triton.jit
def _kchunk(kptr, row, valid, c0, COMP: tl.constexpr, BLOCK_N: tl.constexpr,
            DC: tl.constexpr, D: tl.constexpr):
    if COMP:
        k = _comp_chunk(kptr, row, valid, c0, BLOCK_N, DC, D)
    else:
        k = _swa_chunk(kptr, row, valid, c0, BLOCK_N, DC, D)
    return k


@triton.jit
def _chunked_step(q_base, q0, q1, q2, q3, hmask, kptr, row, valid, m_i, l_i, acc0, acc1, acc2,
                  acc3, scale, c_own, p_scr, a_scr, COMP: tl.constexpr, HP: tl.constexpr,
                  BLOCK_N: tl.constexpr, D: tl.constexpr, NACC: tl.constexpr,
                  KEEP_K: tl.constexpr, P_MEM: tl.constexpr, Q_RES: tl.constexpr):
    """One block of BLOCK_N keys: s = q . k^T accumulated over 4 column chunks of D / 4 (the
    key tile is never materialised whole), the online-softmax update, then acc_i += p . k
    over this program's NACC output chunks c_own .. c_own + NACC - 1. The q chunks are
    q0 .. q3 (Q_RES: loaded once per program) or loaded here from q_base (an L1/L2 hit).
    KEEP_K: reuse the
    chunks of the score pass, NACC = 4 only; else dequantise them again: an L1 hit).

    P_MEM: P and the rescale factors reach the P.V dots through this program's global scratch
    (p_scr [HP, BLOCK_N] bf16, a_scr [HP] fp32; L1/L2-resident, fenced by CTA barriers), and
    the four score dots are summed instead of chained. Otherwise Triton sees a score dot
    feeding another dot and lays its warps all along M ([num_warps, 1]): with M = 64 heads
    and 8 warps both warpgroups then compute the same scores. Unchained, the score dots get a
    [4, 2] split (no duplicate matrix work)."""
    DC: tl.constexpr = D // 4
    k0 = _kchunk(kptr, row, valid, 0, COMP, BLOCK_N, DC, D)
    if not Q_RES:
        q0 = tl.load(q_base, mask=hmask[:, None], other=0.0)
    if P_MEM:  # unchained: Triton folds dot + dot into a chain, a scaled dot it cannot fold
        s = tl.dot(q0, tl.trans(k0)) * scale
    else:
        s = tl.dot(q0, tl.trans(k0))
    k1 = _kchunk(kptr, row, valid, DC, COMP, BLOCK_N, DC, D)
    if not Q_RES:
        q1 = tl.load(q_base + DC, mask=hmask[:, None], other=0.0)
    if P_MEM:
        s += tl.dot(q1, tl.trans(k1)) * scale
    else:
        s = tl.dot(q1, tl.trans(k1), s)
    k2 = _kchunk(kptr, row, valid, 2 * DC, COMP, BLOCK_N, DC, D)
    if not Q_RES:
        q2 = tl.load(q_base + 2 * DC, mask=hmask[:, None], other=0.0)
    if P_MEM:
        s += tl.dot(q2, tl.trans(k2)) * scale
    else:
        s = tl.dot(q2, tl.trans(k2), s)
    k3 = _kchunk(kptr, row, valid, 3 * DC, COMP, BLOCK_N, DC, D)
    if not Q_RES:
        q3 = tl.load(q_base + 3 * DC, mask=hmask[:, None], other=0.0)
    if P_MEM:
        s += tl.dot(q3, tl.trans(k3)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
    else:
        s = tl.dot(q3, tl.trans(k3), s)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
    new_m = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - new_m)
    p = tl.exp(s - new_m[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(tl.bfloat16)
    if P_MEM:
        offs_h = tl.arange(0, HP)
        p_ptrs = p_scr + offs_h[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.debug_barrier()  # the previous block's reads of the scratch are done
        tl.store(p_ptrs, p)
        tl.store(a_scr + offs_h, alpha)
        tl.debug_barrier()
        p = tl.load(p_ptrs)
        alpha = tl.load(a_scr + offs_h)
    if KEEP_K:
        acc0 = tl.dot(p, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(p, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(p, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(p, k3, acc3 * alpha[:, None])
    else:
        acc0 = tl.dot(p, _kchunk(kptr, row, valid, c_own * DC, COMP, BLOCK_N, DC, D),
                      acc0 * alpha[:, None])
        if NACC > 1:
            acc1 = tl.dot(p, _kchunk(kptr, row, valid, (c_own + 1) * DC, COMP, BLOCK_N, DC, D),
                          acc1 * alpha[:, None])
        if NACC > 2:
            acc2 = tl.dot(p, _kchunk(kptr, row, valid, (c_own + 2) * DC, COMP, BLOCK_N, DC, D),
                          acc2 * alpha[:, None])
            acc3 = tl.dot(p, _kchunk(kptr, row, valid, (c_own + 3) * DC, COMP, BLOCK_N, DC, D),
                          acc3 * alpha[:, None])
    return new_m, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _store_chunk(acc, c, l_i, m_i, denom, t, split, offs_h, hmask, o_ptr, part_ptr,
                 H: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr):
    DC: tl.constexpr = D // 4
    cols = c * DC + tl.arange(0, DC)
    if NSPLIT == 1:
        tl.store(o_ptr + t * H * D + offs_h[:, None] * D + cols[None, :],
                 (acc / denom[:, None]).to(tl.bfloat16), mask=hmask[:, None])
    else:
        base = (t * NSPLIT + split) * H
        tl.store(part_ptr + (base + offs_h[:, None]) * D + cols[None, :], acc,
                 mask=hmask[:, None])


@triton.jit
def _sparse_attn_chunked_kernel(q_ptr, swa_ptr, swa_idx_ptr, comp_ptr, comp_idx_ptr, sink_ptr,
                                o_ptr, part_ptr, ml_ptr, n_swa, n_comp, per, scale, stride_qt,
                                stride_qh, stride_si, stride_ci, scr_ptr, H: tl.constexpr,
                                HP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                                NSPLIT: tl.constexpr, DSPLIT: tl.constexpr,
                                HAS_COMP: tl.constexpr, KEEP_K: tl.constexpr,
                                P_MEM: tl.constexpr, Q_RES: tl.constexpr):
    """Grid (T, NSPLIT, DSPLIT): program (t, split, dpart) scores all heads of token t (M =
    HP) against its share of the index blocks and owns output chunks dpart * NACC ..
    (dpart + 1) * NACC - 1 of the 4 chunks of D / 4 (DSPLIT > 1 recomputes the scores in every
    D part: more matrix work, fewer registers). Same numerics as _sparse_attn_kernel."""
    pdl_wait()
    DC: tl.constexpr = D // 4
    NACC: tl.constexpr = 4 // DSPLIT
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    c_own = tl.program_id(2) * NACC
    offs_h = tl.arange(0, HP)
    hmask = offs_h < H
    offs_n = tl.arange(0, BLOCK_N)
    q_base = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + tl.arange(0, DC)[None, :]
    nb_swa = tl.cdiv(n_swa, BLOCK_N)
    nb = nb_swa
    if HAS_COMP:
        nb += tl.cdiv(n_comp, BLOCK_N)
    b0 = split * per  # per: index blocks per split (the host's partition)
    b1 = tl.minimum(b0 + per, nb)
    m_i = tl.full((HP,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((HP,), dtype=tl.float32)
    acc0 = tl.zeros((HP, DC), dtype=tl.float32)
    acc1 = tl.zeros((HP, DC), dtype=tl.float32)
    acc2 = tl.zeros((HP, DC), dtype=tl.float32)
    acc3 = tl.zeros((HP, DC), dtype=tl.float32)
    # P_MEM scratch of this program: HP * BLOCK_N bf16 (P), then HP fp32 (alpha)
    pid = (t * NSPLIT + split) * DSPLIT + tl.program_id(2)
    p_scr = scr_ptr + pid * (HP * BLOCK_N + 2 * HP)
    a_scr = (p_scr + HP * BLOCK_N).to(tl.pointer_type(tl.float32), bitcast=True)
    q0, q1, q2, q3 = 0, 0, 0, 0  # Q_RES: the q chunks, loaded once per program
    if Q_RES:
        q0 = tl.load(q_base, mask=hmask[:, None], other=0.0)
        q1 = tl.load(q_base + DC, mask=hmask[:, None], other=0.0)
        q2 = tl.load(q_base + 2 * DC, mask=hmask[:, None], other=0.0)
        q3 = tl.load(q_base + 3 * DC, mask=hmask[:, None], other=0.0)
    swa_rec: tl.constexpr = D + D // 32
    for b in range(b0, tl.minimum(b1, nb_swa)):
        n = b * BLOCK_N + offs_n
        idx = tl.load(swa_idx_ptr + t * stride_si + n, mask=n < n_swa, other=-1)
        valid = idx >= 0
        row = tl.maximum(idx, 0).to(tl.int64) * swa_rec
        m_i, l_i, acc0, acc1, acc2, acc3 = _chunked_step(
            q_base, q0, q1, q2, q3, hmask, swa_ptr, row, valid, m_i, l_i, acc0, acc1, acc2,
            acc3, scale, c_own, p_scr, a_scr, False, HP, BLOCK_N, D, NACC, KEEP_K, P_MEM, Q_RES)
    if HAS_COMP:
        comp_rec: tl.constexpr = D // 2 + D // 16
        for b in range(tl.maximum(b0, nb_swa), b1):
            n = (b - nb_swa) * BLOCK_N + offs_n
            idx = tl.load(comp_idx_ptr + t * stride_ci + n, mask=n < n_comp, other=-1)
            valid = idx >= 0
            row = tl.maximum(idx, 0).to(tl.int64) * comp_rec
            m_i, l_i, acc0, acc1, acc2, acc3 = _chunked_step(
                q_base, q0, q1, q2, q3, hmask, comp_ptr, row, valid, m_i, l_i, acc0, acc1,
                acc2, acc3, scale, c_own, p_scr, a_scr, True, HP, BLOCK_N, D, NACC, KEEP_K,
                P_MEM, Q_RES)
    denom = l_i
    if NSPLIT == 1:
        denom = l_i + tl.exp(tl.load(sink_ptr + offs_h, mask=hmask, other=0.0) - m_i)
    else:
        base = (t * NSPLIT + split) * H
        tl.store(ml_ptr + (base + offs_h) * 2, m_i, mask=hmask)
        tl.store(ml_ptr + (base + offs_h) * 2 + 1, l_i, mask=hmask)
    _store_chunk(acc0, c_own, l_i, m_i, denom, t, split, offs_h, hmask, o_ptr, part_ptr, H, D,
                 NSPLIT)
    if NACC > 1:
        _store_chunk(acc1, c_own + 1, l_i, m_i, denom, t, split, offs_h, hmask, o_ptr,
                     part_ptr, H, D, NSPLIT)
    if NACC > 2:
        _store_chunk(acc2, c_own + 2, l_i, m_i, denom, t, split, offs_h, hmask, o_ptr,
                     part_ptr, H, D, NSPLIT)
        _store_chunk(acc3, c_own + 3, l_i, m_i, denom, t, split, offs_h, hmask, o_ptr,
                     part_ptr, H, D, NSPLIT)
