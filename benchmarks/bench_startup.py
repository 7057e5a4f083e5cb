"""Engine start-up: `LLM(model)` timed in fresh processes, one after the other on one machine,
so the first shows a cold start (when the kernel caches are empty) and the later ones a warm
start (Triton's cache and shoal's `$SHOAL_CACHE_DIR` on disk). Per run: the import of shoal,
the whole `LLM(...)`, and its phases (weights, prefill warm-up, graph capture).

Run: PYTHONPATH=src python3 benchmarks/bench_startup.py [--model mini] [--runs 2]
     [--option key=value ...]   (LLM keyword options, values parsed as Python literals)
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import time

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from shoal import LLM
t1 = time.perf_counter()
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
t2 = time.perf_counter()
runner = llm.engine.runner
graphs = runner.graphs
print(json.dumps({"import_s": t1 - t0, "llm_s": t2 - t1, "weights_s": runner.load_seconds,
                  "prefill_warmup_s": runner.warmup_seconds,
                  "graph_capture_s": graphs.capture_seconds if graphs else 0.0,
                  "graphs": graphs.num_graphs if graphs else 0}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mini")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    rows = []
    print("run  import s  LLM() s  weights s  prefill warm-up s  capture s  graphs  wall s")
    for i in range(args.runs):
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, args.model, json.dumps(options)],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            sys.exit(f"run {i}: LLM({args.model!r}) failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1]) | {"wall_s": wall}
        rows.append(row)
        print(f"{i:3d}  {row['import_s']:8.1f}  {row['llm_s']:7.1f}  {row['weights_s']:9.1f}  "
              f"{row['prefill_warmup_s']:17.1f}  {row['graph_capture_s']:9.1f}  "
              f"{row['graphs']:6d}  {wall:6.1f}", flush=True)
    print(json.dumps({"bench": "startup", "model": args.model, "options": options,
                      "runs": rows}))


if __name__ == "__main__":
    main()
