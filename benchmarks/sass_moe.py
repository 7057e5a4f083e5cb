"""sm_90 SASS statistics of the grouped MoE GEMM's tiles, on a machine without a GPU: each tile
is compiled ahead of time (`shoal.ops.triton.aot`) and reported with its registers, stack
(spills), shared memory and, for every K loop of the kernel (the largest backward branches; a
tile may have two, e.g. a closed-form and a table variant of the weight conversion), the
instructions per weight element a thread converts and the most frequent opcodes.

    PYTHONPATH=src python3 benchmarks/sass_moe.py      (also: bench_moe.py --sass)
"""

from __future__ import annotations

import collections
import dataclasses
import re

import bench_moe
import moe_tile_sweeps

from shoal.ops.triton import aot
from shoal.ops.triton import moe_tiles as tiles

MIN_LOOP = 100  # instructions: smaller backward branches are prologue / epilogue loops


def k_loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of every backward-branch loop body of at least MIN_LOOP instructions, in
    address order."""
    return [collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                                for t in body) for body in aot.loop_bodies(sass, MIN_LOOP)]


def tile_stats(cfg: tiles.TileConfig, swiglu: bool, convert: int, w4a8: bool = True,
               k: int = bench_moe.D) -> str:
    kern = aot.moe_gemm(cfg, swiglu, k, convert, w4a8=w4a8, experts=bench_moe.E)
    usage, sass = aot.usage_and_sass(kern)
    bk = cfg.block_k
    while k % bk:
        bk //= 2
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    per_thread = cfg.block_n * bk * (2 if swiglu else 1) // (32 * cfg.num_warps)
    parts = [f"regs {regs.group(1) if regs else '?'} stack {stack.group(1) if stack else '?'} "
             f"smem {kern.metadata.shared}"]
    for ops in k_loops(sass):
        n = sum(ops.values())
        top = ", ".join(f"{o}:{c}" for o, c in ops.most_common(8))
        parts.append(f"loop {n} instr / {per_thread} elem = {n / max(per_thread, 1):.2f} [{top}]")
    return " | ".join(parts)


def report(log=print) -> None:
    e = bench_moe.E
    rows = [("default decode", tiles.default_configs(6, e)),
            ("default mid (T=1024)", tiles.default_configs(6 * 1024, e)),
            ("default prefill", tiles.default_configs(6 * 8192, e)),
            ("swap decode", tiles.SWAP_DECODE),
            ("swap decode promoted", tuple(dataclasses.replace(c, promote=True)
                                           for c in tiles.SWAP_DECODE)),
            ("prefill promoted", tuple(dataclasses.replace(c, promote=True)
                                       for c in tiles.default_configs(6 * 8192, e))),
            *moe_tile_sweeps.DECODE_CFGS.items(), *moe_tile_sweeps.PLAIN_DECODE_CFGS.items(),
            *moe_tile_sweeps.PREFILL_CFGS.items()]
    for name, (c13, c2) in rows:
        for conv in ((2, 1) if c13.swap_ab else (1, 2)):
            for label, cfg, swiglu, k in (("w13", c13, True, bench_moe.D),
                                          ("w2", c2, False, bench_moe.INTER)):
                try:
                    stats = tile_stats(cfg, swiglu, conv, k=k)
                except Exception as exc:  # report and go on
                    stats = f"FAILED {type(exc).__name__}: {exc}"[:300]
                log(f"sass {name:22s} asm v{conv} {label:3s} {stats}")


if __name__ == "__main__":
    report()
