"""Triton (sm_90) MoE: the routed MXFP4 experts `moe_mxfp4` (W4A8; the router is in router.py),
plus a W4A16 baseline (`moe_w4a16`, bf16 tensor cores, what vLLM/SGLang run on Hopper) kept as a
plain function for the benchmark.

W4A8 pipeline (no host synchronisation; every size below comes from tensor shapes):
1. permutation: the T*k (token, slot) rows are sorted by expert id (stable) with per-expert
   counts, on device (moe_route.py): one counting-sort launch for decode sizes, torch's
   argsort + scatter-add above; each GEMM program finds its (expert, row block) from the counts.
2. x -> e4m3 per 32 (model.md §5.2, bit-exact `act_quant.act_quant`), *folded*: every 32-block is
   re-encoded relative to the row's largest block exponent, one fp32 scale per row remains.
3. grouped GEMM w1|w3 (w13 [E, 2I, D/2]): weights stay 4-bit in memory; in registers each e2m1
   code becomes an e4m3 byte whose exponent is shifted by (block scale - row max scale) through a
   8-byte LUT per 32-block (`prmt` byte permutes via `inline asm`, 4 codes at a time), so the
   main loop is a pure `tl.dot(a, b, acc)` on FP8 wgmma. The LUT words are computed in closed
   form for blocks within 5 (word 0) / 7 (word 1) binades of their row's largest and read from a
   256-entry table only beyond (`fp4_tiles.w_e4m3`). Epilogue: row x column scales, g/u rounded
   to bf16 (as the reference), clamped SwiGLU, routing weight. Conversions (`w_e4m3` CONVERT,
   identical bits): 0 portable integer ops (the Triton interpreter; `use_asm=False`), 1 prmt
   on duplicated bytes (plain tiles), 2 prmt on the 16-bit word of 4 codes (swap-AB tiles), 3
   the f16 decode tiles' K-permuted shifts (`fp4_tiles.w_f16_perm`). Tiles: `moe_tiles` (by
   routed rows per expert, with the reason behind each choice).
   (measurements: docs/perf/moe.md)
4. h -> e4m3 per 32, folded (same quantiser); grouped GEMM w2, epilogue scales, bf16 y written to
   its (token, slot) row; 5. combine: out[t] = sum_j fp32(y[t, j]) (slot order).

Numerics versus the reference (the op's compare, `reference/moe.py` `_moe_compare`: 2e-2 abs/rel
for >= 99% of a call's outputs, 8x that for all; the 16-row tiles stay inside 1x everywhere
measured, the wgmma tiles put <= 0.15% of a tiny call over 1x on the H200):
- fold: a block b of a row with max exponent E is re-encoded as e4m3(v * 2^(e_b - E)). Exact while
  the shifted value is an e4m3 normal or subnormal multiple of 2^-9: for e2m1 weights up to
  E - e_b = 8, for e4m3 activations while |q| 2^(e_b - E) >= 2^-6 or is a multiple of 2^-9.
  Beyond that low bits are rounded (RNE) or flushed; such blocks are >= 2^6..2^8 below the row's
  largest and move the output far below bf16 resolution of its magnitude.
- the K sum: products are exact; decode tiles (mma.sync) add in fp32, prefill tiles (wgmma)
  add each BLOCK_K product from zero (FP8 wgmma's reduced-precision adds inside it) into an
  fp32 accumulator (reference: fp64, then fp32); their g / u then differ from the reference's by
  bf16 ulps often enough that h's e4m3 re-quantisation moves some h by a whole e4m3 step.
  Every program sums the full K of its rows in ascending BLOCK_K
  steps whatever the batch, so a row's result depends only on its own (token, expert) within
  one tile family; across the two families the bits differ (test_batch_invariance is xfail).
- the combine adds the k bf16 expert outputs in slot order (reference: ascending expert id).
- a weight row whose scales include 0xFF (NaN) gives NaN for the whole output column, like the
  reference's dot; a UE8M0 byte 0 (2^-127) row max is read as 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.act_quant import act_quant
from shoal.ops.triton.fp4_tiles import (
    a_f16_perm,
    block_scales,
    col_scale,
    lut_table,
    row_max_exp,
    w_bf16,
    w_e4m3,
    w_f16,
    w_f16_perm,
)
from shoal.ops.triton.moe_route import expert_tile, route
from shoal.ops.triton.moe_tiles import (
    TileConfig,
    default_configs,
    invariant_configs,
    w4a16_configs,
)
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait
from shoal.quant.fp8 import quant_fp8_act

# --------------------------------------------------------------------------- device helpers


@triton.jit
def _bf16(x):
    """fp32 -> bf16 with explicit round-to-nearest-even (as the GPU cast; the interpreter's cast
    truncates), so the interpreter checks the device numerics."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _swiglu(acc_g, acc_u, rw, limit):
    """bf16 h from fp32 g, u sums: each rounded to bf16 first (as the reference), clamped
    SwiGLU, routing weight rw [rows]."""
    g = tl.minimum(_bf16(acc_g).to(tl.float32), limit)
    u = tl.clamp(_bf16(acc_u).to(tl.float32), -limit, limit)
    return _bf16(rw[:, None] * (g / (1.0 + tl.exp(-g)) * u))


# --------------------------------------------------------------------------- grouped GEMM


@triton.jit
def _mma(x, y, acc, PROMOTE: tl.constexpr):
    """acc + x @ y (fp32). PROMOTE: the product is formed from zero and added in fp32 (see
    TileConfig.promote); else the accumulator is chained through the MMA."""
    if PROMOTE:
        return acc + tl.dot(x, y)
    return tl.dot(x, y, acc)


@triton.jit
def _fused_gu_tile(a_ptr, as_ptr, arow, rows, rmask, out_ptr, rw_ptr, w_ptr, ws_ptr, lut_ptr, e,
                   pid_n, N, limit, K: tl.constexpr, KB_P2: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, CONVERT: tl.constexpr,
                   PROMOTE: tl.constexpr):
    """The w13 tile of `_moe_gemm_kernel` with FUSED_GU: weight row 2j of the tile is gate
    row n_j, row 2j + 1 up row n_j, so each K step converts one [2 BN, BK] tile and runs one
    MMA chain (the A tile is read from shared memory once per step, one wait per step); every
    output element sees the same products in the same K order as the split form."""
    KB = K // 32
    K2 = K // 2
    j = tl.arange(0, 2 * BN)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    wrow = e.to(tl.int64) * (2 * N) + (pid_n * BN + j // 2) % N + (j % 2) * N
    wmax = row_max_exp(ws_ptr, wrow, KB, 2 * BN, KB_P2)
    acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
    offs_k = tl.arange(0, BK)
    sc = block_scales(ws_ptr, wrow, 0, KB, 2 * BN, BK)
    for k0 in range(0, K, BK):
        sc_next = block_scales(ws_ptr, wrow, tl.minimum(k0 + BK, K - BK), KB, 2 * BN, BK)
        a = tl.load(a_ptr + arow[:, None] * K + (k0 + offs_k)[None, :], mask=rmask[:, None],
                    other=0.0)
        b = w_e4m3(w_ptr, sc, lut_ptr, wrow, wmax, k0, K2, 2 * BN, BK, CONVERT)
        acc = _mma(a, tl.trans(b), acc, PROMOTE)
        sc = sc_next
    rs = tl.load(as_ptr + arow, mask=rmask, other=0.0)
    acc = acc * rs[:, None] * col_scale(wmax)[None, :]
    g, u = tl.split(tl.reshape(acc, (BM, BN, 2)))
    rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    ptrs = out_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(ptrs, _swiglu(g, u, rw, limit), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _moe_gemm_kernel(a_ptr, as_ptr, arow_ptr, out_ptr, orow_ptr, rw_ptr, w_ptr, ws_ptr, cnt_ptr,
                     lut_ptr, N, E, limit, K: tl.constexpr, E_P2: tl.constexpr,
                     KB_P2: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     SWIGLU: tl.constexpr, GATHER_A: tl.constexpr, W4A8: tl.constexpr,
                     CONVERT: tl.constexpr, SWAP_AB: tl.constexpr, PROMOTE: tl.constexpr,
                     F16: tl.constexpr, FUSED_GU: tl.constexpr):
    """One (row block of one expert, BN output columns) tile.

    SWIGLU: out[r, n] = bf16(w_r * silu(min(g, L)) * clamp(u, -L, L)) with g, u the bf16 outputs
    of weight rows n and N + n of the expert (w13); else out[orow[r], n] = bf16(y) (w2).
    W4A8: a is folded e4m3 with row scales as_ptr; else a is bf16 and weights dequantise to bf16.
    SWAP_AB: the accumulators hold the transposed [BN, BM] tile (weights as the left operand).
    FUSED_GU (w13, plain W4A8 tiles): gate and up rows interleaved in one [2 BN, BK] weight tile,
    one MMA chain per step into one [BM, 2 BN] accumulator, split into g and u at the end.
    """
    pdl_wait()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e, row0, row_end = expert_tile(cnt_ptr, pid_m, E, E_P2, BM)
    rows = row0 + tl.arange(0, BM)
    rmask = rows < row_end
    if GATHER_A:
        arow = tl.load(arow_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        arow = tl.where(rmask, rows, 0).to(tl.int64)
    live = row0 < row_end
    if FUSED_GU and live:
        _fused_gu_tile(a_ptr, as_ptr, arow, rows, rmask, out_ptr, rw_ptr, w_ptr, ws_ptr, lut_ptr,
                       e, pid_n, N, limit, K, KB_P2, BM, BN, BK, CONVERT, PROMOTE)
    elif live:  # dead tiles of the upper-bound grid exit at once
        KB = K // 32
        K2 = K // 2
        NW = 2 * N if SWIGLU else N
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        ew = e.to(tl.int64)
        wrow_g = ew * NW + offs_n % N
        wrow_u = wrow_g + N
        if W4A8:
            wmax_g = row_max_exp(ws_ptr, wrow_g, KB, BN, KB_P2)
            if SWIGLU:
                wmax_u = row_max_exp(ws_ptr, wrow_u, KB, BN, KB_P2)
        if SWAP_AB:
            acc_g = tl.zeros((BN, BM), dtype=tl.float32)
            acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc_g = tl.zeros((BM, BN), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        offs_k = tl.arange(0, BK)
        # the block scales of step k0 + BK load while step k0 converts (see block_scales)
        sc_g = block_scales(ws_ptr, wrow_g, 0, KB, BN, BK)
        if SWIGLU:
            sc_u = block_scales(ws_ptr, wrow_u, 0, KB, BN, BK)
        for k0 in range(0, K, BK):
            if SWAP_AB:  # prefetched scales gave wrong outputs on these tiles (H200, cause open)
                k_next = k0
            else:
                k_next = tl.minimum(k0 + BK, K - BK)  # the last step re-reads its own
            sc_g_next = block_scales(ws_ptr, wrow_g, k_next, KB, BN, BK)
            if SWIGLU:
                sc_u_next = block_scales(ws_ptr, wrow_u, k_next, KB, BN, BK)
            if SWAP_AB:
                sc_g = sc_g_next
                if SWIGLU:
                    sc_u = sc_u_next
            a = tl.load(a_ptr + arow[:, None] * K + (k0 + offs_k)[None, :], mask=rmask[:, None],
                        other=0.0)
            if F16 and CONVERT == 3:
                a = a_f16_perm(a)
                bg = w_f16_perm(w_ptr, sc_g, wrow_g, wmax_g, k0, K2, BN, BK)
            elif F16:
                a = a.to(tl.float16)  # e4m3 -> fp16: exact
                bg = w_f16(w_ptr, sc_g, wrow_g, wmax_g, k0, K2, BN, BK, CONVERT == 1)
            elif W4A8:
                bg = w_e4m3(w_ptr, sc_g, lut_ptr, wrow_g, wmax_g, k0, K2, BN, BK, CONVERT)
            else:
                bg = w_bf16(w_ptr, sc_g, wrow_g, k0, K2, BN, BK)
            if SWAP_AB:
                acc_g = _mma(bg, tl.trans(a), acc_g, PROMOTE)
            else:
                acc_g = _mma(a, tl.trans(bg), acc_g, PROMOTE)
            if SWIGLU:
                if F16 and CONVERT == 3:
                    bu = w_f16_perm(w_ptr, sc_u, wrow_u, wmax_u, k0, K2, BN, BK)
                elif F16:
                    bu = w_f16(w_ptr, sc_u, wrow_u, wmax_u, k0, K2, BN, BK, CONVERT == 1)
                elif W4A8:
                    bu = w_e4m3(w_ptr, sc_u, lut_ptr, wrow_u, wmax_u, k0, K2, BN, BK, CONVERT)
                else:
                    bu = w_bf16(w_ptr, sc_u, wrow_u, k0, K2, BN, BK)
                if SWAP_AB:
                    acc_u = _mma(bu, tl.trans(a), acc_u, PROMOTE)
                else:
                    acc_u = _mma(a, tl.trans(bu), acc_u, PROMOTE)
                sc_u = sc_u_next
            sc_g = sc_g_next
        if SWAP_AB:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        omask = rmask[:, None] & nmask[None, :]
        if W4A8:
            rs = tl.load(as_ptr + arow, mask=rmask, other=0.0)
            acc_g = acc_g * rs[:, None] * col_scale(wmax_g)[None, :]
            if SWIGLU:
                acc_u = acc_u * rs[:, None] * col_scale(wmax_u)[None, :]
        if SWIGLU:
            rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
            ptrs = out_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(ptrs, _swiglu(acc_g, acc_u, rw, limit), mask=omask)
        else:
            orow = tl.load(orow_ptr + rows, mask=rmask, other=0).to(tl.int64)
            tl.store(out_ptr + orow[:, None] * N + offs_n[None, :], _bf16(acc_g),
                     mask=omask)


@triton.jit
def _combine_kernel(y_ptr, shared_ptr, out_ptr, D, KTOP: tl.constexpr, SHARED: tl.constexpr,
                    BLOCK: tl.constexpr):
    """out[t, :] = sum_j fp32(y[t * KTOP + j, :]) in slot order (fp32 out); SHARED: plus
    fp32(shared[t, :]), rounded once to bf16."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(KTOP):
        acc += tl.load(y_ptr + (t * KTOP + j) * D + offs, mask=mask, other=0.0).to(tl.float32)
    if SHARED:
        acc += tl.load(shared_ptr + t * D + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + offs, acc.to(tl.bfloat16), mask=mask)
    else:
        tl.store(out_ptr + t * D + offs, acc, mask=mask)


# --------------------------------------------------------------------------- host side


def _quant_folded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (folded e4m3 codes [R, K], fp32 row scale [R]) per model.md §5.2: on CUDA the
    bit-exact Triton quantiser of gemm.py; elsewhere (the Triton interpreter, whose fp32 -> fp8
    cast is not RNE) the same fold of the torch reference quantiser."""
    if x.is_cuda:
        return act_quant(x, 32, fold=True)
    codes, scales = quant_fp8_act(x, 32)
    e = scales.to(torch.int32)
    top = e.amax(dim=1, keepdim=True)
    f = torch.exp2((e - top).clamp_min(-126).float()).repeat_interleave(32, dim=1)
    q = (codes.float() * f).to(torch.float8_e4m3fn)
    return q.contiguous(), torch.exp2((top.squeeze(1) - 127).float())


def _launch(a, a_scale, arow, out, orow, rw, w, ws, counts, n, k, limit, cfg: TileConfig,
            swiglu: bool, gather: bool, w4a8: bool,
            convert: int | None) -> None:
    """One grouped GEMM: w13 writes h [R, n] bf16 into `out`; w2 writes y [R, n] bf16 at the
    output rows into `out`. convert: the weight conversion (0 portable, 1 / 2 prmt, 3 the
    K-permuted fp16 shifts of the f16 tiles); None: the fastest for the tile (3 on f16 tiles,
    2 for swap-AB, where the weights are the register operand; 1 on the other plain tiles,
    where 2 costs more)."""
    rows, e = orow.shape[0], w.shape[0]
    f16 = cfg.f16 and w4a8  # (the W4A16 baseline keeps its bf16 dequantisation)
    if convert is None:
        convert = 2 if cfg.swap_ab else 3 if f16 else 1
    if convert == 2 and not cfg.swap_ab:  # wrong bits on 128-row plain tiles (H200)
        raise ValueError("prmt variant 2 needs swap-AB tiles (weights as the register operand)")
    if f16 and (cfg.swap_ab or convert == 2):
        raise ValueError("f16 tiles: plain tiles with conversion 0, 1 or 3 only")
    if convert == 3 and not f16:
        raise ValueError("conversion 3 (K-permuted fp16 shifts) needs f16 tiles")
    fused = cfg.fused_gate_up and swiglu
    if fused and (cfg.swap_ab or f16 or not w4a8 or not gather):
        raise ValueError("fused_gate_up: plain W4A8 e4m3 tiles of w13 only (not swap-AB, f16 "
                         "or W4A16)")
    bk = cfg.block_k
    while k % bk:
        bk //= 2
    m_tiles = triton.cdiv(rows, cfg.block_m) + min(e, rows)
    grid = (triton.cdiv(n, cfg.block_n), m_tiles)
    dummy = counts
    _moe_gemm_kernel[grid](
        a, a_scale if a_scale is not None else dummy, arow if arow is not None else dummy, out,
        orow, rw, w, ws, counts, lut_table(a.device), n, e, float(limit), K=k,
        E_P2=triton.next_power_of_2(e), KB_P2=triton.next_power_of_2(k // 32),
        BM=cfg.block_m, BN=cfg.block_n, BK=bk, SWIGLU=swiglu, GATHER_A=gather,
        W4A8=w4a8, CONVERT=convert, SWAP_AB=cfg.swap_ab, PROMOTE=cfg.promote, F16=f16,
        FUSED_GU=fused,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}), **PDL_LAUNCH)


def _combine(y: torch.Tensor, t: int, k: int, d: int,
             shared: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(t, d, dtype=torch.float32 if shared is None else torch.bfloat16,
                      device=y.device)
    block = 1024
    _combine_kernel[(t, triton.cdiv(d, block))](
        y, y if shared is None else shared.contiguous(), out, d, KTOP=k,
        SHARED=shared is not None, BLOCK=block, num_warps=4, **PDL_LAUNCH)
    return out


def empty_result(x: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor | None:
    """Checks `shared` against x; the op's result when x has no rows (else None)."""
    t, d = x.shape
    if shared is not None and shared.shape != (t, d):
        raise ValueError(f"moe_mxfp4: shared {tuple(shared.shape)} must be [T, D] = {(t, d)}")
    if t:
        return None
    return torch.zeros(t, d, dtype=torch.float32 if shared is None else torch.bfloat16,
                       device=x.device)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
                shared: torch.Tensor | None = None, *, w4a8: bool = True, use_asm: bool | None = None,
                asm_variant: int | None = None,
                configs: tuple[TileConfig, TileConfig] | None = None) -> torch.Tensor:
    """Routed experts -> [T, D] fp32, or bf16 with `shared` added (the `moe_mxfp4`
    contract). w4a8=False: the W4A16 baseline
    (bf16 activations, weights dequantised to bf16; no activation quantisation, so it differs
    from the reference by the FP8 activation rounding). use_asm: the prmt conversion (CUDA only;
    default there); `asm_variant` 2 (16-bit words; swap-AB tiles only), 1 (duplicated bytes,
    the first device-verified version) or 3 (fp16 shifts, f16 tiles only), default per tile
    (see `_launch`); use_asm False (and always under the Triton interpreter, where inline asm
    cannot run): the portable integer conversion. All give identical bits (3: wherever 1 is
    exact). configs: (w13, w2) tiles, default
    `default_configs(T * k, E)` (W4A16: `w4a16_configs`)."""
    t, d = x.shape
    k = ids.shape[1]
    e, two_i, _ = w13.shape
    inter = two_i // 2
    if (empty := empty_result(x, shared)) is not None:
        return empty
    if use_asm is None:
        use_asm = x.is_cuda
    if asm_variant not in (None, 1, 2, 3):
        raise ValueError(f"asm_variant must be None, 1, 2 or 3, got {asm_variant}")
    convert = asm_variant if use_asm else 0
    cfg1, cfg2 = configs or (default_configs if w4a8 else w4a16_configs)(t * k, e)
    tok, orow, rw, counts = route(ids, weights, e)
    h = torch.empty(t * k, inter, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(t * k, d, dtype=torch.bfloat16, device=x.device)
    w13b, w2b = w13.contiguous(), w2.contiguous()
    s13, s2 = w13_scale.contiguous(), w2_scale.contiguous()
    if w4a8:
        xq, xs = _quant_folded(x)
        _launch(xq, xs, tok, h, orow, rw, w13b, s13, counts, inter, d, limit, cfg1, True, True,
                True, convert)
        hq, hs = _quant_folded(h)
        _launch(hq, hs, None, y, orow, rw, w2b, s2, counts, d, inter, limit, cfg2, False,
                False, True, convert)
    else:
        xb = x.contiguous()
        _launch(xb, None, tok, h, orow, rw, w13b, s13, counts, inter, d, limit, cfg1, True, True,
                False, 0)
        _launch(h, None, None, y, orow, rw, w2b, s2, counts, d, inter, limit, cfg2, False,
                False, False, 0)
    return _combine(y, t, k, d, shared)


def moe_w4a16(**kwargs) -> torch.Tensor:
    """W4A16 baseline with the `moe_mxfp4` signature (benchmark only, not registered)."""
    return moe_experts(**kwargs, w4a8=False)


def _supports_moe(*, x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  **_) -> bool:
    d = x.shape[1] if x.dim() == 2 else 0
    inter = w2.shape[2] * 2 if w2.dim() == 3 else 0
    return (x.is_cuda and x.dim() == 2 and ids.dim() == 2 and d % 32 == 0 and inter % 32 == 0
            and w13.dim() == 3 and w13.shape[1] == 2 * inter and w13.shape[2] * 2 == d)


@REGISTRY.implement("triton", "moe_mxfp4", supports=_supports_moe)
def moe_mxfp4(*, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
              w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
              limit: float, shared: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as the reference (W4A8 on FP8 wgmma); see the module docstring."""
    return moe_experts(x, ids, weights, w13, w13_scale, w2, w2_scale, limit, shared)


@REGISTRY.implement("triton_invariant", "moe_mxfp4", supports=_supports_moe)
def moe_mxfp4_invariant(*, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                        w2_scale: torch.Tensor, limit: float,
                        shared: torch.Tensor | None = None) -> torch.Tensor:
    """The op on mma.sync tiles at every size (`invariant_configs`): a token's bits do not
    depend on the batch."""
    return moe_experts(x, ids, weights, w13, w13_scale, w2, w2_scale, limit, shared,
                       configs=invariant_configs(x.shape[0] * ids.shape[1], w13.shape[0]))
