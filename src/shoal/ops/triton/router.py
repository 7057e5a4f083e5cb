"""Triton (sm_90) MoE router (`router`), two launches per call, no torch glue:

1. `_logits_kernel`: gate logits with exact bf16 products summed in fp64, over a fixed number of
   K slices (a function of D only, so a token's logits do not depend on the batch), partial sums
   to an fp64 workspace;
2. `_select_kernel`: one token per program: the slices summed in fixed order and rounded to
   fp32 (the reference's fp32(fp64 dot)), sqrt-softplus in fp64 then rounded to fp32 (as the
   reference), the biased top-k (ties to the lower expert id, as a stable descending sort) and
   the weights renormalised in fp64.

So the routing matches the reference bit for bit except where an fp64 rounding (summation
order, exp/log in the last fp64 bits) crosses an fp32 rounding boundary: about 2^-29 per value.
An fp32-sum router (the earlier `gemm_nt` logits, fp32 softplus) flipped one near-tie expert of
mini in situ on the H200 (2026-11-29).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.norm import on_device


def _supports_router(*, x: torch.Tensor, weight: torch.Tensor, k: int, **_) -> bool:
    return on_device(x) and x.dim() == 2 and 1 <= k <= weight.shape[0]


K_SLICES = 8  # K slices of the logit sum (fixed, so the fp64 summation order is too)


@triton.jit
def _logits_kernel(x_ptr, w_ptr, ws_ptr, T, E, D, stride_xt, stride_we,
                   BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, S: tl.constexpr):
    """ws[s, t, e] = sum over K slice s of fp64(x[t, k]) * fp64(w[e, k]) (exact products)."""
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    re = tl.program_id(1) * BE + tl.arange(0, BE)
    sl = tl.program_id(2)
    per = tl.cdiv(tl.cdiv(D, BK), S) * BK
    k0 = sl * per
    k1 = tl.minimum(k0 + per, D)
    rk = tl.arange(0, BK)
    tmask = rt < T
    emask = re < E
    acc = tl.zeros((BT, BE), dtype=tl.float64)
    for kk in range(k0, k1, BK):
        kmask = kk + rk < k1
        x = tl.load(x_ptr + rt[:, None].to(tl.int64) * stride_xt + (kk + rk)[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0).to(tl.float64)
        w = tl.load(w_ptr + re[:, None].to(tl.int64) * stride_we + (kk + rk)[None, :],
                    mask=emask[:, None] & kmask[None, :], other=0.0).to(tl.float64)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out = ws_ptr + (sl * T + rt[:, None]).to(tl.int64) * E + re[None, :]
    tl.store(out, acc, mask=tmask[:, None] & emask[None, :])


@triton.jit
def _select_kernel(ws_ptr, bias_ptr, ids_ptr, w_ptr, T, E, temp, route_scale,
                   KTOP: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr,
                   S: tl.constexpr):
    """One token: logit = fp32(sum of the S fp64 slices, in order); s = fp32(sqrt(softplus(
    fp64(logit / temp)))) (torch's softplus: x above 20 passes through; log1p(t) as
    log(u) t / (u - 1) with u = 1 + t, in fp64), then KTOP rounds of "largest s + bias, lowest
    id among equals" (= a stable descending sort's first KTOP; NaN ranks above every number, as
    in torch's sort); weights fp32(fp64(s) / (fp64 sum s + 1e-20)) * route_scale."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_P2)
    live = offs < E
    acc = tl.zeros((E_P2,), dtype=tl.float64)
    for sl in tl.static_range(S):
        acc += tl.load(ws_ptr + (sl * T + t) * E + offs, mask=live, other=0.0)
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


@REGISTRY.implement("triton", "router", supports=_supports_router)
def router(*, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
           route_scale: float, gate_temp: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference: fp32(fp64 logits), sqrt(softplus) in fp64, top-k of
    s + bias by a stable descending sort (ties to the lower id), unbiased renormalised weights
    x route_scale (1e-20 literal). Returns (ids [T, k] int64, w [T, k] fp32)."""
    t, d = x.shape
    e = weight.shape[0]
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    w = torch.empty(t, k, dtype=torch.float32, device=x.device)
    if t == 0:
        return ids, w
    xc = x if x.stride(1) == 1 else x.contiguous()
    wc = weight if weight.stride(1) == 1 else weight.contiguous()
    ws = torch.empty(K_SLICES, t, e, dtype=torch.float64, device=x.device)
    bt, be, bk = 16, 32, 16
    _logits_kernel[(triton.cdiv(t, bt), triton.cdiv(e, be), K_SLICES)](
        xc, wc, ws, t, e, d, xc.stride(0), wc.stride(0), BT=bt, BE=be, BK=bk, S=K_SLICES,
        num_warps=4)
    _select_kernel[(t,)](ws, bias.float().contiguous(), ids, w, t, e, float(gate_temp),
                         float(route_scale), KTOP=k, K_P2=triton.next_power_of_2(k),
                         E_P2=triton.next_power_of_2(e), S=K_SLICES,
                         num_warps=4 if e <= 1024 else 8)
    return ids, w
