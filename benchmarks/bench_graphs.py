"""Decode TPOT with CUDA graphs against the same engine run eagerly (one `mini` engine with
dummy weights; the graphs are switched off by detaching them from the runner), each against the
step's HBM floor (`shoal.bench.decode_floor`). Also checks that both give the same greedy
tokens. Prints a table and ends with one JSON line.

    PYTHONPATH=src python3 benchmarks/bench_graphs.py [--batches 1 4 16] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from shoal import LLM, SamplingParams
from shoal.bench import bench_decode, git_commit, random_prompt


def greedy(llm: LLM, prompts: list[list[int]], steps: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mini")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", max_num_seqs=max(args.batches),
              max_num_batched_tokens=2048, max_model_len=args.prompt_len + args.steps + 64,
              cuda_graphs=True)
    runner = llm.engine.runner
    graphs = runner.graphs
    print(f"engine + warm-up + capture: {time.perf_counter() - t0:.1f} s; graphs: "
          f"{0 if graphs is None else graphs.num_graphs}", flush=True)
    g = torch.Generator().manual_seed(1)
    prompts = [random_prompt(llm.config.model_config, n, g) for n in (9, 140, 300)]
    with_graphs = greedy(llm, prompts, 12)
    runner.graphs = None
    eager_tokens = greedy(llm, prompts, 12)
    runner.graphs = graphs
    same = with_graphs == eager_tokens
    print(f"greedy tokens identical with and without graphs: {same}")
    rows = []
    print(f"{'batch':>5s} {'eager ms':>9s} {'graph ms':>9s} {'floor ms':>9s} {'eager/floor':>11s} "
          f"{'graph/floor':>11s}")
    for b in args.batches:
        runner.graphs = None
        eager = bench_decode(llm, b, args.prompt_len, args.steps)
        runner.graphs = graphs
        graphed = bench_decode(llm, b, args.prompt_len, args.steps)
        rows.append({"batch": b, "eager_tpot_ms": eager["tpot_ms"],
                     "graph_tpot_ms": graphed["tpot_ms"], "floor_ms": graphed["floor_ms"],
                     "eager_fraction_of_floor": eager["fraction_of_floor"],
                     "graph_fraction_of_floor": graphed["fraction_of_floor"],
                     "graph_host_prepare_share": graphed["host_prepare_share"]})
        r = rows[-1]
        print(f"{b:5d} {r['eager_tpot_ms']:9.2f} {r['graph_tpot_ms']:9.2f} {r['floor_ms']:9.3f} "
              f"{r['eager_fraction_of_floor']:11.3f} {r['graph_fraction_of_floor']:11.3f}",
              flush=True)
    commit = git_commit()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({"bench": "cuda_graphs", "commit": commit, "gpu": gpu,
                      "model": args.model, "graphs": 0 if graphs is None else graphs.num_graphs,
                      "tokens_identical": same, "decode": rows}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
