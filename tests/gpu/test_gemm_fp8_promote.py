"""The FP8 GEMM with promoted accumulation (`gemm_fp8_folded(promote=True)`) against the
reference op, on sm_90 only (the interpreter's fp8 casts are unreliable; the kernel's compiled
sm_90 code is where promotion differs: an fp32 add per BLOCK_K step)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs sm_90")

from shoal.ops.reference import gemm as ref_gemm  # noqa: E402
from shoal.ops.triton import gemm as tri_gemm  # noqa: E402
from shoal.quant.fp8 import quant_fp8_weight  # noqa: E402


@pytest.mark.parametrize("m,n,k", [(1, 512, 4096), (37, 1536, 5120), (300, 4096, 2048)])
def test_promoted_gemm_matches_reference(m: int, n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(m + n)
    codes, scales = quant_fp8_weight(torch.randn(n, k, generator=g, device="cuda") / k**0.5)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    want = ref_gemm.gemm_fp8(x=x, weight=codes, weight_scale=scales).float()
    q, rs = tri_gemm._act_quant(x, 32, fold=True)
    prepared = tri_gemm.prepare_fp8_weight(codes, scales)
    chained = tri_gemm.gemm_fp8_folded(q, rs, prepared).float()
    promoted = tri_gemm.gemm_fp8_folded(q, rs, prepared, promote=True).float()
    err_p = float((promoted - want).norm() / want.norm())
    err_c = float((chained - want).norm() / want.norm())
    assert err_p < 1e-2, (err_p, err_c)
    assert err_p <= err_c * 1.05 + 1e-4, (err_p, err_c)  # promotion never loses accuracy
