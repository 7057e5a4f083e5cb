"""The CUDA decode MoE (ops/cuda/moe_decode.py, backend "cuda"; loads in flight 1 and 2) on the
H200:
within the op's tolerance of the reference at mini's expert shapes (the conformance suite runs
the registry's cases too), a token's bits the same alone and in a batch, and the op captured in
a CUDA graph replays the eager result."""

from __future__ import annotations

import pytest
import torch

from support.error_map import mapped_failure
from support.graphs import replayed

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs CUDA sm_89+")]


def _inputs(t: int, e: int = 16, d: int = 5120, inter: int = 2304, k: int = 6, seed: int = 0):
    from shoal.quant.fp4 import quant_mxfp4

    g = torch.Generator(device="cuda").manual_seed(seed)  # weights made on the device (fast)
    w13, s13 = quant_mxfp4(torch.randn(e, 2 * inter, d, generator=g, device="cuda") / d ** 0.5)
    w2, s2 = quant_mxfp4(torch.randn(e, d, inter, generator=g, device="cuda") / inter ** 0.5)
    gc = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gc)[:k] for _ in range(t)])
    return dict(x=torch.randn(t, d, generator=gc).to(torch.bfloat16).cuda(), ids=ids.cuda(),
                weights=torch.rand(t, k, generator=gc).cuda(), w13=w13, w13_scale=s13, w2=w2,
                w2_scale=s2, limit=10.0)


@pytest.mark.parametrize("depth", [1, 2])
def test_matches_the_reference_and_rows_do_not_depend_on_the_batch(depth: int) -> None:
    from shoal.ops.cuda import moe_decode
    from shoal.ops.reference.moe import MOE_TOL, _moe_compare, moe_mxfp4
    from shoal.ops.registry import load_backends

    load_backends()
    state = moe_decode.DecodeMoEState(depth)
    kw = _inputs(64)
    assert moe_decode._supports(**kw)
    whole = moe_decode.moe_mxfp4(**kw, state=state)
    want = moe_mxfp4(**kw)
    with mapped_failure(whole, want, atol=MOE_TOL.atol, rtol=MOE_TOL.rtol, tile=(1, 128)):
        _moe_compare(whole, want, None)
    for rows in (slice(0, 1), slice(5, 6), slice(0, 16), slice(3, 40)):
        part = {k: (v[rows] if k in ("x", "ids", "weights") else v) for k, v in kw.items()}
        got = moe_decode.moe_mxfp4(**part, state=state)
        assert torch.equal(got.view(torch.int32), whole[rows].view(torch.int32)), rows


def test_graph_replay_equals_eager() -> None:
    from shoal.ops.cuda import moe_decode

    state = moe_decode.DecodeMoEState()
    kw = _inputs(8, seed=3)
    want = moe_decode.moe_mxfp4(**kw, state=state)
    assert torch.equal(replayed(lambda: moe_decode.moe_mxfp4(**kw, state=state)), want)


def test_prefill_kernels_match_the_reference_and_rows_do_not_depend_on_the_batch() -> None:
    """The FP8 wgmma prefill kernels (ops/cuda/moe_prefill.py) at 300 tokens (1,800 routed rows
    over 16 experts: full and partial 128-row tiles): within the MoE tolerance of the reference,
    and a token's bits the same in a smaller batch."""
    from shoal.ops.cuda import moe_prefill
    from shoal.ops.reference.moe import MOE_TOL, _moe_compare, moe_mxfp4

    state = moe_prefill.PrefillMoEState()
    kw = _inputs(300, seed=4)
    whole = moe_prefill.moe_mxfp4_prefill(**kw, state=state)
    want = moe_mxfp4(**kw)
    with mapped_failure(whole, want, atol=MOE_TOL.atol, rtol=MOE_TOL.rtol, tile=(1, 128)):
        _moe_compare(whole, want, None)
    for rows in (slice(0, 200), slice(37, 300)):
        part = {k: (v[rows] if k in ("x", "ids", "weights") else v) for k, v in kw.items()}
        got = moe_prefill.moe_mxfp4_prefill(**part, state=state)
        assert torch.equal(got.view(torch.int16), whole[rows].view(torch.int16)), rows
