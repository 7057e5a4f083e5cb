"""Prefix caching on a shared-prefix workload: N requests = one P-token prefix + D distinct
tokens each, O output tokens, submitted together; the same requests with caching off, with the
device tier only, and from the store only (a fresh engine: cold device, warm disk), in one run.

Prints per variant the wall time, output tok/s, TTFT percentiles (submission to first token),
the prompt tokens resumed from the cache against the ideal (every request but the first
resumes at the last block boundary of the shared prefix), and against caching off the share
of identical outputs and the largest log-prob difference of the sampled tokens (0 for the exact
resume; the drift of `prefix_resume="bounded"` otherwise). Ends with one JSON line.

    python benchmarks/bench_prefix.py --model mini --load-format dummy   # H200
    .venv/bin/python benchmarks/bench_prefix.py --model tiny --num-requests 8 --prefix-len 300 \\
        --distinct-len 20 --output-len 4 --block-size 128 --max-model-len 512   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from shoal import LLM, SamplingParams
from shoal.bench import git_commit, random_prompt
from shoal.config import resolve_model_config


def percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"mean": statistics.fmean(values), "p50": pick(0.5), "p90": pick(0.9),
            "p99": pick(0.99)}


def run(args, prompts: list[list[int]], **cache) -> dict:
    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.max_model_len,
              block_size=args.block_size, prefill_mode=args.prefill_mode,
              max_num_seqs=args.max_num_seqs, **cache)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            logprobs=1)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    samples = [[(t, d[t].logprob) for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                   strict=True)] for o in outs]
    ttft = [1e3 * (o.metrics.first_token_time - o.metrics.arrival_time) for o in outs]
    stats = llm.engine.scheduler.prefix_stats
    offload = llm.engine.runner.offload
    if offload is not None:
        offload.flush()  # the store variant reads what this one wrote
    row = {"seconds": seconds, "output_tok_s": tokens / seconds, "ttft_ms": percentiles(ttft),
           "hit_tokens": 0 if stats is None else stats.hit_tokens,
           "store_hit_tokens": 0 if stats is None else stats.store_hit_tokens,
           "samples": samples}
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mini")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--prefix-len", type=int, default=8192)
    ap.add_argument("--distinct-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--prefill-mode", default="bounded")
    args = ap.parse_args()
    cfg = resolve_model_config(args.model)
    g = torch.Generator().manual_seed(0)
    shared = random_prompt(cfg, args.prefix_len, g)
    prompts = [shared + random_prompt(cfg, args.distinct_len, g)
               for _ in range(args.num_requests)]
    resume = (min(args.prefix_len, args.prefix_len + args.distinct_len - 1)
              // args.block_size * args.block_size)
    n = args.num_requests
    # off: none; device: all but the first; the writing run likewise; store (a fresh engine
    # over the written store): every request
    ideal = {"off": 0, "device": (n - 1) * resume, "device+store write": (n - 1) * resume,
             "store (cold device)": n * resume}
    with tempfile.TemporaryDirectory() as store:
        rows = {"off": run(args, prompts),
                "device": run(args, prompts, enable_prefix_caching=True),
                "device+store write": run(args, prompts, enable_prefix_caching=True,
                                          kv_store_path=store),
                "store (cold device)": run(args, prompts, enable_prefix_caching=True,
                                           kv_store_path=store),
                "device, bounded resume": run(args, prompts, enable_prefix_caching=True,
                                              prefix_resume="bounded")}
    ideal["device, bounded resume"] = ideal["device"]
    reference = rows["off"]["samples"]
    for row in rows.values():  # against caching off: same outputs? log-prob drift?
        same = drift = 0.0
        for ours, theirs in zip(row.pop("samples"), reference, strict=True):
            same += ours == theirs
            for (t, lp), (t_ref, lp_ref) in zip(ours, theirs, strict=True):
                if t != t_ref:
                    break
                drift = max(drift, abs(lp - lp_ref))
        row["identical_outputs"] = same / n
        row["max_logprob_drift"] = drift
    print(f"{n} requests x ({args.prefix_len} shared + {args.distinct_len}) tokens, "
          f"{args.output_len} out, block {args.block_size}, prefill {args.prefill_mode}")
    for name, row in rows.items():
        row["ideal_hit_tokens"] = ideal[name]
        print(f"{name:>20}: {row['seconds']:8.2f} s {row['output_tok_s']:9.1f} out tok/s  "
              f"TTFT p50 {row['ttft_ms']['p50']:9.1f} ms p90 {row['ttft_ms']['p90']:9.1f} ms  "
              f"hit {row['hit_tokens']} of ideal {ideal[name]} "
              f"({row['store_hit_tokens']} from the store)  identical outputs "
              f"{row['identical_outputs']:.0%}, drift {row['max_logprob_drift']:.3g}")
    print(json.dumps({"bench": "prefix", "commit": git_commit(),
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                      else "cpu", "config": vars(args), "variants": rows}))


if __name__ == "__main__":
    main()
