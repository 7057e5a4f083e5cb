"""The combine pass of the split sparse attention (`sparse_attn` in attention.py and the CUDA
kernel, ops/cuda/sparse_attn.py): a row's fp32 partials of its index-block splits merged in split
order, plus the sink."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait


@triton.jit
def _combine_kernel(part_ptr, ml_ptr, sink_ptr, o_ptr, H: tl.constexpr, D: tl.constexpr,
                    NSPLIT: tl.constexpr, HB: tl.constexpr, DB: tl.constexpr):
    """o = sum_s w_s acc_s / (sum_s w_s l_s + exp(sink - m)), w_s = exp(m_s - m), m = max_s m_s;
    the sums run over the splits in order, so trailing empty splits (m_s = -1e30, l_s = 0,
    acc_s = 0: padded index blocks) add exact zeros and leave the bits unchanged. Program
    (t, head block, column block): HB heads x DB columns (each output element's arithmetic
    does not depend on the blocking)."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * HB + tl.arange(0, HB)
    hmask = offs_h < H
    offs_d = tl.program_id(2) * DB + tl.arange(0, DB)
    m_all = tl.full((HB,), -1e30, dtype=tl.float32)
    for s in tl.static_range(NSPLIT):
        ml = ml_ptr + ((t * NSPLIT + s) * H + offs_h) * 2
        m_all = tl.maximum(m_all, tl.load(ml, mask=hmask, other=-1e30))
    denom = tl.zeros((HB,), dtype=tl.float32)
    acc = tl.zeros((HB, DB), dtype=tl.float32)
    for s in tl.static_range(NSPLIT):
        ml = ml_ptr + ((t * NSPLIT + s) * H + offs_h) * 2
        w_s = tl.exp(tl.load(ml, mask=hmask, other=-1e30) - m_all)
        denom += tl.load(ml + 1, mask=hmask, other=0.0) * w_s
        part = tl.load(part_ptr + ((t * NSPLIT + s) * H + offs_h[:, None]) * D + offs_d[None, :],
                       mask=hmask[:, None], other=0.0)
        acc += part * w_s[:, None]
    sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0)
    denom += tl.exp(sink - m_all)
    o = acc / denom[:, None]
    tl.store(o_ptr + t * H * D + offs_h[:, None] * D + offs_d[None, :], o.to(tl.bfloat16),
             mask=hmask[:, None])


def combine(part: torch.Tensor, ml: torch.Tensor, sink: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, H, D] bf16 from the splits' fp32 partials part [T, S, H, D] and ml [T, S, H, 2]
    (running max, denominator) and the sink [H] fp32 (`_combine_kernel`)."""
    t, split, h, d = part.shape
    hb, db = 16, min(d, 128)  # 16 heads x 128 columns (timing: docs/perf/attention.md)
    _combine_kernel[(t, triton.cdiv(h, hb), d // db)](part, ml, sink, out, H=h, D=d,
                                                      NSPLIT=split, HB=hb, DB=db, num_warps=4,
                                                      **PDL_LAUNCH)
