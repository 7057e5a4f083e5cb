"""Drift of the approximate `bounded` tail-only prefill against the exact modes.

For random prompts on a scaled-down config, compares the next-token logits after prefill (and
after a few greedy decode steps) between `full` (the reference), `staircase` (exact: must be 0)
and `bounded` for several replay windows W. Prints a table and ends with one JSON line.
Random weights exaggerate nothing in particular: the numbers say how much the window floor
changes the computation, not how a trained model's accuracy moves.

`--official` measures against the official reference instead: on the checkpoints and prompts of
tests/data/official_goldens.json, each mode's log-probs of the reference's top-5 tokens after
the prefill and over the 16 decode steps, fed the reference's greedy tokens (teacher-forced),
against the reference's. `full` gives the floor: how far exact shoal is from the reference on
these chaotic random checkpoints (tests/model/test_official_goldens.py).

    .venv/bin/python benchmarks/bench_prefill_drift.py [--prompts 4] [--length 120]
    .venv/bin/python benchmarks/bench_prefill_drift.py --official
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import tokenizers
import torch

from shoal.bench import git_commit
from shoal.checkpoint.reader import CheckpointReader
from shoal.checkpoint.writer import generate_weights, write_checkpoint
from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams
from shoal.model.presets import TINY
from shoal.model.state import KVCaches
from shoal.ops.registry import resolve_ops


def run(model: DeepseekV41, ids: list[int], n: int, mode: str, window: int,
        decode_steps: int, forced: list[int] | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill ids[:n], then decode (greedy, or feeding `forced`); return the next-token logits
    after the prefill and after each step, and the greedy tokens."""
    cfg = model.config
    caches = KVCaches.allocate(cfg, num_blocks=8, num_slots=1, max_tokens=n, block_size=128)
    seq = list(ids[:n])
    rows, tokens = [], []
    for step in range(decode_steps + 1):
        start = 0 if step == 0 else len(seq) - 1
        chunk = RequestChunk.from_sequence(seq, start, len(seq) - start, 0, (0, 1, 2, 3), n)
        batch = build_forward_batch(cfg, [chunk], prefill_mode=mode, replay_window=window)
        logits = model.forward(batch, caches).logits[-1]
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        seq.append(forced[step] if forced is not None and step < len(forced) else tokens[-1])
    return rows, tokens


def official(windows: list[int]) -> None:
    """The modes against the official reference's goldens (module docstring)."""
    fixture = Path(__file__).parents[1] / "tests/data/official_goldens.json"
    goldens = json.loads(fixture.read_text())
    modes = [("full", 0), ("staircase", 0)] + [("bounded", w) for w in windows]
    print(f"{'case':20s} {'mode':10s} {'W':>4s} {'after prefill':>14s} {'decode':>8s} "
          f"{'greedy agree':>13s}")
    summary: dict[str, dict] = {}
    for case in goldens["cases"]:
        over = {k: tuple(v) if isinstance(v, list) else v for k, v in case["overrides"].items()}
        cfg = dataclasses.replace(TINY, name=case["name"], **over)
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = write_checkpoint(cfg, Path(tmp) / case["name"], seed=case["seed"])
            with CheckpointReader(ckpt) as reader:
                params = ModelParams.load(cfg, ((n, reader.get(n)) for n in reader.names()))
            tokenizer = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        model = DeepseekV41(cfg, params, resolve_ops("cpu"), token_map_for(cfg, tokenizer)
                            if cfg.engram_layer_ids else None)
        prompt, ref_tokens = case["prompt"], case["decode_tokens"]
        for mode, window in modes:
            rows, tokens = run(model, prompt, len(prompt), mode,
                               max(window, cfg.sliding_window), len(ref_tokens) - 1, ref_tokens)
            errs = [max(abs(float(row.double().log_softmax(-1)[t]) - lp) for t, lp in top)
                    for row, top in zip(rows, case["decode_top"], strict=True)]
            agree = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True)) / len(tokens)
            key = f"{mode}-{window}"
            summary.setdefault(key, {})[case["name"]] = {
                "after_prefill": errs[0], "decode": max(errs[1:]), "greedy_agreement": agree}
            print(f"{case['name']:20s} {mode:10s} {window:4d} {errs[0]:14.4f} "
                  f"{max(errs[1:]):8.4f} {agree:13.2%}")
    print(json.dumps({"bench": "prefill_drift_official", "commit": git_commit(),
                      "fixture": goldens["source"], "device": "cpu",
                      "metric": "max |logprob - reference| over the reference's top-5",
                      "results": summary}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--length", type=int, default=120)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--windows", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--official", action="store_true",
                    help="against the official reference's goldens (tests/data)")
    args = ap.parse_args()
    if args.official:
        official(args.windows)
        return
    cfg = TINY
    model = DeepseekV41(cfg, ModelParams.load(cfg, generate_weights(cfg, seed=0)),
                        resolve_ops("cpu"), token_map_for(cfg))
    g = torch.Generator().manual_seed(0)
    rows = []
    for p in range(args.prompts):
        ids = torch.randint(3, cfg.vocab_size, (args.length,), generator=g).tolist()
        (ref, *_), ref_tokens = run(model, ids, args.length, "full", cfg.sliding_window,
                                    args.decode)
        ref_p = ref.log_softmax(-1)
        for mode, window in [("staircase", 0)] + [("bounded", w) for w in args.windows]:
            (out, *_), tokens = run(model, ids, args.length, mode,
                                    max(window, cfg.sliding_window), args.decode)
            kl = float((ref_p.exp() * (ref_p - out.log_softmax(-1))).sum())
            agree = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True)) / len(tokens)
            rows.append({"prompt": p, "mode": mode, "window": window,
                         "max_abs_logit_diff": float((out - ref).abs().max()), "kl": kl,
                         "greedy_agreement": agree})
    print(f"{'mode':10s} {'W':>4s} {'max|dlogit|':>12s} {'KL':>10s} {'greedy agree':>13s}")
    summary = {}
    for mode, window in [("staircase", 0)] + [("bounded", w) for w in args.windows]:
        sel = [r for r in rows if r["mode"] == mode and r["window"] == window]
        agg = {k: sum(r[k] for r in sel) / len(sel)
               for k in ("max_abs_logit_diff", "kl", "greedy_agreement")}
        summary[f"{mode}-{window}"] = agg
        print(f"{mode:10s} {window:4d} {agg['max_abs_logit_diff']:12.4g} {agg['kl']:10.3g} "
              f"{agg['greedy_agreement']:13.2%}")
    commit = git_commit()
    print(json.dumps({"bench": "prefill_drift", "commit": commit, "config": cfg.name,
                      "prompt_len": args.length, "device": "cpu", "results": summary}))


if __name__ == "__main__":
    main()
