"""sm_90 builds for the CPU tests (`shoal.ops.triton.aot`), skipping where Triton's bundled
cuobjdump is missing."""

from __future__ import annotations

import pytest

from shoal.ops.triton import aot
from shoal.ops.triton.aot import stack_bytes  # noqa: F401  (re-exported for the tests)

H200_SMEM = 232448  # shared memory one CTA may use on the H200 (227 KB)


def sm90_compile(kern, args: dict, consts: dict, warps: int, stages: int,
                 divisible: tuple[str, ...] = ("N", "K")):
    """The compiled sm_90 kernel (`aot.build`: its metadata, e.g. `.shared`, and `.asm`)."""
    if not aot.has_tools():
        pytest.skip("Triton's bundled cuobjdump is missing")
    return aot.build(kern, args, consts, warps, stages, divisible)


def sm90_build(kern, args: dict, consts: dict, warps: int, stages: int,
               divisible: tuple[str, ...] = ("N", "K")) -> tuple[str, str]:
    """(cuobjdump resource usage, SASS) of an sm_90 build (`aot.build`)."""
    return aot.usage_and_sass(sm90_compile(kern, args, consts, warps, stages, divisible))


def sm90_ttgir(kern, args: dict, consts: dict, warps: int, stages: int,
               divisible: tuple[str, ...] = ("N", "K")) -> str:
    """The TritonGPU IR of an sm_90 build: the layouts Triton chose."""
    return aot.build(kern, args, consts, warps, stages, divisible).asm["ttgir"]
