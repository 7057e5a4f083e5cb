"""Ahead-of-time builds of Triton kernels for sm_90 on a machine without a GPU (Triton's bundled
ptxas and cuobjdump): register spills and SASS checks that CPU CI can run."""

from __future__ import annotations

import pytest
import triton


def _compile(kern, ptrs: dict, consts: dict, warps: int, stages: int,
             divisible: tuple[str, ...]):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kern.arg_names
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n in ptrs or n in divisible}
    src = ASTSource(fn=kern, signature=sig, attrs=attrs,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={
        "num_warps": warps, "num_stages": stages})


def sm90_ttgir(kern, ptrs: dict, consts: dict, warps: int, stages: int,
               divisible: tuple[str, ...] = ("N", "K")) -> str:
    """The TritonGPU IR of an sm_90 build (as `sm90_build`): the layouts Triton chose."""
    return _compile(kern, ptrs, consts, warps, stages, divisible).asm["ttgir"]


def sm90_build(kern, ptrs: dict, consts: dict, warps: int, stages: int,
               divisible: tuple[str, ...] = ("N", "K")) -> tuple[str, str]:
    """AOT-compile a Triton kernel for sm_90 with Triton's bundled ptxas (no GPU needed),
    specialised as the JIT would (pointers and `divisible` integers divisible by 16):
    (cuobjdump resource usage, SASS)."""
    import os
    import subprocess
    import tempfile

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(tools, "cuobjdump")):
        pytest.skip("Triton's bundled cuobjdump is missing")
    compiled = _compile(kern, ptrs, consts, warps, stages, divisible)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        run = [os.path.join(tools, "cuobjdump")]
        usage = subprocess.run(run + ["--dump-resource-usage", path], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run(run + ["-sass", path], capture_output=True, text=True,
                              check=True).stdout
    return usage, sass


def stack_bytes(usage: str) -> int:
    """Spilled bytes per thread from cuobjdump's resource usage (STACK:n)."""
    import re

    return int(re.search(r"STACK:(\d+)", usage).group(1))
