"""Host-side cost of one decode step at large batch (no model, no GPU): scheduling, turning the
plan into a ForwardBatch, and building the sampling batch. This is the work that must stay a
small share of the GPU step (target < 5% at batch 256).

    .venv/bin/python benchmarks/bench_host.py [--batch 256] [--model mini]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shoal.bench import git_commit
from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.presets import get_preset
from shoal.sampling import SamplingBatch, SamplingParams, request_seed
from shoal.scheduler.config import SchedulerConfig
from shoal.scheduler.request import Request
from shoal.scheduler.scheduler import Scheduler
from shoal.scheduler.step_plan import StepResult


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--model", default="mini")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    cfg = get_preset(args.model)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=args.batch * args.prompt_len,
                                      max_num_seqs=args.batch, max_model_len=4096),
                      num_blocks=args.batch * 8, num_slots=args.batch, block_size=256)
    for i in range(args.batch):
        sched.add_request(Request(str(i), list(range(3, 3 + args.prompt_len)),
                                  max_tokens=args.steps + 5, eos_token_id=1))
    plan = sched.schedule()  # the prefill step (not timed)
    sched.update(plan, StepResult({r.request_id: [7] for r in plan.scheduled if r.sample}))
    params = SamplingParams(temperature=0.8, top_p=0.9)
    times = {"schedule+update": [], "forward_batch": [], "sampling_batch": []}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        chunks = [RequestChunk(r.token_ids, r.start_position, r.slot, r.block_ids,
                               r.prefill_len, "last", r.history_token_ids)
                  for r in plan.scheduled]
        build_forward_batch(cfg, chunks, prefill_mode="bounded")
        t2 = time.perf_counter()
        reqs = [sched.get_request(r.request_id) for r in plan.scheduled]
        SamplingBatch.from_params(
            [params] * len(reqs),
            seeds=[request_seed(None, engine_seed=0, request_index=i) for i in range(len(reqs))],
            positions=[q.num_tokens for q in reqs],
            output_token_ids=[q.output_token_ids for q in reqs], vocab_size=cfg.vocab_size)
        t3 = time.perf_counter()
        sched.update(plan, StepResult({r.request_id: [7] for r in plan.scheduled}))
        t4 = time.perf_counter()
        times["schedule+update"].append((t1 - t0) + (t4 - t3))
        times["forward_batch"].append(t2 - t1)
        times["sampling_batch"].append(t3 - t2)
    result = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    result["total_ms"] = sum(result.values())
    for k, v in result.items():
        print(f"{k:16s} {v:8.3f} ms")
    commit = git_commit()
    print(json.dumps({"bench": "host", "commit": commit, "model": args.model,
                      "batch": args.batch, "torch_threads": torch.get_num_threads(),
                      "ms": result}))


if __name__ == "__main__":
    main()
