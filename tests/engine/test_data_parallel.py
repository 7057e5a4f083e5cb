"""Data-parallel replicas (one process each, CPU here): outputs equal one engine's for the
same requests in the same order (greedy, seeded and unseeded sampling, n > 1, chat, a bad
prompt), in input order; an interrupt leaves the replicas usable; `shoal generate --dp 2`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal import LLM, SamplingParams
from shoal.cli import main
from support.interrupt import interrupt_after

OPTS = {"device": "cpu", "max_num_seqs": 8, "max_model_len": 128}
ITEMS = [[5, 6, 7], "hello there", [9] * 30, {"prompt_token_ids": [1, None]},
         {"messages": [{"role": "user", "content": "hi"}]}, [2, 3]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=5),
          SamplingParams(temperature=0.9, max_tokens=6),  # no seed: derived from the index
          SamplingParams(temperature=0.8, seed=3, max_tokens=4, n=2),
          SamplingParams(max_tokens=3), SamplingParams(temperature=0.0, max_tokens=4),
          SamplingParams(temperature=1.0, max_tokens=3)]


def _view(outs):
    return [(o.request_id, o.error, [(c.token_ids, c.text, c.finish_reason) for c in o.outputs])
            for o in outs]


@pytest.fixture(scope="module")
def replicas():
    llm = LLM("tiny", data_parallel_size=2, **OPTS)
    yield llm
    llm.close()


def test_replicas_give_one_engines_outputs(replicas) -> None:
    expected = _view(LLM("tiny", **OPTS).generate(ITEMS * 2, PARAMS * 2, use_tqdm=False))
    got = _view(replicas.generate(ITEMS * 2, PARAMS * 2, use_tqdm=False))
    assert got == expected
    assert got[3][1] is not None and "prompt_token_ids[1]" in got[3][1]


def test_an_interrupt_leaves_the_replicas_usable(replicas) -> None:
    with pytest.raises(KeyboardInterrupt), interrupt_after(1.0):
        replicas.generate([[5, 6, 7]] * 8, SamplingParams(max_tokens=100, ignore_eos=True),
                          use_tqdm=False)
    stats, prefix = replicas.replicas.stats()  # the interrupted call's leftovers skipped
    assert stats.num_requests >= 8 and prefix is None
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=4)
    after = replicas.generate([[4, 4], [8]], params, use_tqdm=False)
    alone = LLM("tiny", **OPTS).generate([[4, 4], [8]], params, use_tqdm=False)
    assert [v[1:] for v in _view(after)] == [v[1:] for v in _view(alone)]


def test_generate_cli_with_two_replicas(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Outputs in input order; the summary sums the replicas' counters, the prefix cache's
    too."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps({"prompt_token_ids": [5 + i, 6]}) for i in range(5))
                   + "\n", encoding="utf-8")
    assert main(["generate", "--model", "tiny", "--device", "cpu", "--max-model-len", "64",
                 "--max-tokens", "3", "--quiet", "--dp", "2", "--input", str(src),
                 "--output", str(dst), "--enable-prefix-caching"]) == 0
    records = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4, 5]
    assert all(len(r["outputs"][0]["token_ids"]) == 3 for r in records)
    err = capsys.readouterr().err
    assert "5 requests on 2 replicas (0 errors, 0 preemptions) | prompt tokens 10 | output " \
           "tokens 15 |" in err, err
    assert "prefix cache: 0/10 prompt tokens hit" in err, err


def test_requests_are_split_by_prompt_and_output_tokens() -> None:
    from shoal.parallel.placement import split_by_load

    long_out = {"prompt_token_ids": [1] * 10, "sampling_params": SamplingParams(max_tokens=1000)}
    long_in = {"prompt_token_ids": [1] * 500, "sampling_params": SamplingParams(max_tokens=10)}
    two = {"prompt": "x" * 400, "sampling_params": SamplingParams(max_tokens=100, n=2)}  # 300
    # loads 1010 | 510, 1020 | 1310 (the first 300-token request) | 1320
    assert split_by_load([long_out, long_in, long_in, two, two], 2) == [[0, 3], [1, 2, 4]]
    assert split_by_load([], 3) == [[], [], []]


def test_replicas_are_fed_as_they_make_room() -> None:
    """Requests whose length the estimate cannot see (every other one stops at its first
    token) are not split up front: the replica whose requests end early is fed the waiting
    ones, long ones included, while the other still decodes; outputs stay one engine's."""
    opts = dict(OPTS, max_num_seqs=1)  # each replica holds 2 unfinished requests
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=list(range(512)))
    prompts = [[3 + i, 4] for i in range(8)]
    params = [long if i % 2 == 0 else short for i in range(8)]
    llm = LLM("tiny", data_parallel_size=2, **opts)
    try:
        got = _view(llm.generate(prompts, params, use_tqdm=False))
        served = llm.replicas.served_by
    finally:
        llm.close()
    assert got == _view(LLM("tiny", **opts).generate(prompts, params, use_tqdm=False))
    assert sorted(served) == list(range(8))
    # up front (split_by_load: equal estimates alternate) replica 0 would hold every long one
    assert [p for p in range(0, 8, 2) if served[p] == 1], served


def test_a_replica_killed_mid_call_is_an_error_naming_it() -> None:
    """The call fails with a ShoalError naming the dead rank (the CLI then says what finished
    and exits 1), not with an error from signalling the dead process."""
    import threading

    from shoal.config import ShoalError

    llm = LLM("tiny", data_parallel_size=2, **OPTS)
    try:
        killer = threading.Timer(1.5, llm.replicas.processes[1].kill)
        killer.start()
        with pytest.raises(ShoalError, match="rank 1"):
            llm.generate([[5, 6, 7]] * 16, SamplingParams(max_tokens=110, ignore_eos=True),
                         use_tqdm=False)
        killer.join()
    finally:
        llm.close()


def test_a_script_without_the_main_guard_is_told_so(tmp_path: Path) -> None:
    """Replicas are spawned processes that import the script: one that creates the LLM at
    import time makes them exit at once; the error says what to do."""
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text('from shoal import LLM\n'
                      'LLM("tiny", device="cpu", data_parallel_size=2, max_model_len=128)\n')
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode != 0
    assert "if __name__ == '__main__':" in run.stderr.splitlines()[-1]
