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

from shoal.ops.cuda.driver import Module
from shoal.ops.cuda.moe_decode import DecodeMoEState, Family, run_grouped
from shoal.ops.cuda.nvrtc import compile_file
from shoal.ops.triton.moe import empty_result

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
    fam = Family("prefill", state.prefill_module(x.device), BM, BN // 2, BN, THREADS, SMEM_BYTES,
                 8, fp16=False)
    return run_grouped(fam, state, x, ids, weights, w13, w13_scale, w2, w2_scale, limit, shared)
