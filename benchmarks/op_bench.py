"""Shared timing and reporting of the op benchmarks (bench_ops.py, bench_attn.py): CUDA-graph
replay timing over rotated inputs (`bench`), the H200 ceilings, and the table / JSON records
(`log`, `record`) one run collects in LINES and RESULTS.
"""

from __future__ import annotations

import itertools

import torch
import triton

HBM = 4.24e12
BF16_PEAK = 760e12
FP8_PEAK = 1343e12
L2_ROTATE_BYTES = 256 << 20

LINES: list[str] = []
RESULTS: list[dict] = []


def log(s: str) -> None:
    print(s, flush=True)
    LINES.append(s)


def bench(calls: list, warmup: int = 25, rep: int = 100) -> float:
    """Median ms per call of `calls` (zero-arg callables, one per rotated input set), timed as
    replays of one CUDA graph holding all of them (no host launch overhead: the engine runs
    decode under graphs); falls back to plain launches if capture fails."""
    for c in calls:  # compile + autotune outside the graph
        c()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                for c in calls:
                    c()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
        return ms / len(calls)
    except RuntimeError as exc:
        log(f"(graph capture failed: {exc!s:.80}; timing plain launches)")
        it = itertools.cycle(calls)
        return triton.testing.do_bench(lambda: next(it)(), warmup=warmup, rep=rep,
                                       return_mode="median")


def copies(nbytes: int) -> int:
    return max(1, min(16, -(-L2_ROTATE_BYTES // max(nbytes, 1))))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def record(kernel: str, shape: str, ms: float, flops: float, nbytes: float, peak: float,
           **extra) -> None:
    floor_s = max(nbytes / HBM, flops / peak)
    frac = floor_s / (ms * 1e-3)
    tfs = flops / (ms * 1e-3) / 1e12
    extra_s = " ".join(f"{k}={v}" for k, v in extra.items())
    log(f"{kernel:<22} {shape:<34} {ms * 1e3:9.1f} us {tfs:8.1f} TF/s "
        f"{nbytes / (ms * 1e-3) / 1e12:6.2f} TB/s  floor {floor_s * 1e6:8.1f} us  "
        f"frac {frac:5.2f} {extra_s}")
    RESULTS.append({"kernel": kernel, "shape": shape, "us": round(ms * 1e3, 2),
                    "tflops": round(tfs, 1), "frac_floor": round(frac, 3), **extra})
