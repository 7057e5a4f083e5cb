"""Triton (sm_90) compressor pooling `compress_pool` (model.md §2.6, ratio r >= 2).

Three launches, in stream order, none of which reads device data back to the host (the
outputs have one row per token, so a CUDA graph can capture the op):
1. `_close_kernel` (blocks of tokens): row id p // r for closing tokens ((p+1) % r == 0), -1
   for the others; each slot's last position this step (atomic max).
2. `_pool_kernel` (token, D tile): the r members of closing token c are token c - off when it is
   the same request at position p - off, else ring entry (p - off) % R of the slot
   (state [S, R, D], R >= r); per-channel softmax over the r members in fp32, then bf16 (round
   to nearest even). Non-closing tokens store a zero row.
3. `_park_kernel` (token, D tile): each slot's last R positions of this step (p > last - R)
   are copied into ring entry p % R. It runs after (2): an entry read by a group closed this
   step may be overwritten by a token parked in this step.
Invariant: row ids and the written state entries are exact; pooled is within bf16 tolerance of
the reference's fp64 softmax; ring entries not parked are untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.engram import bf16_rne
from shoal.ops.triton.norm import on_device
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait

SCAN_BLOCK = 1024


@triton.jit
def _close_kernel(pos_ptr, slot_ptr, rows_ptr, last_ptr, T, sp, ssl, R: tl.constexpr,
                  BLOCK: tl.constexpr):
    pdl_wait()
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = i < T
    p = tl.load(pos_ptr + i * sp, mask=valid, other=0).to(tl.int64)
    s = tl.load(slot_ptr + i * ssl, mask=valid, other=0).to(tl.int64)
    tl.atomic_max(last_ptr + s, p, mask=valid)
    tl.store(rows_ptr + i, tl.where((p + 1) % R == 0, p // R, -1), mask=valid)


@triton.jit
def _pool_kernel(kv_ptr, sc_ptr, pos_ptr, slot_ptr, skv_ptr, ssc_ptr, o_ptr,
                 RING, sp, ssl, skv_t, skv_d, ssc_t, ssc_d, st_s, st_r, st_d, su_s, su_r, su_d,
                 R: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    pdl_wait()
    c = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + c * sp).to(tl.int64)
    col = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = col < D
    if (p + 1) % R != 0:
        tl.store(o_ptr + c * D + col, tl.zeros([BD], tl.int16), mask=cmask)
    else:
        s = tl.load(slot_ptr + c * ssl).to(tl.int64)
        m = tl.arange(0, RP)
        off = (R - 1 - m).to(tl.int64)  # members oldest first: position p - off
        real = m < R
        tok = c - off
        tok_ok = real & (tok >= 0)
        tok_c = tl.maximum(tok, 0)
        same = tok_ok & (tl.load(slot_ptr + tok_c * ssl, mask=tok_ok, other=-1).to(tl.int64) == s)
        same = same & (tl.load(pos_ptr + tok_c * sp, mask=tok_ok, other=-1).to(tl.int64)
                       == p - off)
        from_state = real & ~same
        entry = (p - off) % RING
        mt = same[:, None] & cmask[None, :]
        ms = from_state[:, None] & cmask[None, :]
        kv = tl.load(kv_ptr + tok_c[:, None] * skv_t + col[None, :] * skv_d, mask=mt, other=0.0)
        kv += tl.load(skv_ptr + s * st_s + entry[:, None] * st_r + col[None, :] * st_d, mask=ms,
                      other=0.0)
        sc = tl.load(sc_ptr + tok_c[:, None] * ssc_t + col[None, :] * ssc_d, mask=mt, other=0.0)
        sc += tl.load(ssc_ptr + s * su_s + entry[:, None] * su_r + col[None, :] * su_d, mask=ms,
                      other=0.0)
        sc = tl.where(real[:, None], sc, float("-inf"))
        e = tl.exp(sc - tl.max(sc, axis=0)[None, :])
        pooled = tl.sum(kv * e, axis=0) / tl.sum(e, axis=0)
        tl.store(o_ptr + c * D + col, bf16_rne(pooled), mask=cmask)


@triton.jit
def _park_kernel(kv_ptr, sc_ptr, pos_ptr, slot_ptr, skv_ptr, ssc_ptr, last_ptr, RING, sp, ssl,
                 skv_t, skv_d, ssc_t, ssc_d, st_s, st_r, st_d, su_s, su_r, su_d, D: tl.constexpr,
                 BD: tl.constexpr):
    pdl_wait()
    i = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + i * sp).to(tl.int64)
    s = tl.load(slot_ptr + i * ssl).to(tl.int64)
    if p > tl.load(last_ptr + s) - RING:
        col = tl.program_id(1) * BD + tl.arange(0, BD)
        cmask = col < D
        entry = p % RING
        kv = tl.load(kv_ptr + i * skv_t + col * skv_d, mask=cmask)
        sc = tl.load(sc_ptr + i * ssc_t + col * ssc_d, mask=cmask)
        tl.store(skv_ptr + s * st_s + entry * st_r + col * st_d, kv, mask=cmask)
        tl.store(ssc_ptr + s * su_s + entry * su_r + col * su_d, sc, mask=cmask)


def _supports_pool(*, kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
                   ratio: int, **_) -> bool:
    if not (on_device(kv) and kv.dim() == 2 and isinstance(ratio, int) and ratio >= 2):
        return False
    t, d = kv.shape
    f32 = torch.float32
    return (kv.dtype == f32 and score.dtype == f32 and score.shape == (t, d)
            and positions.shape == (t,) and slots.shape == (t,)
            and not positions.is_floating_point() and not slots.is_floating_point()
            and state_kv.dtype == f32 and state_score.dtype == f32 and state_kv.dim() == 3
            and state_kv.shape[1] >= ratio and state_kv.shape[2] == d
            and state_score.shape == state_kv.shape
            and ratio <= 64)


@REGISTRY.implement("triton", "compress_pool", supports=_supports_pool)
def compress_pool(*, kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
                  ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-gated pooling of `ratio` consecutive tokens (the reference contract): returns
    (pooled [T, D] bf16, row ids [T] int64: j for the token closing group j, else -1 with a
    zero row) and parks each request's last R positions in the rings state_kv / state_score
    [S, R, D] (in place). No host read of device data."""
    t, d = kv.shape
    dev = kv.device
    if t == 0:
        return (torch.empty(0, d, dtype=torch.bfloat16, device=dev),
                torch.empty(0, dtype=positions.dtype, device=dev))
    rows = torch.empty(t, dtype=torch.int64, device=dev)
    last = torch.full((state_kv.shape[0],), -1, dtype=torch.int64, device=dev)
    pooled = torch.empty(t, d, dtype=torch.bfloat16, device=dev)
    sp, ssl = positions.stride(0), slots.stride(0)
    ring = state_kv.shape[1]
    block = min(SCAN_BLOCK, triton.next_power_of_2(t))
    _close_kernel[(triton.cdiv(t, block),)](positions, slots, rows, last, t, sp, ssl, R=ratio,
                                            BLOCK=block, num_warps=4, **PDL_LAUNCH)
    bd = min(triton.next_power_of_2(d), 512)
    strides = (kv.stride(0), kv.stride(1), score.stride(0), score.stride(1), *state_kv.stride(),
               *state_score.stride())
    _pool_kernel[(t, triton.cdiv(d, bd))](
        kv, score, positions, slots, state_kv, state_score, pooled.view(torch.int16), ring, sp,
        ssl, *strides, R=ratio, RP=triton.next_power_of_2(ratio), D=d, BD=bd, num_warps=4, **PDL_LAUNCH)
    _park_kernel[(t, triton.cdiv(d, bd))](
        kv, score, positions, slots, state_kv, state_score, last, ring, sp, ssl, *strides, D=d,
        BD=bd, num_warps=4, **PDL_LAUNCH)
    return pooled, rows.to(positions.dtype)
