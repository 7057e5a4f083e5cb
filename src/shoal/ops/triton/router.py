"""Triton (sm_90) MoE router (`router`), two launches per call, no torch glue:

1. `_logits_kernel`: gate logits with exact bf16 products summed in fp64 in one fixed order that
   depends on D only, so a token's logits do not depend on the batch: K is cut into slices of
   SLICE_K columns and the slices into GROUPS groups of consecutive slices, one program per
   (tokens, experts, group) tile: 16 x 32 below WIDE_FROM tokens, 128 x 64 from there
   (`logits_tile`; the tile never changes the K order, so not the bits). A slice's partial is
   one fp64 `tl.dot` (FP64 tensor-core MMA, its K chain in ascending order), added in slice
   order to the group's sum, written to an fp64 workspace [G, T, E].
2. `_select_kernel`: one token per program: the G group sums added in order and rounded to
   fp32 (the reference's fp32(fp64 dot)), sqrt-softplus in fp64 then rounded to fp32 (as the
   reference), the biased top-k (ties to the lower expert id, as a stable descending sort) and
   the weights renormalised in fp64.

So the routing matches the reference bit for bit except where an fp64 rounding (summation
order, exp/log in the last fp64 bits) crosses an fp32 rounding boundary: about 2^-29 per value.
An fp32-sum router (the earlier `gemm_nt` logits, fp32 softplus) flipped one near-tie expert of
mini in situ on the H200. The slice partials run on the FP64 tensor cores (a `tl.sum` reduction
of broadcast fp64 products was several times slower), grouped: one program per slice was slower
at every T, its 40-row workspace costing more than the parallelism gains.
(measurements: docs/perf/router.md)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.norm import on_device
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait


def _supports_router(*, x: torch.Tensor, weight: torch.Tensor, k: int, **_) -> bool:
    return (on_device(x) and x.dim() == 2 and 1 <= k <= weight.shape[0]
            and x.dtype == weight.dtype == torch.bfloat16)


SLICE_K = 128  # K columns of one slice partial
GROUPS = 8  # slice groups (the fp64 order is a function of D only; see the module docstring)
BT, BE = 16, 32  # the default logits tile (tokens x experts)
DEFAULT_TILE = (BT, BE, 4, 3)  # (tokens, experts, warps, stages) per logits program
# Larger tiles for `logit_partials` / `router_tiled`: the same K order per logit (slices and
# groups depend on D only), so the same bits, and the op may pick the tile by T. sm_90 SASS of
# the slice loop: 15-20 instructions per DMMA against 52 for the default tile. Both operands
# go through shared memory as fp64 (128 x 128 x 8 bytes of x per stage), so the 128-token tile
# fits the H200's 227 KB with one stage only (192 KB; three need 288 KB). The default tile is
# the fastest at small T, the wide one at large T (measurements: docs/perf/router.md).
WIDE_TILE = (128, 64, 8, 1)
WIDE_FROM = 160  # tokens from which the op takes WIDE_TILE (linear estimate of the crossing)
MID_TILE = (64, 64, 8, 2)  # 160 KB, 136 registers, 19.7 instructions per DMMA


@triton.jit
def _f64(v, ASM: tl.constexpr):
    """bf16 -> fp64 (exact). ASM: through a non-pure inline-asm bf16 -> fp32 step, which keeps
    Triton from moving the conversion behind the shared-memory load of the dot operand (sm_90
    builds of a plain `.to(tl.float64)` abort: "fp64 don't support largeK MMA")."""
    if ASM:
        v = tl.inline_asm_elementwise("shl.b32 $0, $1, 16;", "=r,r",
                                      [v.to(tl.int16, bitcast=True).to(tl.int32)],
                                      dtype=tl.float32, is_pure=False, pack=1)
    return v.to(tl.float64)


@triton.jit
def _logits_kernel(x_ptr, w_ptr, ws_ptr, T, E, D, stride_xt, stride_we, SLICES, PER_PROG,
                   BT: tl.constexpr, BE: tl.constexpr, SLICE: tl.constexpr,
                   ASM: tl.constexpr):
    """ws[g, t, e] = sum over the PER_PROG slices s of group g (in order) of the slice partial
    p_s = fp64 dot of x[t, slice] and w[e, slice] (exact products; x, w bf16)."""
    pdl_wait()
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    re = tl.program_id(1) * BE + tl.arange(0, BE)
    grp = tl.program_id(2)
    rk = tl.arange(0, SLICE)
    tmask = rt < T
    emask = re < E
    xrow = x_ptr + rt[:, None].to(tl.int64) * stride_xt
    wrow = w_ptr + re[None, :].to(tl.int64) * stride_we
    acc = tl.zeros((BT, BE), dtype=tl.float64)
    s0 = grp * PER_PROG
    for s in range(s0, tl.minimum(s0 + PER_PROG, SLICES)):
        kk = s * SLICE + rk
        kmask = kk < D
        x = tl.load(xrow + kk[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(wrow + kk[:, None], mask=emask[None, :] & kmask[:, None], other=0.0)
        acc += tl.dot(_f64(x, ASM), _f64(w, ASM))
    out = ws_ptr + (grp * T + rt[:, None]).to(tl.int64) * E + re[None, :]
    tl.store(out, acc, mask=tmask[:, None] & emask[None, :])


@triton.jit
def _select_kernel(ws_ptr, bias_ptr, ids_ptr, w_ptr, T, E, temp, route_scale,
                   KTOP: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr,
                   G: tl.constexpr):
    """One token: logit = fp32(sum of the G fp64 group sums, in order); s = fp32(sqrt(softplus(
    fp64(logit / temp)))) (torch's softplus: x above 20 passes through; log1p(t) as
    log(u) t / (u - 1) with u = 1 + t, in fp64), then KTOP rounds of "largest s + bias, lowest
    id among equals" (= a stable descending sort's first KTOP; NaN ranks above every number, as
    in torch's sort); weights fp32(fp64(s) / (fp64 sum s + 1e-20)) * route_scale."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_P2)
    live = offs < E
    acc = tl.zeros((E_P2,), dtype=tl.float64)
    for g in tl.static_range(G):
        acc += tl.load(ws_ptr + (g * T + t) * E + offs, mask=live, other=0.0)
    x = tl.math.div_rn(acc.to(tl.float32), temp).to(tl.float64)  # IEEE, as torch's /
    ex = tl.exp(-tl.abs(x))
    u = 1.0 + ex
    log1p = tl.where(u == 1.0, ex, tl.log(u) * (ex / tl.where(u == 1.0, 1.0, u - 1.0)))
    s = tl.sqrt(tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)).to(tl.float32)
    key = s + tl.load(bias_ptr + offs, mask=live, other=0.0)
    key = tl.where(key != key, float("inf"), key)  # NaN first, like torch.sort descending
    key = tl.where(live, key, float("-inf"))
    slot = tl.arange(0, K_P2)
    ids = tl.zeros((K_P2,), dtype=tl.int32)
    ws = tl.zeros((K_P2,), dtype=tl.float32)
    total = tl.sum(ws.to(tl.float64), 0)
    for j in tl.static_range(KTOP):
        top = tl.max(key, 0)
        idx = tl.min(tl.where(key == top, offs, E_P2), 0)
        sj = tl.sum(tl.where(offs == idx, s, 0.0), 0)
        key = tl.where(offs == idx, float("-inf"), key)  # out of the running (keys are > -inf)
        ids = tl.where(slot == j, idx, ids)
        ws = tl.where(slot == j, sj, ws)
        total += sj.to(tl.float64)
    if KTOP > 1:
        ws = (ws.to(tl.float64) / (total + 1e-20)).to(tl.float32)
    mask = slot < KTOP
    tl.store(ids_ptr + t * KTOP + slot, ids.to(tl.int64), mask=mask)
    tl.store(w_ptr + t * KTOP + slot, ws * route_scale, mask=mask)


def logit_partials(x: torch.Tensor, weight: torch.Tensor,
                   tile: tuple[int, int, int, int] = DEFAULT_TILE) -> torch.Tensor:
    """The logits kernel's fp64 workspace [G, T, E]: the logit of (t, e) is the sum of the G
    rows in order. tile: (tokens, experts, warps, stages) per program; the bits do not depend
    on it."""
    bt, be, warps, stages = tile
    t, d = x.shape
    e = weight.shape[0]
    slices = triton.cdiv(d, SLICE_K)
    per_group = triton.cdiv(slices, GROUPS)
    groups = triton.cdiv(slices, per_group)
    ws = torch.empty(groups, t, e, dtype=torch.float64, device=x.device)
    _logits_kernel[(triton.cdiv(t, bt), triton.cdiv(e, be), groups)](
        x, weight, ws, t, e, d, x.stride(0), weight.stride(0), slices, per_group,
        BT=bt, BE=be, SLICE=SLICE_K, ASM=x.is_cuda, num_warps=warps,
        num_stages=stages, **PDL_LAUNCH)
    return ws


def logits_tile(t: int) -> tuple[int, int, int, int]:
    """The op's logits tile for T tokens (any tile gives the same bits)."""
    return WIDE_TILE if t >= WIDE_FROM else DEFAULT_TILE


def router_tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
                 route_scale: float, gate_temp: float = 1.0,
                 tile: tuple[int, int, int, int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op with the logits kernel's tile exposed (default `logits_tile(T)`; the bits do not
    depend on it)."""
    t = x.shape[0]
    e = weight.shape[0]
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    w = torch.empty(t, k, dtype=torch.float32, device=x.device)
    if t == 0:
        return ids, w
    xc = x if x.stride(1) == 1 else x.contiguous()
    wc = weight if weight.stride(1) == 1 else weight.contiguous()
    ws = logit_partials(xc, wc, logits_tile(t) if tile is None else tile)
    _select_kernel[(t,)](ws, bias.float().contiguous(), ids, w, t, e, float(gate_temp),
                         float(route_scale), KTOP=k, K_P2=triton.next_power_of_2(k),
                         E_P2=triton.next_power_of_2(e), G=ws.shape[0],
                         num_warps=4 if e <= 1024 else 8, **PDL_LAUNCH)
    return ids, w


@REGISTRY.implement("triton", "router", supports=_supports_router)
def router(*, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
           route_scale: float, gate_temp: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference: fp32(fp64 logits), sqrt(softplus) in fp64, top-k of
    s + bias by a stable descending sort (ties to the lower id), unbiased renormalised weights
    x route_scale (1e-20 literal). Returns (ids [T, k] int64, w [T, k] fp32)."""
    return router_tiled(x, weight, bias, k, route_scale, gate_temp)
