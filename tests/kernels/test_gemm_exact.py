"""The `triton_exact` FP8 GEMM (ops/triton/gemm_exact.py: per 32-K block products scaled and
added in K order, the official kernel's rounding) against the reference op: bitwise but for the
order of the 32 products inside a block, which can move an fp32 sum by a few ulp and so,
rarely, the bf16 output by one ulp. Runs on sm_90 or under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.test_gemm_fp8 import _inputs  # noqa: E402
from shoal.ops.reference import gemm as ref_gemm  # noqa: E402
from support.triton_interpreter import DEV, INTERP, needs_kernels, patch_interpreter  # noqa: E402

# (M, N, K): decode rows, odd N (a partial 32-row weight block), several tiles
CASES = [(1, 96, 256), (5, 769, 128), (37, 100, 320), (70, 33, 64)]
MAX_ULP_FLIPS = 0.01  # share of outputs allowed one bf16 ulp off (the in-block order)


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.isfinite(got).all()
    off = got != want
    ulp = (want.abs().view(torch.int16).float() - got.abs().view(torch.int16).float()).abs()
    assert (ulp[off] <= 1).all() and (got.sign() == want.sign())[off].all()
    assert off.float().mean() <= MAX_ULP_FLIPS, f"{int(off.sum())} of {off.numel()} off by 1 ulp"


@needs_kernels
@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("m,n,k", CASES)
def test_blockwise_kernel_has_the_references_bits(monkeypatch, m, n, k, spread) -> None:
    from shoal.ops.triton.gemm_exact import gemm_fp8_blockwise

    if INTERP:
        patch_interpreter(monkeypatch)
    xb, q, qs, wc, ws = _inputs(m, n, k, 11 * m + n + spread, spread)
    got = torch.full((m, n), float("nan"), dtype=torch.bfloat16)  # poisoned: all written
    got.copy_(gemm_fp8_blockwise(q.to(DEV), qs.to(DEV), wc.to(DEV), ws.to(DEV),
                                 tile=(64, 64, 4, 2) if INTERP else None).cpu())
    _check(got, ref_gemm.gemm_fp8(x=xb, weight=wc, weight_scale=ws))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the op quantises on CUDA")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_op_has_the_references_bits_and_rows_do_not_depend_on_the_batch(m: int) -> None:
    from shoal.ops.triton.gemm_exact import gemm_fp8_exact

    xb, _, _, wc, ws = _inputs(m, 1280, 4096, m, False)
    dev = {"weight": wc.cuda(), "weight_scale": ws.cuda()}
    got = gemm_fp8_exact(x=xb.cuda(), **dev).cpu()
    _check(got, ref_gemm.gemm_fp8(x=xb, weight=wc, weight_scale=ws))
    alone = gemm_fp8_exact(x=xb[-1:].cuda(), **dev).cpu()
    assert torch.equal(alone, got[-1:])
