"""Prefix caching on a shared-prefix workload: N requests = one P-token prefix + D distinct
tokens each, O output tokens, submitted together; the same requests with caching off, with the
device tier only (`device`), writing the store (`store-write`), from the store only (`store`: a
fresh engine, cold device, warm disk) and with `prefix_resume="bounded"` (`bounded`), in one run.

Prints per variant the wall time, output tok/s, TTFT percentiles (submission to first token),
the prompt tokens resumed from the cache against the ideal (every request but the first resumes
at the last block boundary of the shared prefix that the resume rule accepts), and against caching off the share
of identical outputs and the largest log-prob difference of the sampled tokens (0 for the exact
resume; the drift of `prefix_resume="bounded"` otherwise). Ends with one JSON line.
`--variants off --save-off F` then `--variants ...rest --reference F` splits a run that does
not fit one process's time limit.

    python benchmarks/bench_prefix.py --model mini --load-format dummy   # H200
    .venv/bin/python benchmarks/bench_prefix.py --model tiny --num-requests 8 --prefix-len 150 \\
        --distinct-len 20 --output-len 4 --block-size 128 --max-model-len 256   # CPU smoke run
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

VARIANTS = ("off", "device", "store-write", "store",
            "bounded")


def percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"mean": statistics.fmean(values), "p50": pick(0.5), "p90": pick(0.9),
            "p99": pick(0.99)}


def ideal_hits(llm, args, resumers: int) -> int:
    """Prompt tokens resumed if `resumers` requests each resume at the last block boundary of
    the shared prefix that the engine's resume rule accepts (an exact resume needs exact rings
    for what the new tail reads: `TailRule`)."""
    prefix = llm.engine.scheduler.kv.prefix
    if prefix is None:
        return 0
    length, bs = args.prefix_len + args.distinct_len, args.block_size
    for boundary in range(min(args.prefix_len, length - 1) // bs * bs, 0, -bs):
        rule = prefix.rule
        if prefix.replay_window or rule.decoder_rings_exact(boundary, length) or \
                not rule.needs_decoder_rings(boundary, length):
            return resumers * boundary
    return 0


def run(args, prompts: list[list[int]], resumers: int = 0, **cache) -> dict:
    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.max_model_len,
              block_size=args.block_size, prefill_mode=args.prefill_mode,
              max_num_seqs=args.max_num_seqs, batch_invariant=args.batch_invariant, **cache)
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
           "ideal_hit_tokens": ideal_hits(llm, args, resumers), "samples": samples}
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
    ap.add_argument("--batch-invariant", action="store_true",
                    help="RunnerConfig.batch_invariant (exact resumes on the GPU)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--save-off", help="write the caching-off variant's samples to this file")
    ap.add_argument("--reference", help="compare against caching-off samples saved by --save-off "
                    "(a run split over two processes) instead of running that variant")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}")
    if "store" in variants and "store-write" not in variants:
        ap.error("'store' (a fresh engine) reads what 'store-write' wrote: run both")
    cfg = resolve_model_config(args.model)
    g = torch.Generator().manual_seed(0)
    shared = random_prompt(cfg, args.prefix_len, g)
    prompts = [shared + random_prompt(cfg, args.distinct_len, g)
               for _ in range(args.num_requests)]
    n = args.num_requests
    with tempfile.TemporaryDirectory() as store:
        kwargs = {"off": {}, "device": {"enable_prefix_caching": True},
                  "store-write": {"enable_prefix_caching": True, "kv_store_path": store},
                  "store": {"enable_prefix_caching": True, "kv_store_path": store},
                  "bounded": {"enable_prefix_caching": True,
                                             "prefix_resume": "bounded"}}
        # every request resumes but the first, except from the store (written by an earlier run)
        rows = {name: run(args, prompts, n if name == "store" else n - 1, **kwargs[name])
                for name in VARIANTS if name in variants}
    if args.reference:
        with open(args.reference) as f:
            reference = [[tuple(s) for s in r] for r in json.load(f)]
    else:
        reference = rows["off"]["samples"]
    if args.save_off:
        with open(args.save_off, "w") as f:
            json.dump(rows["off"]["samples"], f)
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
        print(f"{name:>11}: {row['seconds']:8.2f} s {row['output_tok_s']:9.1f} out tok/s  "
              f"TTFT p50 {row['ttft_ms']['p50']:9.1f} ms p90 {row['ttft_ms']['p90']:9.1f} ms  "
              f"hit {row['hit_tokens']} of ideal {row['ideal_hit_tokens']} "
              f"({row['store_hit_tokens']} from the store)  identical outputs "
              f"{row['identical_outputs']:.0%}, drift {row['max_logprob_drift']:.3g}")
    print(json.dumps({"bench": "prefix", "commit": git_commit(),
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                      else "cpu", "config": vars(args), "variants": rows}))


if __name__ == "__main__":
    main()
