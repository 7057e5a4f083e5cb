"""Triton (sm_90) sparse MQA with sink over quantised KV records (`sparse_attn_sink`).

One program owns one query token and all H heads (MQA: the heads share K = V, so the head axis
is the matrix-unit M dimension) and a contiguous range of the 64-index blocks of its
concatenated index list (SWA indices, then compressed ones), as the reference blocks it: where
the SWA list's length is not a multiple of 64, one block takes rows of both pools (the flat
kernel; the chunked one takes lists whose SWA length is, and the op falls back to flat
otherwise). Records are read directly and dequantised in registers to bf16 (exact):
- SWA record: D e4m3 bytes + D/32 UE8M0 bytes -> e4m3 * 2^(e - 127);
- compressed record: D/2 bytes of e2m1 pairs (low nibble = even dim) + D/16 e4m3 scales ->
  e2m1 value (its bits placed as an fp16, widened) * e4m3 scale (<= 6 significant bits: exact
  in bf16).
Scores are fp32 (bf16 x bf16 wgmma), P is rounded to bf16 before P.V, as in the reference.

Decode-sized steps (<= DECODE_MAX_TOKENS rows) split each token's index blocks into groups of
BLOCKS_PER_SPLIT, one program each, and a combine pass merges the fp32 partials (m, l, acc) in
split order and adds the sink. The partition depends only on the token's own index lists, so a
decode row's bits do not depend on the batch size, on other requests' index widths or on a
CUDA graph's padded context bound (trailing padded blocks are empty splits: exact zeros). Larger
steps (NSPLIT = 1) finish each row in one program (no combine pass): a second family, whose
bits differ from the decode family's in P's bf16 rounding.

Two kernels (sparse_attn(variant=...); OP_KNOBS picks the registered op's):
- "flat" (_sparse_attn_kernel): the whole [BLOCK_N, D] key tile dequantised at once, q
  resident. At 64 heads x 512 (8 warps) ptxas spills ~880 B/thread (sm_90 static count) and
  the score dot is computed twice (see below).
- "chunked" (attention_chunked.py): D in 4 chunks of D/4, the op's kernel at D >= 128.

Deviation from the reference (within its bf16 tolerance): P is rounded to bf16 relative to the
running max *of its split* (the reference: of the whole row so far), and exp is the fast
hardware exp2; chunked with p_mem scales each chunk's scores before summing them. All change
P's bf16 rounding or fp32 summation order only.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.attention_chunked import _e2m1_pair, _sparse_attn_chunked_kernel
from shoal.ops.triton.attention_combine import combine
from shoal.ops.triton.device import sm_count
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait


@triton.jit
def _swa_keys(swa_ptr, row, valid, cols, D: tl.constexpr):
    """Dequantise SWA records (row byte offsets [N]) at columns cols -> bf16 [N, len(cols)]."""
    codes = tl.load(swa_ptr + row[:, None] + cols[None, :], mask=valid[:, None], other=0)
    e = tl.load(swa_ptr + row[:, None] + D + cols[None, :] // 32, mask=valid[:, None], other=127)
    sc = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(tl.bfloat16)


@triton.jit
def _swa_keys_bcast(swa_ptr, row, valid, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """As _swa_keys over all D columns, loading each scale byte once and broadcasting it."""
    codes = tl.load(swa_ptr + row[:, None] + tl.arange(0, D)[None, :], mask=valid[:, None],
                    other=0)
    e = tl.load(swa_ptr + row[:, None] + D + tl.arange(0, D // 32)[None, :],
                mask=valid[:, None], other=127)
    sc = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    v = tl.reshape(codes.to(tl.float8e4nv, bitcast=True).to(tl.float32), (BLOCK_N, D // 32, 32))
    return tl.reshape(v * sc[:, :, None], (BLOCK_N, D)).to(tl.bfloat16)


@triton.jit
def _comp_keys(comp_ptr, row, valid, col0, BLOCK_N: tl.constexpr, NCOL: tl.constexpr,
               D: tl.constexpr):
    """Dequantise compressed records at columns col0 .. col0 + NCOL -> bf16 [N, NCOL]."""
    pcols = col0 // 2 + tl.arange(0, NCOL // 2)
    packed = tl.load(comp_ptr + row[:, None] + pcols[None, :], mask=valid[:, None],
                     other=0).to(tl.int32)
    lo, hi = _e2m1_pair(packed)
    v = tl.reshape(tl.join(lo, hi), (BLOCK_N, NCOL))
    cols = col0 + tl.arange(0, NCOL)
    sb = tl.load(comp_ptr + row[:, None] + D // 2 + cols[None, :] // 16, mask=valid[:, None],
                 other=0)
    sc = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0  # undoes the 2^-14
    return (v * sc).to(tl.bfloat16)


@triton.jit
def _softmax_step(s, valid, m_i, l_i, acc, scale):
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    new_m = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - new_m)
    p = tl.exp(s - new_m[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return new_m, l_i, acc * alpha[:, None], p.to(tl.bfloat16)


@triton.jit
def _sparse_attn_kernel(q_ptr, swa_ptr, swa_idx_ptr, comp_ptr, comp_idx_ptr, sink_ptr, o_ptr,
                        part_ptr, ml_ptr, n_swa, n_comp, per, scale, stride_qt, stride_qh,
                        stride_si, stride_ci, H: tl.constexpr, HP: tl.constexpr,
                        D: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr,
                        DSPLIT: tl.constexpr, HAS_COMP: tl.constexpr, Q_IN_LOOP: tl.constexpr,
                        SCALE_BCAST: tl.constexpr):
    pdl_wait()
    DV: tl.constexpr = D // DSPLIT  # output columns owned by this program
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    dv0 = tl.program_id(2) * DV
    offs_h = tl.arange(0, HP)  # heads padded to a matrix-unit friendly size
    hmask = offs_h < H
    offs_d = tl.arange(0, D)
    offs_v = dv0 + tl.arange(0, DV)
    offs_n = tl.arange(0, BLOCK_N)
    q_ptrs = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=hmask[:, None], other=0.0)
    # blocks of BLOCK_N positions of the concatenated list (SWA, then compressed): SWA-only
    # blocks, the block across the boundary when n_swa is not a multiple of BLOCK_N, then
    # compressed-only blocks
    first_comp = tl.cdiv(n_swa, BLOCK_N)
    nb = first_comp
    swa_end = first_comp
    if HAS_COMP:
        nb = tl.cdiv(n_swa + n_comp, BLOCK_N)
        swa_end = n_swa // BLOCK_N
    b0 = split * per  # per: index blocks per split (the host's partition)
    b1 = tl.minimum(b0 + per, nb)
    m_i = tl.full((HP,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((HP,), dtype=tl.float32)
    acc = tl.zeros((HP, DV), dtype=tl.float32)
    swa_rec: tl.constexpr = D + D // 32
    comp_rec: tl.constexpr = D // 2 + D // 16
    for b in range(b0, tl.minimum(b1, swa_end)):
        n = b * BLOCK_N + offs_n
        idx = tl.load(swa_idx_ptr + t * stride_si + n, mask=n < n_swa, other=-1)
        valid = idx >= 0
        row = tl.maximum(idx, 0).to(tl.int64) * swa_rec
        if SCALE_BCAST:
            k = _swa_keys_bcast(swa_ptr, row, valid, BLOCK_N, D)
        else:
            k = _swa_keys(swa_ptr, row, valid, offs_d, D)
        if Q_IN_LOOP:
            q = tl.load(q_ptrs, mask=hmask[:, None], other=0.0)
        m_i, l_i, acc, p = _softmax_step(tl.dot(q, tl.trans(k)), valid, m_i, l_i, acc, scale)
        if DSPLIT == 1:
            acc = tl.dot(p, k, acc)
        else:
            acc = tl.dot(p, _swa_keys(swa_ptr, row, valid, offs_v, D), acc)
    if HAS_COMP:
        for b in range(tl.maximum(b0, swa_end), tl.minimum(b1, first_comp)):  # (at most one)
            n = b * BLOCK_N + offs_n
            idx_s = tl.load(swa_idx_ptr + t * stride_si + n, mask=n < n_swa, other=-1)
            c = n - n_swa
            idx_c = tl.load(comp_idx_ptr + t * stride_ci + c, mask=(c >= 0) & (c < n_comp),
                            other=-1)
            valid_s, valid_c = idx_s >= 0, idx_c >= 0
            row_s = tl.maximum(idx_s, 0).to(tl.int64) * swa_rec
            row_c = tl.maximum(idx_c, 0).to(tl.int64) * comp_rec
            # each row from its own pool; the other pool's keys are exact zeros there
            k = (_swa_keys(swa_ptr, row_s, valid_s, offs_d, D)
                 + _comp_keys(comp_ptr, row_c, valid_c, 0, BLOCK_N, D, D))
            if Q_IN_LOOP:
                q = tl.load(q_ptrs, mask=hmask[:, None], other=0.0)
            m_i, l_i, acc, p = _softmax_step(tl.dot(q, tl.trans(k)), valid_s | valid_c, m_i,
                                             l_i, acc, scale)
            if DSPLIT == 1:
                acc = tl.dot(p, k, acc)
            else:
                acc = tl.dot(p, _swa_keys(swa_ptr, row_s, valid_s, offs_v, D)
                             + _comp_keys(comp_ptr, row_c, valid_c, dv0, BLOCK_N, DV, D), acc)
        for b in range(tl.maximum(b0, first_comp), b1):
            n = b * BLOCK_N + offs_n - n_swa
            idx = tl.load(comp_idx_ptr + t * stride_ci + n, mask=n < n_comp, other=-1)
            valid = idx >= 0
            row = tl.maximum(idx, 0).to(tl.int64) * comp_rec
            k = _comp_keys(comp_ptr, row, valid, 0, BLOCK_N, D, D)
            if Q_IN_LOOP:
                q = tl.load(q_ptrs, mask=hmask[:, None], other=0.0)
            m_i, l_i, acc, p = _softmax_step(tl.dot(q, tl.trans(k)), valid, m_i, l_i, acc, scale)
            if DSPLIT == 1:
                acc = tl.dot(p, k, acc)
            else:
                acc = tl.dot(p, _comp_keys(comp_ptr, row, valid, dv0, BLOCK_N, DV, D), acc)
    if NSPLIT == 1:
        sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0)
        denom = l_i + tl.exp(sink - m_i)
        o = acc / denom[:, None]
        tl.store(o_ptr + t * H * D + offs_h[:, None] * D + offs_v[None, :], o.to(tl.bfloat16),
                 mask=hmask[:, None])
    else:
        base = (t * NSPLIT + split) * H
        tl.store(part_ptr + (base + offs_h[:, None]) * D + offs_v[None, :], acc,
                 mask=hmask[:, None])
        # every D-slice program computes the same m, l; they store identical values
        tl.store(ml_ptr + (base + offs_h) * 2, m_i, mask=hmask)
        tl.store(ml_ptr + (base + offs_h) * 2 + 1, l_i, mask=hmask)


# Decode-sized steps (at most this many tokens; a power of two, so a CUDA-graph batch padded to
# the next captured size stays on the same side) split each token's index blocks into groups of
# BLOCKS_PER_SPLIT, counted from the first block: a token's partition depends only on its own
# index lists (trailing padded blocks are empty splits, which add exact zeros in the combine),
# never on the batch size or on other requests' widths. Larger steps run each row in one program.
DECODE_MAX_TOKENS = 64
BLOCKS_PER_SPLIT = 2


def index_blocks(swa_idx: torch.Tensor, comp_idx: torch.Tensor | None, block_n: int = 64
                 ) -> int:
    """Index blocks of a row: blocks of the concatenated list (SWA, then compressed), as the
    reference's online softmax takes them."""
    return triton.cdiv(swa_idx.shape[1] + (comp_idx.shape[1] if comp_idx is not None else 0),
                       block_n)


def partition(num_tokens: int, num_blocks: int, split: int | None = None,
              invariant: bool = False, per: int = BLOCKS_PER_SPLIT) -> tuple[int, int]:
    """(splits, index blocks per split) for `num_tokens` rows of `num_blocks` blocks. split:
    that many splits over the row's blocks (tuning and tests); None: the op's fixed partition,
    `per` blocks per split for decode rows. invariant: the decode partition at every size, at
    least two splits (the last may be empty), so a row's bits depend neither on the number of
    rows nor on the batch's width."""
    if invariant:
        return max(2, triton.cdiv(num_blocks, per)), per
    if split is None:
        if num_tokens > DECODE_MAX_TOKENS or num_blocks <= per:
            return 1, max(num_blocks, 1)
        return triton.cdiv(num_blocks, per), per
    return split, max(triton.cdiv(num_blocks, split), 1)


def column_split(num_tokens: int, splits: int, device: torch.device) -> int:
    """Output-column groups per (token, split) for the chunked kernel: the most of 4, 2, 1 that
    keeps the programs within one per SM (each program is latency-bound; more of them overlap).
    Every group recomputes the scores, so above one wave they only cost. A row's bits do not
    depend on it (each column's sum and the scores are computed the same way).
    (measurements: docs/perf/attention.md)"""
    sms = sm_count(device)
    for groups in (4, 2):
        if num_tokens * splits * groups <= sms:
            return groups
    return 1


VARIANTS = ("flat", "chunked")
# The knobs the registered op runs with (D >= 128; smaller D always runs "flat"): the chunked
# kernel with p_mem (fastest at T >= 64, within 25% of the best variant at T = 1 and 16);
# keep_k and q_res exactly when one program owns all columns (None below; slower only at T = 1,
# where the op runs 4 column groups and keep_k needs one). Same bits either way (GPU test).
# (measurements and the variants tried: docs/perf/attention.md)
OP_KNOBS = MappingProxyType({"variant": "chunked", "p_mem": True, "keep_k": None,
                             "q_res": None})


def sparse_attn(q: torch.Tensor, swa_cache: torch.Tensor, swa_idx: torch.Tensor,
                comp_cache: torch.Tensor | None, comp_idx: torch.Tensor | None,
                sink: torch.Tensor, scale: float, *, variant: str = "flat",
                split: int | None = None, block_n: int = 64, num_warps: int = 8,
                num_stages: int = 1, dsplit: int | None = None, q_in_loop: bool = False,
                scale_bcast: bool = True, keep_k: bool | None = False, p_mem: bool = False,
                q_res: bool | None = False, invariant: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The op with tuning knobs exposed (split=None: the op's fixed partition, `partition`;
    invariant: its batch-invariant partition; out: a contiguous [T, H, D] bf16 to write).

    variant "flat": _sparse_attn_kernel (whole [BLOCK_N, D] key tile in registers, q resident;
    dsplit splits the P.V columns, q_in_loop reloads q per block, scale_bcast loads each scale
    byte once). variant "chunked": _sparse_attn_chunked_kernel (D in 4 chunks, D >= 128;
    dsplit in 1, 2, 4 output-chunk groups (None: `column_split`), keep_k (dsplit 1) keeps the score
    pass's key chunks for P.V instead of dequantising them again; None: whenever dsplit is 1),
    p_mem routes P through a scratch buffer (see attention_chunked._chunked_step), q_res loads
    q once per program instead of per block (None: with keep_k).
    Host-sync free: shapes only.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    t, h, d = q.shape
    if variant == "chunked" and comp_idx is not None and comp_idx.shape[1] \
            and swa_idx.shape[1] % block_n:
        variant = "flat"  # (only the flat kernel has the block across the pools' boundary)
    nb = index_blocks(swa_idx, comp_idx, block_n)
    split, per = (partition(t, nb, invariant=True) if invariant else partition(t, nb, split))
    if dsplit is None:
        dsplit = (column_split(t, split, q.device) if variant == "chunked" and d >= 128
                  and not keep_k else 1)
    if keep_k is None:  # decode each key chunk once whenever one program owns all columns
        keep_k = variant == "chunked" and dsplit == 1
    if q_res is None:
        q_res = bool(keep_k)
    if variant == "chunked" and (d < 128 or dsplit not in (1, 2, 4) or (keep_k and dsplit != 1)):
        raise ValueError(f"chunked: needs D >= 128, dsplit in (1, 2, 4), keep_k only with "
                         f"dsplit 1 (D={d}, dsplit={dsplit}, keep_k={keep_k})")
    if out is None:
        out = torch.empty(t, h, d, dtype=torch.bfloat16, device=q.device)
    if t == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    has_comp = comp_idx is not None and comp_idx.shape[1] > 0
    n_swa = swa_idx.shape[1]
    n_comp = comp_idx.shape[1] if has_comp else 0
    swa_idx = swa_idx.to(torch.int32)
    if swa_idx.stride(1) != 1:
        swa_idx = swa_idx.contiguous()
    if has_comp:
        comp_idx = comp_idx.to(torch.int32)
        if comp_idx.stride(1) != 1:
            comp_idx = comp_idx.contiguous()
    else:
        comp_idx, comp_cache = swa_idx, swa_cache  # unused
    sink = sink.float().contiguous()
    if split > 1:
        part = torch.empty(t, split, h, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(t, split, h, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out
    common = (q, swa_cache, swa_idx, comp_cache, comp_idx, sink, out, part, ml, n_swa, n_comp,
              per, float(scale), q.stride(0), q.stride(1), swa_idx.stride(0), comp_idx.stride(0))
    hp = max(16, triton.next_power_of_2(h))
    if variant == "flat":
        _sparse_attn_kernel[(t, split, dsplit)](
            *common, H=h, HP=hp, D=d, BLOCK_N=block_n, NSPLIT=split, DSPLIT=dsplit,
            HAS_COMP=has_comp, Q_IN_LOOP=q_in_loop, SCALE_BCAST=scale_bcast,
            num_warps=num_warps, num_stages=num_stages, **PDL_LAUNCH)
    else:
        scr = torch.empty(t * split * dsplit * (hp * block_n + 2 * hp) if p_mem else 1,
                          dtype=torch.bfloat16, device=q.device)
        _sparse_attn_chunked_kernel[(t, split, dsplit)](
            *common, scr, H=h, HP=hp, D=d, BLOCK_N=block_n, NSPLIT=split, DSPLIT=dsplit,
            HAS_COMP=has_comp, KEEP_K=keep_k, P_MEM=p_mem, Q_RES=q_res, num_warps=num_warps,
            num_stages=num_stages, **PDL_LAUNCH)
    if split > 1:
        combine(part, ml, sink, out)
    return out


def _supports(*, q: torch.Tensor, swa_cache: torch.Tensor, **_) -> bool:
    t, h, d = q.shape
    pow2_d = (d & (d - 1)) == 0
    return q.is_cuda and pow2_d and 1 <= h <= 128 and 32 <= d <= 512 and q.dtype == torch.bfloat16


@REGISTRY.implement("triton", "sparse_attn_sink", supports=_supports)
def sparse_attn_sink(*, q: torch.Tensor, swa_cache: torch.Tensor, swa_idx: torch.Tensor,
                     comp_cache: torch.Tensor | None, comp_idx: torch.Tensor | None,
                     sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as the reference op (q [T, H, D] bf16 -> o [T, H, D] bf16)."""
    knobs = OP_KNOBS if q.shape[2] >= 128 else {}
    return sparse_attn(q, swa_cache, swa_idx, comp_cache, comp_idx, sink, scale, **knobs)


# Row chunks of the batch-invariant op keep its fp32 partials (splits x H x D per row) under this:
# fewer chunks launch less (1 GB is where the prefill's launch gaps end), within the activation
# reserve.
INVARIANT_PARTIAL_BYTES = 1 << 30


@REGISTRY.implement("triton_invariant", "sparse_attn_sink", supports=_supports)
def sparse_attn_sink_invariant(*, q: torch.Tensor, swa_cache: torch.Tensor,
                               swa_idx: torch.Tensor, comp_cache: torch.Tensor | None,
                               comp_idx: torch.Tensor | None, sink: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """The op on the decode partition at every size (`partition(invariant=True)`): a row's bits
    do not depend on the rows beside it. Decode steps of more than one block pair run exactly
    the default path; prefill pays the partials' round trip (row chunks bound their memory)."""
    t, h, d = q.shape
    knobs = OP_KNOBS if d >= 128 else {}
    splits = partition(t, index_blocks(swa_idx, comp_idx), invariant=True)[0]
    rows = max(1, INVARIANT_PARTIAL_BYTES // (splits * h * d * 4))
    if t <= rows:
        return sparse_attn(q, swa_cache, swa_idx, comp_cache, comp_idx, sink, scale,
                           invariant=True, **knobs)
    out = torch.empty(t, h, d, dtype=torch.bfloat16, device=q.device)
    for r in range(0, t, rows):
        sparse_attn(q[r:r + rows], swa_cache, swa_idx[r:r + rows], comp_cache,
                    None if comp_idx is None else comp_idx[r:r + rows], sink, scale,
                    invariant=True, out=out[r:r + rows], **knobs)
    return out
