"""Launch cost of a chain of small dependent kernels in one CUDA graph, with and without
programmatic dependent launch (PDL: the next kernel is launched while the previous one drains,
and waits in `griddepcontrol.wait` until it has finished and its writes are visible).

Each kernel reads the previous kernel's output and writes the next buffer (a true dependency
chain, checked against the same chain run eagerly). Variants: plain launches; PDL with the
wait at the top and no early trigger (the dependent launches when the previous grid exits);
PDL with wait then `launch_dependents` at the top (the next grid is launched as soon as every
program of this one has passed its wait).

    PYTHONPATH=src python3 benchmarks/bench_pdl.py [--chain 200] [--sizes 5120,655360]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _step_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, WAIT: tl.constexpr,
                 TRIGGER: tl.constexpr):
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    tl.store(y_ptr + offs, x * 0.5 + 1.0, mask=m)


VARIANTS = {"plain": (False, False, False), "pdl_wait": (True, True, False),
            "pdl_trigger": (True, True, True)}


def chain(bufs, n, block, variant):
    pdl, wait, trigger = VARIANTS[variant]
    grid = (triton.cdiv(n, block),)
    for i in range(len(bufs) - 1):
        _step_kernel[grid](bufs[i], bufs[i + 1], n, BLOCK=block, WAIT=wait, TRIGGER=trigger,
                           num_warps=4, launch_pdl=pdl)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chain", type=int, default=200)
    ap.add_argument("--sizes", default="5120,655360")
    args = ap.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        block = 1024
        bufs = [torch.randn(n, device="cuda")] + [torch.empty(n, device="cuda")
                                                   for _ in range(args.chain)]
        want = bufs[0].clone()
        for _ in range(args.chain):
            want = want * 0.5 + 1.0
        for variant in VARIANTS:
            for b in bufs[1:]:
                b.fill_(float("nan"))
            chain(bufs, n, block, variant)  # compile outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                chain(bufs, n, block, variant)
            for b in bufs[1:]:
                b.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            exact = bool(torch.equal(bufs[-1], want))
            ms = triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
            row = {"n": n, "programs": triton.cdiv(n, block), "variant": variant,
                   "us_per_kernel": round(ms * 1e3 / args.chain, 3), "exact": exact}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"bench": "pdl", "gpu": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
