"""Data parallelism under torchrun (two CPU processes, gloo; one launch): every rank's `generate`
returns one engine's outputs in input order, across calls and with expert parallelism, also
with decode steps on the static path of CUDA graphs (agreed padded sizes, fixed exchanges); then
`shoal generate` in the same processes writes the output file once (rank 0), equal to a single
engine's, and `shoal bench --expert-parallel` reports world-2 decode rows from rank 0 only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shoal import LLM, SamplingParams
from shoal.cli import main

OPTS = {"device": "cpu", "max_num_seqs": 4, "max_model_len": 96}
CALLS = [([[5, 6, 7], "hello there", [9] * 30, {"prompt_token_ids": [1, None]}],
          [SamplingParams(temperature=0.0, max_tokens=4),
           SamplingParams(temperature=0.9, max_tokens=5),  # unseeded: from the request index
           SamplingParams(temperature=0.8, seed=3, max_tokens=3, n=2),
           SamplingParams(max_tokens=3)]),
         ([[2, 3], [4] * 12, [8]], [SamplingParams(temperature=1.0, max_tokens=4)] * 3)]

SCRIPT = """
import json, sys
from shoal import LLM
from shoal.cli import main
from tests.engine.test_torchrun import CALLS, CLI, OPTS, view
from shoal.runner.warmup import decode_graphs
llm = LLM("tiny", expert_parallel=True, **OPTS)
got = [view(llm.generate(items, params, use_tqdm=False)) for items, params in CALLS]
# then decode steps through the static padded path that CUDA graphs replay (run eagerly on the
# CPU): the ranks agree on a padded size and the MoE exchanges fixed sizes
runner = llm.engine.runner
runner.graphs = decode_graphs(llm.config, runner.model, runner.caches, runner.memory,
                              use_graphs=False)
agree, agreed = runner.ep.agree, []
runner.ep.agree = lambda rows: agreed.append(agree(rows)) or agreed[-1]
got += [view(llm.generate(items, params, use_tqdm=False)) for items, params in CALLS]
assert max(agreed) > 0 and min(agreed) < 0, agreed  # static steps, and eager ones
with open(f"{sys.argv[1]}/rank{llm.torchrun.rank}.json", "w") as f:
    json.dump(got, f)
# `shoal bench --expert-parallel` in the same processes: rank 0 reports world-2 decode rows
import contextlib, io
from shoal.bench import main as bench_main
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    bench_main(["--model", "tiny", "--device", "cpu", "--expert-parallel", "--batches", "1", "3",
                "--steps", "3", "--skip-prefill", "--prompt-len", "8", "--prefill-budget", "16",
                "--plot", f"{sys.argv[1]}/bench.png"])
with open(f"{sys.argv[1]}/bench{llm.torchrun.rank}.txt", "w") as f:
    f.write(printed.getvalue())
sys.exit(main([*CLI, "--input", "in.jsonl", "--output", "dp.jsonl"]))
"""
CLI = ["generate", "--model", "tiny", "--device", "cpu", "--max-model-len", "64",
       "--max-tokens", "3", "--temperature", "0.8", "--quiet"]


def view(outs) -> list:
    return [[o.request_id, o.error, [[c.token_ids, c.text, c.finish_reason] for c in o.outputs]]
            for o in outs]


def _torchrun(tmp_path: Path, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_rank_returns_one_engines_outputs_and_the_cli_writes_once(tmp_path: Path) -> None:
    (tmp_path / "spmd.py").write_text(SCRIPT, encoding="utf-8")
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"prompt_token_ids": [5 + i, 6]})
                                                 for i in range(5)) + "\n", encoding="utf-8")
    _torchrun(tmp_path, "spmd.py", str(tmp_path))
    alone = LLM("tiny", **OPTS)
    expected = [view(alone.generate(items, params, use_tqdm=False))  # eager steps, then the
                for _ in range(2) for items, params in CALLS]  # static path
    expected = json.loads(json.dumps(expected))
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected, rank
    assert main([*CLI, "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "one.jsonl")]) == 0

    def records(name: str) -> list[dict]:
        return [{k: v for k, v in json.loads(x).items() if k != "latency_s"}
                for x in (tmp_path / name).read_text().splitlines()]

    got = records("dp.jsonl")
    assert [r["line"] for r in got] == [1, 2, 3, 4, 5]
    assert got == records("one.jsonl")
    assert (tmp_path / "bench1.txt").read_text() == ""  # rank 0 reports
    report = json.loads((tmp_path / "bench0.txt").read_text().splitlines()[-1])
    assert report["expert_parallel"] and [d["batch"] for d in report["decode"]] == [1, 3]
    for d in report["decode"]:
        assert d["world"] == 2 and d["tpot_ms"] > 0 and d["floor_ms"] > 0, d
