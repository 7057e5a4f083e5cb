"""World 2 against world 1 on one machine of two or more sm_90 GPUs: `LLM(model,
expert_parallel=True)` under torchrun (NCCL, one rank per GPU, the routed experts sharded, the
Triton ops) gives the single-GPU engine's greedy tokens and seeded samples, and log-probs within
0.02 of it (the experts see other rows beside them; eager steps exchange by counts, graph steps
by fixed sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TWO_GPUS = (torch.cuda.is_available() and torch.cuda.device_count() >= 2
            and torch.cuda.get_device_capability(0) == (9, 0))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not TWO_GPUS, reason="needs two sm_90 GPUs")]

PROMPTS = [[5, 6, 7, 8] * 5, [9] * 30, list(range(40, 90)), [3, 1, 4, 1, 5, 9, 2, 6]]
SCRIPT = """
import json, sys
from shoal import LLM
from tests.cuda.test_expert_parallel_gpu import run
llm = LLM(sys.argv[2], expert_parallel=True, max_num_seqs=8, max_model_len=256)
with open(f"{sys.argv[1]}/rank{llm.torchrun.rank}.json", "w") as f:
    json.dump(run(llm), f)
"""


def run(llm) -> list:
    """Greedy and seeded sampled completions with their top-5 log-probs per step."""
    from shoal import SamplingParams

    out = []
    for params in (SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=7, max_tokens=12, logprobs=5,
                                  ignore_eos=True)):
        for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                              use_tqdm=False):
            c = o.outputs[0]
            out.append({"tokens": list(c.token_ids),
                        "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                                     for step in c.logprobs]})
    return out


@pytest.mark.parametrize("model", ["tiny", "mini"])
def test_world_2_matches_world_1(model: str, tmp_path: Path) -> None:
    (tmp_path / "spmd.py").write_text(SCRIPT, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "spmd.py", str(tmp_path), model],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    from shoal import LLM

    alone = LLM(model, max_num_seqs=8, max_model_len=256)
    want = json.loads(json.dumps(run(alone)))
    del alone
    torch.cuda.empty_cache()
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [g["tokens"] for g in got] == [w["tokens"] for w in want], rank
        worst = max(abs(g_step[t] - lp) for g, w in zip(got, want, strict=True)
                    for g_step, w_step in zip(g["logprobs"], w["logprobs"], strict=True)
                    for t, lp in w_step.items() if t in g_step)
        assert worst <= 0.02, (rank, worst)
