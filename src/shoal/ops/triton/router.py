"""Triton (sm_90) MoE router (`router`): fp32 gate logits through `gemm_nt` (exact bf16
products, fp32 sums in an order fixed per (E, D): a token's experts do not depend on the batch),
then one `_select_kernel` launch per step for sqrt-softplus, the biased top-k (ties to the lower
expert id, as a stable descending sort) and the renormalised weights: no sort, no torch glue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.gemm_nt import gemm_nt, supports_nt
from shoal.ops.triton.norm import on_device


def _supports_router(*, x: torch.Tensor, weight: torch.Tensor, k: int, **_) -> bool:
    return on_device(x) and x.dim() == 2 and 1 <= k <= weight.shape[0]


@triton.jit
def _select_kernel(logit_ptr, bias_ptr, ids_ptr, w_ptr, E, temp, route_scale,
                   KTOP: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr):
    """One token: s = sqrt(softplus(logit / temp)) (torch's softplus: x above 20 passes
    through; log1p(t) as log(u) t / (u - 1) with u = 1 + t), then KTOP rounds of "largest
    s + bias, lowest id among equals" (= a stable descending sort's first KTOP; NaN ranks above
    every number, as in torch's sort); weights s / (sum s + 1e-20) * route_scale."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_P2)
    live = offs < E
    x = tl.load(logit_ptr + t * E + offs, mask=live, other=0.0) / temp
    ex = tl.exp(-tl.abs(x))
    u = 1.0 + ex
    log1p = tl.where(u == 1.0, ex, tl.log(u) * (ex / tl.where(u == 1.0, 1.0, u - 1.0)))
    s = tl.sqrt(tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p))
    key = s + tl.load(bias_ptr + offs, mask=live, other=0.0)
    key = tl.where(key != key, float("inf"), key)  # NaN first, like torch.sort descending
    key = tl.where(live, key, float("-inf"))
    slot = tl.arange(0, K_P2)
    ids = tl.zeros((K_P2,), dtype=tl.int32)
    ws = tl.zeros((K_P2,), dtype=tl.float32)
    total = tl.sum(ws, 0)
    for j in tl.static_range(KTOP):
        top = tl.max(key, 0)
        idx = tl.min(tl.where(key == top, offs, E_P2), 0)
        sj = tl.sum(tl.where(offs == idx, s, 0.0), 0)
        key = tl.where(offs == idx, float("-inf"), key)  # out of the running (keys are > -inf)
        ids = tl.where(slot == j, idx, ids)
        ws = tl.where(slot == j, sj, ws)
        total += sj
    if KTOP > 1:
        ws = ws / (total + 1e-20)
    mask = slot < KTOP
    tl.store(ids_ptr + t * KTOP + slot, ids.to(tl.int64), mask=mask)
    tl.store(w_ptr + t * KTOP + slot, ws * route_scale, mask=mask)


@REGISTRY.implement("triton", "router", supports=_supports_router)
def router(*, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
           route_scale: float, gate_temp: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference: fp32 logits, sqrt(softplus), top-k of s + bias by a
    stable descending sort (ties to the lower id), unbiased renormalised weights x route_scale
    (1e-20 literal). Returns (ids [T, k] int64, w [T, k] fp32). The logits come from `gemm_nt`
    (exact bf16 products, fp32 sums in an order fixed per (E, D): a token's experts do not
    depend on the batch) when the weight is bf16, else from a true-fp32 torch matmul; the rest
    is one `_select_kernel` launch (no sort)."""
    if supports_nt(x, weight, torch.float32):
        logits = gemm_nt(x, weight, torch.float32)
    else:
        logits = torch.matmul(x.float(), weight.float().t())
    t, e = logits.shape
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    w = torch.empty(t, k, dtype=torch.float32, device=x.device)
    if t:
        _select_kernel[(t,)](logits.contiguous(), bias.float().contiguous(), ids, w, e,
                             float(gate_temp), float(route_scale), KTOP=k,
                             K_P2=triton.next_power_of_2(k), E_P2=triton.next_power_of_2(e),
                             num_warps=4 if e <= 1024 else 8)
    return ids, w
