"""Which Triton op makes a chunked prefill differ from the whole prompt's? Runs `tiny` (dummy
weights, eager) on one prompt twice, whole and in chunks of `--chunk` tokens, and prints the
largest difference of the top-5 logprobs of greedy decode steps: with every op fast, with every
op the reference, then with only one op fast at a time (SHOAL_REFERENCE_OPS forces the rest).
Exactness needs 0 for each (chunked prefill = whole prefill, bitwise).

    PYTHONPATH=src python3 scripts/bisect_chunked.py [--model tiny] [--chunk 128] [--ops a,b]
"""

from __future__ import annotations

import argparse
import gc
import os

import torch

from shoal import LLM, SamplingParams
from shoal.bench import random_prompt
from shoal.config import resolve_model_config
from shoal.ops.registry import REGISTRY, load_backends


def run(model: str, prompt: list[int], chunk: int | None, steps: int, invariant: bool
        ) -> list[dict[int, float]]:
    opts = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(model, device="cuda", load_format="dummy", kv_cache_memory_gb=1.0, max_num_seqs=2,
              max_model_len=256 if model == "tiny" else 2048, block_size=128,
              prefill_mode="full", cuda_graphs=False, async_scheduling=False,
              batch_invariant=invariant, **opts)
    (out,) = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0.0, max_tokens=steps, logprobs=5,
                                         ignore_eos=True), use_tqdm=False)
    del llm
    gc.collect()
    return [{t: v.logprob for t, v in e.items()} for e in out.outputs[0].logprobs]


def difference(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
    worst = 0.0
    for ea, eb in zip(a, b, strict=True):
        if ea.keys() != eb.keys():
            return float("inf")
        worst = max([worst] + [abs(ea[t] - eb[t]) for t in ea])
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt-len", type=int, default=180)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ops", default="", help="only these ops one at a time (default: all)")
    ap.add_argument("--batch-invariant", action="store_true", help="RunnerConfig.batch_invariant")
    args = ap.parse_args()
    load_backends()
    prompt = random_prompt(resolve_model_config(args.model), args.prompt_len,
                           torch.Generator().manual_seed(5))
    names = sorted(REGISTRY.ops)
    chosen = args.ops.split(",") if args.ops else names

    def measure(fast: list[str] | None) -> float:
        forced = [] if fast is None else [n for n in names if n not in fast]
        os.environ["SHOAL_REFERENCE_OPS"] = ",".join(forced)
        return difference(run(args.model, prompt, None, args.steps, args.batch_invariant),
                          run(args.model, prompt, args.chunk, args.steps, args.batch_invariant))

    print(f"{args.model}: prompt {args.prompt_len}, chunks of {args.chunk}, {args.steps} steps")
    print(f"every op fast: {measure(None):.3g}", flush=True)
    print(f"every op the reference: {measure([]):.3g}", flush=True)
    for name in chosen:
        print(f"only {name} fast: {measure([name]):.3g}", flush=True)


if __name__ == "__main__":
    main()
