"""The decode FP8 GEMV (ops/triton/gemv_fp8.py) against the reference op: fused activation
quantisation (same codes and scales), exact products, fp32 sums. Runs on sm_90 or under the
Triton interpreter."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from shoal.ops.reference import gemm as ref_gemm  # noqa: E402
from shoal.quant.fp8 import (  # noqa: E402
    dequant_fp8_act,
    dequant_fp8_weight,
    quant_fp8_act,
    quant_fp8_weight,  # noqa: E402
)
from support.triton_interpreter import DEV, INTERP, needs_kernels, patch_interpreter  # noqa: E402


@needs_kernels
@pytest.mark.parametrize("m,n,k,split", [(1, 96, 256, 1), (3, 70, 512, 2), (8, 33, 1024, 4),
                                         (5, 64, 96, None), (1, 40, 64, 1)])
@pytest.mark.parametrize("spread", [False, True])
def test_gemv_matches_reference(monkeypatch, m, n, k, split, spread) -> None:
    from shoal.ops.triton.gemv_fp8 import gemv_fp8

    if INTERP:
        patch_interpreter(monkeypatch)
    g = torch.Generator().manual_seed(31 * m + n + k + spread)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :7] = 0.0  # a partly zero block
    if spread:  # per-block magnitudes over 2^-12 .. 2^12; e4m3 subnormal codes included
        x = x * torch.exp2(torch.randint(-12, 13, (m, k // 32), generator=g).float()
                           ).repeat_interleave(32, 1)
    xb = x.to(torch.bfloat16)
    wc, ws = quant_fp8_weight(torch.randn(n, k, generator=g) / k**0.5, 32)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)  # poisoned
    out.copy_(gemv_fp8(xb.to(DEV), wc.to(DEV), ws.to(DEV), split=split).cpu())
    ref = ref_gemm.gemm_fp8(x=xb, weight=wc, weight_scale=ws).float()
    q, qs = quant_fp8_act(xb, 32)
    terms = dequant_fp8_act(q, qs, 32).double().abs() @ dequant_fp8_weight(wc, ws, 32
                                                                           ).double().abs().T
    # same codes, exact products, fp32 sums: one bf16 rounding apart (plus fp32 sum order)
    lim = ref.double().abs() * 2.0**-8 + terms * 2.0**-20 + 1e-30
    bad = (out.double() - ref.double()).abs() > lim
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements off the reference"


@needs_kernels
def test_gemv_scale_bytes_and_bad_shapes(monkeypatch) -> None:
    """UE8M0 weight byte 0 is 2^-127, 255 gives NaN; more than 8 rows is refused."""
    from shoal.ops.triton.gemv_fp8 import gemv_fp8

    if INTERP:
        patch_interpreter(monkeypatch)
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    w = torch.ones(64, 32).to(torch.float8_e4m3fn)
    w_s = torch.tensor([[200], [255]], dtype=torch.uint8)
    got = gemv_fp8(x.to(DEV), w.to(DEV), w_s.to(DEV), split=1).float().cpu()
    assert torch.equal(got[0, :32], torch.full((32,), 32.0 * 2.0**73).to(torch.bfloat16).float())
    assert torch.isnan(got[0, 32:]).all()
    with pytest.raises(ValueError, match="M <= 8"):
        gemv_fp8(torch.ones(9, 32, dtype=torch.bfloat16, device=DEV), w.to(DEV), w_s.to(DEV))
