"""Drift of the approximate `bounded` tail-only prefill against the exact modes.

For random prompts on a scaled-down config, compares the next-token logits after prefill (and
after a few greedy decode steps) between `full` (the reference), `staircase` (exact: must be 0)
and `bounded` for several replay windows W. Prints a table and ends with one JSON line.
Random weights exaggerate nothing in particular: the numbers say how much the window floor
changes the computation, not how a trained model's accuracy moves.

    .venv/bin/python benchmarks/bench_prefill_drift.py [--prompts 4] [--length 120]
"""

from __future__ import annotations

import argparse
import json

import torch

from shoal.bench import git_commit
from shoal.checkpoint.writer import generate_weights
from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams
from shoal.model.presets import TINY
from shoal.model.state import KVCaches
from shoal.ops.registry import resolve_ops


def run(model: DeepseekV41, ids: list[int], n: int, mode: str, window: int,
        decode_steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill ids[:n], then greedy-decode; return the prefill logits and the greedy tokens."""
    cfg = model.config
    caches = KVCaches.allocate(cfg, num_blocks=8, num_slots=1, max_tokens=n, block_size=128)
    seq = list(ids[:n])
    logits0, tokens = None, []
    for step in range(decode_steps + 1):
        start = 0 if step == 0 else len(seq) - 1
        chunk = RequestChunk.from_sequence(seq, start, len(seq) - start, 0, (0, 1, 2, 3), n)
        batch = build_forward_batch(cfg, [chunk], prefill_mode=mode, replay_window=window)
        logits = model.forward(batch, caches).logits[-1]
        if logits0 is None:
            logits0 = logits
        token = int(logits.argmax())
        tokens.append(token)
        seq.append(token)
    return logits0, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--length", type=int, default=120)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--windows", type=int, nargs="+", default=[8, 16, 32, 64])
    args = ap.parse_args()
    cfg = TINY
    model = DeepseekV41(cfg, ModelParams.load(cfg, generate_weights(cfg, seed=0)),
                        resolve_ops("cpu"), token_map_for(cfg))
    g = torch.Generator().manual_seed(0)
    rows = []
    for p in range(args.prompts):
        ids = torch.randint(3, cfg.vocab_size, (args.length,), generator=g).tolist()
        ref, ref_tokens = run(model, ids, args.length, "full", cfg.sliding_window, args.decode)
        ref_p = ref.log_softmax(-1)
        for mode, window in [("staircase", 0)] + [("bounded", w) for w in args.windows]:
            out, tokens = run(model, ids, args.length, mode, max(window, cfg.sliding_window),
                              args.decode)
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
