"""Ahead-of-time sm_90 builds of the Triton kernels on a machine without a GPU (Triton's bundled
ptxas and cuobjdump): registers, spills, SASS and the layouts Triton chose. For the CPU tests
(tests/kernels/test_sm90_builds.py) and `benchmarks/sass_moe.py`; nothing at run time.

Builds are specialised as the JIT specialises them: pointers and the `divisible` integer
arguments are marked divisible by 16 (without that, the build differs from what runs, e.g. it
shows spills the real kernel does not have).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any

import triton

from shoal.ops.triton import moe as tmoe
from shoal.ops.triton import moe_tiles as tiles

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# the grouped MoE GEMM's (`moe._moe_gemm_kernel`) pointer and float arguments
MOE_GEMM_ARGS = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "arow_ptr": "*i32", "out_ptr": "*bf16",
                 "orow_ptr": "*i32", "rw_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*u8",
                 "cnt_ptr": "*i32", "lut_ptr": "*i32", "limit": "fp32"}


def has_tools() -> bool:
    return os.path.exists(os.path.join(TOOLS, "cuobjdump"))


def build(kern, args: dict[str, str], consts: dict[str, Any], warps: int, stages: int,
          divisible: tuple[str, ...] = ("N", "K"), maxnreg: int | None = None):
    """Compile `kern` (a @triton.jit function) for sm_90. args: argument -> Triton type
    ('*fp32', 'fp32', ...; other arguments are i32); consts: the constexpr values;
    maxnreg: ptxas's register cap."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kern.arg_names
    sig = {n: "constexpr" if n in consts else args.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if args.get(n, "").startswith("*") or n in divisible}
    src = ASTSource(fn=kern, signature=sig, attrs=attrs,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages,
                                   **({"maxnreg": maxnreg} if maxnreg else {})})


def usage_and_sass(compiled) -> tuple[str, str]:
    """(cuobjdump resource usage, SASS) of a build."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        run = [os.path.join(TOOLS, "cuobjdump")]
        usage = subprocess.run(run + ["--dump-resource-usage", path], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run(run + ["-sass", path], capture_output=True, text=True,
                              check=True).stdout
    return usage, sass


def loop_bodies(sass: str, min_len: int = 100) -> list[list[str]]:
    """The instructions of every backward-branch loop of at least `min_len` instructions (smaller
    ones are prologue / epilogue loops), in address order."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s+/\*([0-9a-f]{4,5})\*/\s+(.*?);", line) for line in sass.splitlines())
           if m]
    where = {a: i for i, (a, _) in enumerate(ins)}
    bodies = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        target = int(m.group(1), 16) if m else a
        if target < a and i + 1 - where.get(target, i) >= min_len:
            bodies.append([t for _, t in ins[where[target]:i + 1]])
    return bodies


def stack_bytes(usage: str) -> int:
    """Spilled bytes per thread (cuobjdump's STACK:n)."""
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def moe_gemm(cfg: tiles.TileConfig, swiglu: bool, k: int, convert: int, *, w4a8: bool = True,
             experts: int = 384):
    """Build `_moe_gemm_kernel` as `moe._launch` launches it: w13 (swiglu, gathered rows) or
    w2, K = k (BLOCK_K halved until it divides k), `convert` the e2m1 conversion variant."""
    bk = cfg.block_k
    while k % bk:
        bk //= 2
    consts = {"K": k, "E_P2": triton.next_power_of_2(experts),
              "KB_P2": triton.next_power_of_2(k // 32), "BM": cfg.block_m, "BN": cfg.block_n,
              "BK": bk, "SWIGLU": swiglu, "GATHER_A": swiglu, "W4A8": w4a8, "CONVERT": convert,
              "SWAP_AB": cfg.swap_ab, "PROMOTE": cfg.promote, "F16": cfg.f16 and w4a8,
              "FUSED_GU": cfg.fused_gate_up and swiglu}
    args = dict(MOE_GEMM_ARGS, a_ptr="*fp8e4nv" if w4a8 else "*bf16")
    return build(tmoe._moe_gemm_kernel, args, consts, cfg.num_warps, cfg.num_stages, ("N", "E"),
                 cfg.maxnreg)
