"""Triton (sm_90) mHC kernels (model.md §2.1, §2.2, §2.12): `hc_coeffs`, `hc_collapse`,
`hc_collapse_norm`, `hc_post`, and the family's `embed` and `stream_mean`.

- hc_coeffs: two launches. (1) grid (tokens / 64, SPLIT): the mix `fn . f` and sum(f^2) over one
  fixed K chunk of the flattened [4*D] stream, into a partial buffer [T, SPLIT, 32]. The mix
  runs on the bf16 tensor cores with exact products: f is bf16 and each fp32 weight tile is
  split into three bf16 terms (w = w1 + w2 + w3 exactly, "3xBF16" as gemm_nt.py), fp32
  accumulation (w2, w3 terms in their own accumulator); the IEEE-fp32 `tl.dot` it replaces (FMA
  on the CUDA cores) was far above the HBM floor (measurements: docs/perf/hyper_connections.md).
  (2) one program per token adds the partials in a fixed order, applies rsqrt(mean(f^2) + eps),
  sigmoid pre/post, the row softmax and all Sinkhorn normalisations ([4, 4] in registers).
  SPLIT depends only on D, so results are batch-invariant (a token's sums never depend on T).
- hc_collapse(_norm): one program per token; the bf16 collapse is rounded once, then normed.
- hc_post: one program per (token, D tile); every output stream j reads the 4 input streams once.
- embed: row gather on the 16-bit patterns (bit-exact). stream_mean: fp64 sum of the 4 streams,
  rounded to fp32 then bf16 as the reference (bit-exact whenever that fp64 sum is exact).
Invariant: reference contracts and orders; only fp32 summation order differs (fp64 in the
reference's products), inside the registered tolerances. hc = 4 streams only.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.engram import bf16_rne
from shoal.ops.triton.gemm_nt import split_bf16x3
from shoal.ops.triton.norm import MAX_K, on_device
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait

HC = 4


# hc_coeffs: K = 4 * D is reduced in SPLIT fixed chunks of KC = ITERS * BK values. Chunk s of
# every token gives a partial [24 mix sums, sum of squares] that starts from zero; the partials
# are added in the order s = 0, 1, ... in fp32. SPLIT, ITERS and BK depend only on D, never on
# T, so a token's result is the same in every batch (batch invariance).
COEFF_BT = 64  # tokens per partial program (fixed: the tl.dot tile shape never changes)
# target K values per chunk (D = 5120: 80 chunks; partials 10 KB per token): 256 is slower than
# 512 in prefill but faster per decode call, 16 of them per mini step
# (measurements: docs/perf/hyper_connections.md)
COEFF_CHUNK = 256


def coeff_split(d: int) -> tuple[int, int, int]:
    """(BK, ITERS, SPLIT) for stream width D: BK divides D (a tile never straddles two streams);
    SPLIT chunks of ITERS * BK cover 4 * D (the last may be shorter)."""
    bk = math.gcd(128, d)
    iters = max(1, COEFF_CHUNK // bk)
    steps = 4 * d // bk
    return bk, iters, triton.cdiv(steps, iters)


@triton.jit(do_not_specialize=["T"])
def _coeffs_partial_kernel(s_ptr, fn_ptr, part_ptr, T, D, st_t, st_i, st_d, fn_r, fn_c,
                           SPLIT: tl.constexpr, ITERS: tl.constexpr, BT: tl.constexpr,
                           BK: tl.constexpr):
    """part[t, s, 0:24] = fn[:, chunk s] . f_t[chunk s]; part[t, s, 24] = sum of f^2 (fp32).
    Products exact (bf16 f times the three bf16 terms of fn), fp32 sums, K ascending."""
    pdl_wait()
    toks = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    s = tl.program_id(1)
    tmask = toks < T
    offs_k = tl.arange(0, BK)
    offs_r = tl.arange(0, 32)  # the 24 mix rows, padded; column 24 carries the sum of squares
    rmask = offs_r < 24
    acc = tl.zeros((BT, 32), dtype=tl.float32)
    lo = tl.zeros((BT, 32), dtype=tl.float32)  # w2, w3 terms: ~2^-8 of acc, own accumulator
    sq = tl.zeros((BT,), dtype=tl.float32)
    k_lo = s * (ITERS * BK)
    k_hi = tl.minimum(k_lo + ITERS * BK, 4 * D)
    for k0 in range(k_lo, k_hi, BK):  # BK divides D: a tile never straddles two streams
        i = k0 // D
        dd = k0 - i * D + offs_k
        f = tl.load(s_ptr + toks[:, None] * st_t + i * st_i + dd[None, :] * st_d,
                    mask=tmask[:, None], other=0.0)
        f32 = f.to(tl.float32)
        sq += tl.sum(f32 * f32, axis=1)
        w = tl.load(fn_ptr + offs_r[None, :] * fn_r + (k0 + offs_k[:, None]) * fn_c,
                    mask=rmask[None, :], other=0.0)
        w1, w2, w3 = split_bf16x3(w)  # w = w1 + w2 + w3 exactly
        acc = tl.dot(f, w1, acc)
        lo = tl.dot(f, w2, lo)
        lo = tl.dot(f, w3, lo)
    out = tl.where(offs_r[None, :] == 24, sq[:, None], acc + lo)
    tl.store(part_ptr + (toks[:, None] * SPLIT + s) * 32 + offs_r[None, :], out,
             mask=tmask[:, None])


@triton.jit(do_not_specialize=["T"])
def _coeffs_finish_kernel(part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, D,
                          norm_eps, hc_eps, iters, SPLIT: tl.constexpr):
    """One token: add its SPLIT partials in order, then rstd, sigmoid pre/post, the row softmax
    and the Sinkhorn normalisations, all in fp32 registers."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, 32)
    acc = tl.zeros((32,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # order s = 0, 1, ... (unrolled: loads all in flight)
        acc += tl.load(part_ptr + (t * SPLIT + s) * 32 + offs_r)
    sq = tl.sum(tl.where(offs_r == 24, acc, 0.0), axis=0)
    rstd = 1.0 / tl.sqrt_rn(sq / (4 * D) + norm_eps)
    m = acc * rstd
    c4 = tl.arange(0, 4)
    c16 = tl.arange(0, 16)
    m_pre = tl.sum(tl.where(offs_r[None, :] == c4[:, None], m[None, :], 0.0), 1)
    m_post = tl.sum(tl.where(offs_r[None, :] == 4 + c4[:, None], m[None, :], 0.0), 1)
    m_comb = tl.sum(tl.where(offs_r[None, :] == 8 + c16[:, None], m[None, :], 0.0), 1)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    b_pre = tl.load(base_ptr + c4)
    b_post = tl.load(base_ptr + 4 + c4)
    b_comb = tl.load(base_ptr + 8 + c16)
    pre = tl.div_rn(1.0, 1.0 + tl.exp(-(m_pre * s0 + b_pre))) + hc_eps
    post = 2 * tl.div_rn(1.0, 1.0 + tl.exp(-(m_post * s1 + b_post)))
    c = tl.reshape(m_comb * s2 + b_comb, (4, 4))  # [i, j]
    c = tl.exp(c - tl.max(c, axis=1)[:, None])
    c = tl.div_rn(c, tl.sum(c, axis=1)[:, None]) + hc_eps
    c = tl.div_rn(c, tl.sum(c, axis=0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        c = tl.div_rn(c, tl.sum(c, axis=1)[:, None] + hc_eps)
        c = tl.div_rn(c, tl.sum(c, axis=0)[None, :] + hc_eps)
    tl.store(pre_ptr + t * 4 + c4, pre)
    tl.store(post_ptr + t * 4 + c4, post)
    tl.store(comb_ptr + t * 16 + c16, tl.reshape(c, (16,)))


def _supports_coeffs(*, stream: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                     base: torch.Tensor, **_) -> bool:
    return (on_device(stream) and stream.dim() == 3 and stream.shape[1] == HC
            and stream.dtype == torch.bfloat16
            and stream.shape[2] % 16 == 0 and fn.shape == (24, HC * stream.shape[2])
            and fn.dtype == torch.float32 and scale.dtype == torch.float32
            and base.dtype == torch.float32)


@REGISTRY.implement("triton", "hc_coeffs", supports=_supports_coeffs)
def hc_coeffs(*, stream: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
              base: torch.Tensor, norm_eps: float, hc_eps: float,
              iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """stream [T, 4, D] bf16 -> pre [T, 4], post [T, 4], comb [T, 4, 4] fp32 (reference).

    Two launches: partial sums over fixed K chunks (grid tokens/64 x SPLIT, so decode spreads
    the 24 x 4D GEMV over SPLIT programs; 3xBF16 tensor-core products, exact), then one
    program per token adds them in a fixed
    order and finishes. Batch-invariant: nothing depends on T.
    """
    t, _, d = stream.shape
    dev = stream.device
    pre = torch.empty(t, HC, dtype=torch.float32, device=dev)
    post = torch.empty(t, HC, dtype=torch.float32, device=dev)
    comb = torch.empty(t, HC, HC, dtype=torch.float32, device=dev)
    if t == 0:
        return pre, post, comb
    bk, n_iter, split = coeff_split(d)
    part = torch.empty(t, split, 32, dtype=torch.float32, device=dev)
    _coeffs_partial_kernel[(triton.cdiv(t, COEFF_BT), split)](
        stream, fn, part, t, d, stream.stride(0), stream.stride(1), stream.stride(2),
        fn.stride(0), fn.stride(1), SPLIT=split, ITERS=n_iter, BT=COEFF_BT, BK=bk,
        num_warps=4, **PDL_LAUNCH)
    _coeffs_finish_kernel[(t,)](
        part, scale.contiguous(), base.contiguous(), pre, post, comb, t, d, float(norm_eps),
        float(hc_eps), int(iters), SPLIT=split, num_warps=1, **PDL_LAUNCH)
    return pre, post, comb


@triton.jit
def _collapse_kernel(s_ptr, pre_ptr, w_ptr, o_ptr, D, eps, st_t, st_i, st_d, pre_t, pre_i,
                     NORM: tl.constexpr, BD: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, BD)
    dmask = dd < D
    acc = tl.zeros((BD,), dtype=tl.float32)
    for i in tl.static_range(4):
        p = tl.load(pre_ptr + t * pre_t + i * pre_i).to(tl.float32)
        x = tl.load(s_ptr + t * st_t + i * st_i + dd * st_d, mask=dmask, other=0.0)
        acc += p * x.to(tl.float32)
    y = acc.to(tl.bfloat16)
    if NORM:
        yf = y.to(tl.float32)
        var = tl.sum(yf * yf, axis=0) / D
        r = 1.0 / tl.sqrt_rn(var + eps)
        w = tl.load(w_ptr + dd, mask=dmask, other=0.0).to(tl.float32)
        y = (w * (yf * r)).to(tl.bfloat16)
    tl.store(o_ptr + t * D + dd, y, mask=dmask)


def _collapse(stream: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None,
              eps: float) -> torch.Tensor:
    t, _, d = stream.shape
    out = torch.empty(t, d, dtype=torch.bfloat16, device=stream.device)
    if t == 0:
        return out
    bd = triton.next_power_of_2(d)
    w = weight.contiguous() if weight is not None else out
    _collapse_kernel[(t,)](stream, pre, w, out, d, float(eps), stream.stride(0),
                           stream.stride(1), stream.stride(2), pre.stride(0), pre.stride(1),
                           NORM=weight is not None, BD=bd, num_warps=4 if bd <= 2048 else 8,
                           enable_fp_fusion=False, **PDL_LAUNCH)
    return out


def _supports_collapse(*, stream: torch.Tensor, pre: torch.Tensor, **_) -> bool:
    return (on_device(stream) and stream.dim() == 3 and stream.shape[1] == HC
            and 0 < stream.shape[2] <= MAX_K and pre.shape == stream.shape[:2])


@REGISTRY.implement("triton", "hc_collapse", supports=_supports_collapse)
def hc_collapse(*, stream: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x = bf16(sum_i pre_i * X_i); stream [T, 4, D], pre [T, 4] -> [T, D] bf16."""
    return _collapse(stream, pre, None, 0.0)


@REGISTRY.implement("triton", "hc_collapse_norm", supports=_supports_collapse)
def hc_collapse_norm(*, stream: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """RMSNorm(bf16 collapse) fused: [T, 4, D], [T, 4], weight [D] -> [T, D] bf16."""
    return _collapse(stream, pre, weight, eps)


@triton.jit
def _post_kernel(y_ptr, s_ptr, post_ptr, comb_ptr, o_ptr, D, y_t, y_d, st_t, st_i, st_d,
                 po_t, po_i, cb_t, cb_i, cb_j, BD: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = dd < D
    y = tl.load(y_ptr + t * y_t + dd * y_d, mask=dmask, other=0.0).to(tl.float32)
    sb = s_ptr + t * st_t + dd * st_d
    x0 = tl.load(sb, mask=dmask, other=0.0).to(tl.float32)
    x1 = tl.load(sb + st_i, mask=dmask, other=0.0).to(tl.float32)
    x2 = tl.load(sb + 2 * st_i, mask=dmask, other=0.0).to(tl.float32)
    x3 = tl.load(sb + 3 * st_i, mask=dmask, other=0.0).to(tl.float32)
    cb = comb_ptr + t * cb_t
    for j in tl.static_range(4):
        pj = tl.load(post_ptr + t * po_t + j * po_i).to(tl.float32)
        c0 = tl.load(cb + j * cb_j).to(tl.float32)
        c1 = tl.load(cb + cb_i + j * cb_j).to(tl.float32)
        c2 = tl.load(cb + 2 * cb_i + j * cb_j).to(tl.float32)
        c3 = tl.load(cb + 3 * cb_i + j * cb_j).to(tl.float32)
        mixed = c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3
        tl.store(o_ptr + (t * 4 + j) * D + dd, (pj * y + mixed).to(tl.bfloat16), mask=dmask)


def _supports_post(*, y: torch.Tensor, stream: torch.Tensor, post: torch.Tensor,
                   comb: torch.Tensor) -> bool:
    return (on_device(y) and stream.dim() == 3 and stream.shape[1] == HC
            and y.shape == (stream.shape[0], stream.shape[2]) and post.shape == stream.shape[:2]
            and comb.shape == (stream.shape[0], HC, HC))


@REGISTRY.implement("triton", "hc_post", supports=_supports_post)
def hc_post(*, y: torch.Tensor, stream: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """R'_j = bf16(post_j * y + sum_i comb[i][j] * X_i); y [T, D], stream [T, 4, D] -> [T, 4, D]."""
    t, _, d = stream.shape
    out = torch.empty(t, HC, d, dtype=torch.bfloat16, device=y.device)
    if t == 0 or d == 0:
        return out
    bd = min(1024, triton.next_power_of_2(d))
    _post_kernel[(t, triton.cdiv(d, bd))](
        y, stream, post, comb, out, d, y.stride(0), y.stride(1), stream.stride(0),
        stream.stride(1), stream.stride(2), post.stride(0), post.stride(1), comb.stride(0),
        comb.stride(1), comb.stride(2), BD=bd, num_warps=4, **PDL_LAUNCH)
    return out


# --------------------------------------------------------------------------- embed, stream_mean


@triton.jit
def _embed_kernel(ids_ptr, tab_ptr, o_ptr, D, V, tab_v, tab_d, BD: tl.constexpr):
    """Row gather of the bf16 table on the raw 16-bit patterns (bit-exact, NaN payloads too)."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = dd < D
    row = tl.load(ids_ptr + t).to(tl.int64)
    row = tl.where(row < 0, row + V, row)  # python-style negative ids, as torch indexing
    x = tl.load(tab_ptr + row * tab_v + dd * tab_d, mask=dmask)
    tl.store(o_ptr + t * D + dd, x, mask=dmask)


def _supports_embed(*, ids: torch.Tensor, table: torch.Tensor) -> bool:
    return (on_device(table) and ids.dim() == 1 and table.dim() == 2
            and table.dtype.itemsize == 2 and not ids.is_floating_point())


@REGISTRY.implement("triton", "embed", supports=_supports_embed)
def embed(*, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ids [T] int, table [V, D] bf16 -> [T, D] bf16, bit-identical rows (ids must be in
    [-V, V); unlike the reference, an out-of-range id is not checked)."""
    t, (v, d) = ids.shape[0], table.shape
    out = torch.empty(t, d, dtype=table.dtype, device=table.device)
    if t == 0 or d == 0:
        return out
    bd = min(2048, triton.next_power_of_2(d))
    tab = table.view(torch.int16)
    _embed_kernel[(t, triton.cdiv(d, bd))](ids, tab, out.view(torch.int16), d, v, tab.stride(0),
                                           tab.stride(1), BD=bd, num_warps=4, **PDL_LAUNCH)
    return out


@triton.jit
def _stream_mean_kernel(s_ptr, o_ptr, D, st_t, st_i, st_d, BD: tl.constexpr):
    """bf16(fp32(mean)) with the mean of the 4 streams in fp64, as the reference."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = dd < D
    base = s_ptr + t * st_t + dd * st_d
    acc = tl.load(base, mask=dmask, other=0.0).to(tl.float64)
    for i in tl.static_range(1, 4):
        acc += tl.load(base + i * st_i, mask=dmask, other=0.0).to(tl.float64)
    mean = (acc * 0.25).to(tl.float32)
    tl.store(o_ptr + t * D + dd, bf16_rne(mean), mask=dmask)


def _supports_stream_mean(*, stream: torch.Tensor) -> bool:
    return (on_device(stream) and stream.dim() == 3 and stream.shape[1] == HC
            and stream.dtype in (torch.bfloat16, torch.float32))


@REGISTRY.implement("triton", "stream_mean", supports=_supports_stream_mean)
def stream_mean(*, stream: torch.Tensor) -> torch.Tensor:
    """bf16(fp32(mean_i X_i)), stream [T, 4, D] -> [T, D] bf16. The 4 values are added in fp64
    (exact for bf16 inputs whose exponents lie within 45 binades of each other, i.e. always in
    practice), halved twice (exact), then rounded to fp32 and to bf16 as the reference does:
    bit-identical to it whenever the fp64 sum is exact."""
    t, _, d = stream.shape
    out = torch.empty(t, d, dtype=torch.bfloat16, device=stream.device)
    if t == 0 or d == 0:
        return out
    bd = min(1024, triton.next_power_of_2(d))
    _stream_mean_kernel[(t, triton.cdiv(d, bd))](
        stream, out.view(torch.int16), d, stream.stride(0), stream.stride(1), stream.stride(2),
        BD=bd, num_warps=4, **PDL_LAUNCH)
    return out
