"""Where a decode step's time goes: run `mini` (dummy weights) to pure decode at a batch size,
time a few steps unprofiled, run as many under cProfile (Python functions by cumulative time),
then profile as many with torch.profiler and print the top ops by device time and by host time
(host syncs show up as cudaStreamSynchronize / aten::item / aten::_local_scalar_dense).
--graphs profiles CUDA-graph replays instead (CUPTI still reports each kernel): the step's wall
time against the sum of its kernel times shows the launch gaps between kernels.

    PYTHONPATH=src python3 benchmarks/profile_decode.py --batch 1 --batch 64 [--graphs] [--out DIR]

The Triton kernels run with programmatic dependent launch (ops/triton/pdl.py): each may start
before the kernel ahead of it has finished and waits inside, so torch.profiler's per-kernel
times include that wait and overlap (their sum can exceed the wall time). Run with SHOAL_PDL=0 for
per-kernel times (session 13: a mini 8K prefill chunk's kernels sum to 238 ms with PDL on,
217 ms off; rope 411 against 219 us per call).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from shoal import LLM, SamplingParams
from shoal.bench import random_prompt


def routing_stats(llm: LLM) -> list[str]:
    """One eager decode step with the routed-experts op wrapped: per call, the tokens, distinct
    experts, the largest rows per expert and the op's time (CUDA events)."""
    fns = llm.engine.runner.ops.fns
    inner = fns["moe_mxfp4"]
    lines = []

    def wrapped(**kw):
        counts = torch.bincount(kw["ids"].flatten(), minlength=kw["w13"].shape[0])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = inner(**kw)
        end.record()
        torch.cuda.synchronize()
        lines.append(f"moe T={kw['ids'].shape[0]} experts={int((counts > 0).sum())} "
                     f"max_rows={int(counts.max())} {start.elapsed_time(end) * 1e3:.1f} us")
        return y

    fns["moe_mxfp4"] = wrapped
    try:
        llm.engine.step()
    finally:
        fns["moe_mxfp4"] = inner
    return lines


def run(llm: LLM, batch: int, prompt_len: int, steps: int, out: str, tag: str,
        routing: bool = False) -> None:
    g = torch.Generator().manual_seed(batch)
    budget = llm.config.scheduler.max_num_batched_tokens
    warm = -(-batch * prompt_len // budget) + 3
    params = SamplingParams(max_tokens=warm + 3 * steps + 3, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        llm.engine.add_request(None, params, prompt_token_ids=random_prompt(
            llm.config.model_config, prompt_len, g))
    for _ in range(warm):
        llm.engine.step()
    moe_lines = routing_stats(llm) if routing else []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):  # unprofiled wall time per step (host included)
        llm.engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    host = cProfile.Profile()  # where the host's share of a step goes (Python included)
    host.enable()
    for _ in range(steps):
        llm.engine.step()
    torch.cuda.synchronize()
    host.disable()
    buf = io.StringIO()
    pstats.Stats(host, stream=buf).sort_stats("cumulative").print_stats(45)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
    while llm.engine.has_unfinished():  # drain, so the next batch size starts clean
        llm.engine.step()
    ka = prof.key_averages()
    device = [e for e in ka if e.device_type != DeviceType.CPU]  # device events only
    kernels = sum(e.self_device_time_total for e in device) / 1e3 / steps
    launches = sum(e.count for e in device) / steps
    text = [f"==== batch {batch}, {steps} steps, {tag}: wall {wall_ms:.3f} ms per step "
            f"(unprofiled), kernels {kernels:.3f} ms per step, {launches:.0f} kernels per "
            f"step ====", *moe_lines,
            ka.table(sort_by="self_cuda_time_total", row_limit=35, max_name_column_width=70),
            ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70),
            f"---- cProfile of {steps} steps (cumulative) ----", buf.getvalue()]
    print("\n".join(text), flush=True)
    if out:
        with open(os.path.join(out, f"profile_decode_b{batch}_{tag}.txt"), "w") as f:
            f.write("\n".join(text))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mini")
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="")
    ap.add_argument("--graphs", action="store_true", help="profile CUDA-graph replays")
    ap.add_argument("--routing", action="store_true",
                    help="eager only: per routed-experts call, experts touched and its time")
    args = ap.parse_args()
    batches = args.batch or [1]
    llm = LLM(args.model, load_format="dummy", max_num_seqs=max(batches),
              max_num_batched_tokens=2048, max_model_len=args.prompt_len + 64,
              cuda_graphs=args.graphs, cuda_graph_batch_sizes=tuple(sorted(set(batches))))
    print(dict(llm.engine.runner.ops.origin), flush=True)
    for b in batches:
        run(llm, b, args.prompt_len, args.steps, args.out, "graphs" if args.graphs else "eager",
            routing=args.routing and not args.graphs)


if __name__ == "__main__":
    main()
