"""Where a prefill chunk's time goes: `mini` (dummy weights, eager: prefill never replays a
graph) prefills prompts of --len tokens, one chunk of --len rows per step; after a warm-up
prompt (which compiles the prefill kernels), one prompt is timed unprofiled and one under
torch.profiler, whose top kernels by device time are printed with their share of the chunk.

    PYTHONPATH=src python3 benchmarks/profile_prefill.py [--len 8192] [--mode full] [--out DIR]
        [--batch-invariant]

The Triton kernels run with programmatic dependent launch (ops/triton/pdl.py): each may start
before the kernel ahead of it has finished and waits inside, so torch.profiler's per-kernel
times include that wait and overlap (their sum can exceed the wall time). Run with SHOAL_PDL=0 for
per-kernel times (session 13: a mini 8K prefill chunk's kernels sum to 238 ms with PDL on,
217 ms off; rope 411 against 219 us per call).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from shoal import LLM, SamplingParams
from shoal.bench import random_prompt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mini")
    ap.add_argument("--len", type=int, default=8192, dest="length")
    ap.add_argument("--mode", default="full", choices=["full", "staircase", "bounded"])
    ap.add_argument("--rows", type=int, default=40, help="kernels listed")
    ap.add_argument("--out", default="")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the batch-invariant op table (which kernels its prefill cost is in)")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", max_num_seqs=4, prefill_mode=args.mode,
              max_num_batched_tokens=args.length, max_model_len=args.length + 64,
              cuda_graphs=False, batch_invariant=args.batch_invariant)
    g = torch.Generator().manual_seed(0)
    prompts = [random_prompt(llm.config.model_config, args.length, g) for _ in range(3)]
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prefill(p: list[int]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    warm = prefill(prompts[0])
    wall = prefill(prompts[1])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill(prompts[2])
    ka = prof.key_averages()
    kernels = [e for e in ka if e.device_type != DeviceType.CPU and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in kernels) / 1e3
    kernels.sort(key=lambda e: -e.self_device_time_total)
    table = ", batch-invariant" if args.batch_invariant else ""
    lines = [f"==== {args.model} prefill of {args.length} tokens ({args.mode}{table}): warm-up "
             f"{warm:.2f} s, wall {wall * 1e3:.1f} ms unprofiled "
             f"({args.length / wall:.0f} tok/s), kernels {total:.1f} ms ===="]
    lines.append(f"{'kernel':70s} {'ms':>9s} {'share':>6s} {'calls':>6s} {'us/call':>9s}")
    for e in kernels[:args.rows]:
        ms = e.self_device_time_total / 1e3
        lines.append(f"{e.key[:70]:70s} {ms:9.2f} {ms / total:6.1%} {e.count:6d} "
                     f"{e.self_device_time_total / max(e.count, 1):9.1f}")
    lines += idle_report(prof)
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        name = f"profile_prefill_{args.mode}_{args.length}{'_inv' if table else ''}.txt"
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, name), "w") as f:
            f.write(text + "\n")


def idle_report(prof, gap_us: float = 20.0, rows: int = 8) -> list[str]:
    """Where the GPU waits for the host: gaps of more than `gap_us` between consecutive kernels
    of the profiled chunk (kernel names either side), and the host-blocking runtime calls."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    ks = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not ks:
        return ["no kernels in the trace"]
    gaps = []
    for a, b in zip(ks, ks[1:], strict=False):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > gap_us:
            gaps.append((g, a["name"], b["name"]))
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    busy = sum(e["dur"] for e in ks)
    lines = [f"GPU span {span / 1e3:.1f} ms, kernels busy {busy / 1e3:.1f} ms; "
             f"{len(gaps)} gaps > {gap_us:.0f} us sum {sum(g for g, _, _ in gaps) / 1e3:.1f} ms"]
    for g, a, b in sorted(gaps, reverse=True)[:rows]:
        lines.append(f"  gap {g:9.1f} us after {a[:50]} before {b[:50]}")
    blocking = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "cuda_runtime" and ("Synchronize" in name or "Memcpy" in name):
            n, t = blocking.get(name, (0, 0.0))
            blocking[name] = (n + 1, t + e.get("dur", 0.0))
    for name, (n, t) in sorted(blocking.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  host call {name:40s} {n:6d} calls {t / 1e3:9.2f} ms")
    return lines


if __name__ == "__main__":
    main()
