"""CUDA prefill MoE: `moe_mxfp4` for many routed rows with its two grouped GEMMs on FP8 wgmma
(moe_prefill.cu: 128 routed rows x 128 weight rows per CTA, K-blocks of 256 codes staged by
cp.async, the next block's weights converted to folded e4m3 while the tensor cores run this
one, fp32 promotion every 256 K) and the rest of the Triton pipeline (routing, the folded
activation quantiser, the combine: ops/triton/moe.py).

Not in the op table yet: `moe_mxfp4_prefill` is called by benchmarks/bench_moe.py (variant
`cuda_prefill`) and tests/cuda/test_cuda_moe_gpu.py until it is measured against the Triton
prefill tiles on the H200. Same contract as the reference op; needs K % 256 == 0 for both GEMMs
(D and the intermediate size).
"""

from __future__ import annotations

import torch
import triton

from shoal.ops.cuda.driver import Module
from shoal.ops.cuda.moe_decode import DecodeMoEState
from shoal.ops.cuda.nvrtc import compile_file
from shoal.ops.triton.moe import _combine, _quant_folded, empty_result
from shoal.ops.triton.moe_route import route

BM, BN, BK, THREADS, STAGES = 128, 128, 256, 256, 3
# moe_prefill.cu's SMEM_BYTES (STAGES slots of activations, packed weights and scales, two
# converted weight blocks) + the slack that aligns them to 1024 bytes
SMEM_BYTES = STAGES * (BM * BK + BN * BK // 2 + BN * BK // 32) + 2 * BN * BK + 1024


class PrefillMoEState(DecodeMoEState):
    """The decode state (its shift table and row maxima) plus the prefill module."""

    def __init__(self) -> None:
        super().__init__()
        self._prefill: Module | None = None

    def prefill_module(self, device: torch.device) -> Module:
        if self._prefill is None:
            self._prefill = Module(compile_file("moe_prefill.cu").cubin, device)
        return self._prefill


def supports(x: torch.Tensor, w2: torch.Tensor) -> bool:
    d, inter = x.shape[1], w2.shape[2] * 2
    return (x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0)
            and d % BK == 0 and inter % BK == 0)


def moe_mxfp4_prefill(*, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, limit: float, shared: torch.Tensor | None = None,
                      state: PrefillMoEState | None = None) -> torch.Tensor:
    """Same contract as the reference op (see the module docstring)."""
    if (empty := empty_result(x, shared)) is not None:
        return empty
    if not supports(x, w2):
        raise ValueError(f"moe_mxfp4_prefill needs sm_90 and K % {BK} == 0 for both GEMMs "
                         f"(D={x.shape[1]}, I={w2.shape[2] * 2})")
    state = state or PrefillMoEState()
    t, d = x.shape
    k = ids.shape[1]
    e, two_i, _ = w13.shape
    inter = two_i // 2
    module, lut = state.prefill_module(x.device), state.lut(x.device)
    w13, w2 = w13.contiguous(), w2.contiguous()
    s13, s2 = w13_scale.contiguous(), w2_scale.contiguous()
    wmax13, wmax2 = state.row_max(s13), state.row_max(s2)
    s13, s2 = (sc if sc.data_ptr() % 8 == 0 else sc.clone() for sc in (s13, s2))
    tok, orow, rw, counts = route(ids, weights, e)
    rows = t * k
    m_tiles = triton.cdiv(rows, BM) + min(e, rows)
    xq, xs = _quant_folded(x)
    h = torch.empty(rows, inter, dtype=torch.bfloat16, device=x.device)
    module.kernel("moe_w13_prefill")((triton.cdiv(inter, BN // 2), m_tiles), (THREADS,),
                                     xq.view(torch.uint8), xs, tok, h, rw, w13, s13, wmax13, lut,
                                     counts, inter, e, d, float(limit), shared=SMEM_BYTES)
    hq, hs = _quant_folded(h)
    y = torch.empty(rows, d, dtype=torch.bfloat16, device=x.device)
    module.kernel("moe_w2_prefill")((triton.cdiv(d, BN), m_tiles), (THREADS,),
                                    hq.view(torch.uint8), hs, y, orow, w2, s2, wmax2, lut,
                                    counts, d, e, inter, shared=SMEM_BYTES)
    return _combine(y, t, k, d, shared)

