"""The blockwise-scaled FP8 GEMM (ops/triton/gemm_blockwise.py) against the exact blockwise sum
and the reference op, including rows whose 32-blocks span many binades (where folding the scales
into the codes loses bits). Runs on sm_90 or under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from shoal.ops.reference import gemm as ref_gemm  # noqa: E402
from shoal.quant.fp8 import (  # noqa: E402
    dequant_fp8_act,
    dequant_fp8_weight,
    quant_fp8_act,
    quant_fp8_weight,
)
from support.triton_interpreter import DEV, INTERP, needs_kernels, patch_interpreter  # noqa: E402

# (M, N, K, tile or None = autotuned, split)
CASES = [(1, 96, 256, (64, 64, 64, 4, 2), 1), (5, 64, 128, (64, 64, 128, 4, 2), 2),
         (37, 100, 320, (64, 64, 64, 4, 2), 3), (70, 33, 64, (128, 64, 64, 8, 2), 1)]


def _inputs(m: int, n: int, k: int, seed: int, spread: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if spread:  # per-block magnitudes over 2^-12 .. 2^12: folding would flush the small blocks
        x = x * torch.exp2(torch.randint(-12, 13, (m, k // 32), generator=g).float()
                           ).repeat_interleave(32, 1)
    w = torch.randn(n, k, generator=g) / k**0.5
    if spread:
        w = w * torch.exp2(torch.randint(-8, 9, (1, k // 32), generator=g).float()
                           ).repeat_interleave(32, 1)
    xb = x.to(torch.bfloat16)
    q, qs = quant_fp8_act(xb, 32)
    wc, ws = quant_fp8_weight(w, 32)
    return xb, q, qs, wc, ws


def _exact(q, qs, wc, ws) -> torch.Tensor:
    """The blockwise sum in fp64 (every product exact)."""
    a = dequant_fp8_act(q, qs, 32).double()
    b = dequant_fp8_weight(wc, ws, 32).double()
    return a @ b.T


@needs_kernels
@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("m,n,k,tile,split", CASES)
def test_blockwise_equals_exact_sum(monkeypatch, m, n, k, tile, split, spread) -> None:
    from shoal.ops.triton.gemm_blockwise import gemm_fp8_blockwise

    if INTERP:
        patch_interpreter(monkeypatch)
    xb, q, qs, wc, ws = _inputs(m, n, k, 7 * m + n + spread, spread)
    out = torch.full((m, n), float("nan"))  # poisoned: every element must be written
    got = gemm_fp8_blockwise(q.to(DEV), qs.to(DEV), wc.to(DEV), ws.to(DEV), split=split,
                             tile=tile if (INTERP or tile is None) else None).float().cpu()
    out.copy_(got)
    assert torch.isfinite(out).all()
    want = _exact(q, qs, wc, ws)
    # fp32 accumulation then one bf16 rounding: within one bf16 ulp plus fp32 sum error
    terms = dequant_fp8_act(q, qs, 32).double().abs() @ dequant_fp8_weight(wc, ws, 32
                                                                           ).double().abs().T
    lim = want.abs() * 2.0**-8 + terms * 2.0**-20 + 1e-30
    bad = (out.double() - want).abs() > lim
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements off the exact sum"
    ref = ref_gemm.gemm_fp8(x=xb, weight=wc, weight_scale=ws).float()
    assert ((out - ref).abs() <= ref.abs() * 2.0**-7 + terms.float() * 2.0**-19).all()


@needs_kernels
@pytest.mark.parametrize("byte,expect", [(0, 2.0**-127), (127, 1.0), (200, 2.0**73)])
def test_scale_bytes_decode_like_the_reference(monkeypatch, byte: int, expect: float) -> None:
    """UE8M0 0 is the subnormal 2^-127 (not 0); NaN (255) blocks give NaN outputs."""
    from shoal.ops.triton.gemm_blockwise import gemm_fp8_blockwise

    if INTERP:
        patch_interpreter(monkeypatch)
    a = torch.ones(1, 32).to(torch.float8_e4m3fn)
    w = torch.ones(64, 32).to(torch.float8_e4m3fn)
    a_s = torch.full((1, 1), 127, dtype=torch.uint8)
    w_s = torch.tensor([[byte], [255]], dtype=torch.uint8)
    got = gemm_fp8_blockwise(a.to(DEV), a_s.to(DEV), w.to(DEV), w_s.to(DEV), split=1,
                             tile=(64, 64, 32, 4, 2)).float().cpu()
    want = torch.tensor(32.0 * expect).to(torch.bfloat16).float()
    assert torch.equal(got[0, :32], want.expand(32)) and torch.isnan(got[0, 32:]).all()


def test_tiles_compile_for_sm90_without_spills() -> None:
    """AOT-compile every autotuned tile for sm_90 (Triton's bundled ptxas, no GPU needed): FP8
    wgmma (QGMMA) in the SASS and no register spills (stack 0), with and without split-K."""
    if INTERP:
        pytest.skip("compiles for sm_90: run without TRITON_INTERPRET")
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from shoal.ops.triton import gemm_blockwise as gb

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(tools, "cuobjdump")):
        pytest.skip("Triton's bundled cuobjdump is missing")
    kern = gb._blockwise_kernel.fn
    names = kern.arg_names
    ptrs = {"a_ptr": "*fp8e4nv", "as_ptr": "*u8", "b_ptr": "*fp8e4nv", "bs_ptr": "*u8",
            "c_ptr": "*bf16", "ws_ptr": "*fp32"}
    for cfg in gb._configs():
        for split in (1, 4):
            consts = {**cfg.kwargs, "SPLIT_K": split}
            sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
                     if n in ptrs or n in ("N", "K")}
            src = ASTSource(fn=kern, signature=sig, attrs=attrs,
                            constexprs={(names.index(n),): v for n, v in consts.items()})
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={
                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "k.cubin")
                with open(path, "wb") as f:
                    f.write(compiled.asm["cubin"])
                usage = subprocess.run([os.path.join(tools, "cuobjdump"),
                                        "--dump-resource-usage", path],
                                       capture_output=True, text=True, check=True).stdout
                sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path],
                                      capture_output=True, text=True, check=True).stdout
            tag = f"{consts} warps {cfg.num_warps} stages {cfg.num_stages}"
            assert re.search(r"STACK:0\b", usage), f"{tag}: spills ({usage.strip()})"
            assert "QGMMA" in sass, f"{tag}: no FP8 wgmma"
