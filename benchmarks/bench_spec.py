"""Speculative decoding machinery at a chosen acceptance rate (random weights draft nothing
useful, so a drafting oracle stands in for the draft head's choices).

One plain run records every request's greedy output; the speculative runs then keep the DSpark
draft block running as usual (its cost, its confidence head and the confidence rule's cut
included) but replace each kept draft token by the recorded plain token at that position,
corrupted with probability 1 - `rate` (a per-position acceptance of about `rate`). For each
batch size and rate: output tokens/s against plain decoding in the same process, mean accepted
length, and with `--confidence T` (or `--verify-budget N`) the verify rows the confidence rule
(or the batch's verify budget) skipped. Every
speculative run's tokens must equal the plain run's (exact verification): checked and printed.

Run: PYTHONPATH=src python3 benchmarks/bench_spec.py [--model mini] [--batches 1 16 64]
     [--rates 0 0.3 0.6 0.9] [--confidence 0.5] [--verify-budget 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from shoal import LLM, SamplingParams
from shoal.bench import git_commit, random_prompt
from shoal.config import resolve_model_config
from shoal.runner import model_runner
from shoal.runner.inflight import upload
from shoal.runner.speculative import propose_drafts


class Oracle:
    """`propose_drafts` with the kept draft tokens replaced by the recorded run's, each
    corrupted with probability 1 - rate, on the device (no host sync: steps still overlap).
    `expected[prompt]`: that prompt's plain output (all of one length)."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.rows = {prompt: i for i, prompt in enumerate(expected)}
        self.table = torch.tensor(list(expected.values()), dtype=torch.int64)
        self.vocab, self.rate, self.seed = vocab, 1.0, 0
        self.generator: torch.Generator | None = None

    def reset(self, rate: float, seed: int) -> None:
        self.rate, self.seed, self.generator = rate, seed, None

    def __call__(self, model, caches, batch, captures, layout, accepted, last, states, *args,
                 **kwargs):
        proposal = propose_drafts(model, caches, batch, captures, layout, accepted, last,
                                  states, *args, **kwargs)
        if proposal is None:
            return None
        if self.generator is None:  # (on the engine's device, once per run)
            self.table = self.table.to(proposal.next_ids.device)
            self.generator = torch.Generator(device=self.table.device)
            self.generator.manual_seed(self.seed)
        order = sorted(proposal.index, key=proposal.index.get)
        rows, starts = upload([[self.rows[states[r].prompt_token_ids] for r in order],
                               [len(states[r].prompt_token_ids) - 2 for r in order]],
                              self.table.device)
        done = proposal.positions - starts  # output index of the first draft
        k, length = proposal.next_ids.shape[1] - 1, self.table.shape[1]
        cols = done.unsqueeze(1) + torch.arange(k, device=done.device)
        future = self.table[rows.unsqueeze(1), cols.clamp(max=length - 1)]
        wrong = torch.rand(future.shape, generator=self.generator,
                           device=future.device) >= self.rate
        # (drafts past the record lie past max_tokens: the scheduler never verifies them)
        proposal.next_ids[:, 1:] = torch.where(wrong, (future + 1) % self.vocab, future)
        return proposal


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mini")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.3, 0.6, 0.9])
    ap.add_argument("--confidence", type=float, default=0.5,
                    help="spec_confidence of the extra run at the largest batch (0: none)")
    ap.add_argument("--verify-budget", type=int, default=0,
                    help="spec_verify_budget of another run at the largest batch (0: none)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="plain and speculative runs with async scheduling")
    ap.add_argument("--spec-overlap", action="store_true",
                    help="speculative verify steps planned while the previous one runs")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="a prompt's plain tokens do not depend on the batch (the oracle's "
                         "record is the largest batch's)")
    args = ap.parse_args()
    cfg = resolve_model_config(args.model)
    opts = {"device": args.device, "load_format": "dummy", "max_num_seqs": max(args.batches),
            "max_model_len": args.prompt_len + args.max_tokens + 64,
            "batch_invariant": args.batch_invariant, "async_scheduling": args.async_scheduling}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [random_prompt(cfg, args.prompt_len, g) for _ in range(max(args.batches))]
    plain = LLM(args.model, **opts)
    print(f"{args.model}: prompts {args.prompt_len}, {args.max_tokens} greedy tokens, "
          f"draft length {cfg.dspark_draft_len}", flush=True)
    rows, expected, plain_s = [], {}, {}
    for b in args.batches:
        run(plain, prompts[:b], SamplingParams(max_tokens=2))  # warm the shapes
        expected[b], plain_s[b] = run(plain, prompts[:b], params)
    del plain
    gc.collect()
    longest = max(args.batches)
    oracle = Oracle({tuple(p): out for p, out in zip(prompts, expected[longest], strict=True)},
                    cfg.vocab_size)
    model_runner.propose_drafts = oracle
    runs = [(rate, 0.0, 0) for rate in args.rates]
    if args.confidence > 0:
        runs.append((args.rates[-1], args.confidence, 0))
    if args.verify_budget > 0:
        runs.append((args.rates[-1], 0.0, args.verify_budget))
    spec, spec_rule = None, None
    print("batch  rate  conf  budget   tok/s  plain tok/s  speed-up  mean accepted  skipped  "
          "overlap  same",
          flush=True)
    for rate, conf, budget in runs:  # one engine at a time: each takes most of the free memory
        if spec is None or (conf, budget) != spec_rule:
            del spec
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            spec, spec_rule = LLM(args.model, speculative=True, spec_overlap=args.spec_overlap,
                                  spec_confidence=conf,
                                  spec_verify_budget=budget, **opts), (conf, budget)
        for b in args.batches if (conf, budget) == (0, 0) else [max(args.batches)]:
            oracle.reset(rate, b)
            run(spec, prompts[:b], SamplingParams(max_tokens=2))
            before = dict(vars(spec.engine.stats))
            got, secs = run(spec, prompts[:b], params)
            s = spec.engine.stats
            accepted = s.drafts_accepted - before["drafts_accepted"]
            verify = s.verify_rows - before["verify_rows"]
            skipped = s.drafts_skipped - before["drafts_skipped"]
            steps = s.steps - before["steps"]  # share launched before the previous was read
            overlap = (s.overlapped_steps - before["overlapped_steps"]) / steps if steps else 0.0
            tokens = b * args.max_tokens
            row = {"batch": b, "rate": rate, "confidence": conf, "verify_budget": budget,
                   "tok_s": tokens / secs,
                   "plain_tok_s": tokens / plain_s[b], "speedup": plain_s[b] / secs,
                   "mean_accepted": 1 + accepted / verify if verify else 0.0,
                   "skipped": skipped, "overlap": overlap, "same_tokens": got == expected[b]}
            rows.append(row)
            print(f"{b:5d}  {rate:4.2f}  {conf:4.2f}  {budget:6d}  {row['tok_s']:6.1f}  "
                  f"{row['plain_tok_s']:11.1f}  {row['speedup']:8.2f}  "
                  f"{row['mean_accepted']:13.2f}  {skipped:7d}  {overlap:7.0%}  "
                  f"{row['same_tokens']}",
                  flush=True)
    print(json.dumps({"bench": "spec", "commit": git_commit(), "model": args.model,
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                      else "cpu", "rows": rows}))


if __name__ == "__main__":
    main()
