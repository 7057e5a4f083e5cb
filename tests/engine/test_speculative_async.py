"""Speculative decoding under async scheduling (tiny, CPU): step n+1 is planned while step n is
in flight, as if every draft step n verified were accepted, and takes its anchor, drafts,
position shift and Engram history from step n's proposal on the device. With drafts that are
accepted, partly rejected or all rejected, through the eager and the static (CUDA-graph) paths
and under preemption, the outputs equal plain decoding's and the steps really overlap."""

from __future__ import annotations

import dataclasses
import random

import pytest

import shoal.runner.model_runner as runner_mod
from engine.test_preemption import BLOCK, small_pool_config
from engine.test_speculative import OPTS, _oracle, _prompts, _run, _static_paths
from shoal import LLM, SamplingParams
from shoal.engine.engine import Engine
from shoal.runner.draft_patch import DraftPatch


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM("tiny", **OPTS)


def _count_patches(monkeypatch) -> dict[str, int]:
    """Counts of verify steps patched from the previous step's proposal, by layout."""
    calls = {"eager": 0, "static": 0}
    apply, apply_static = DraftPatch.apply, DraftPatch.apply_static

    def eager(self, batch):
        calls["eager"] += 1
        return apply(self, batch)

    def static(self, batch, dst, q):
        calls["static"] += 1
        return apply_static(self, batch, dst, q)

    monkeypatch.setattr(DraftPatch, "apply", eager)
    monkeypatch.setattr(DraftPatch, "apply_static", static)
    return calls


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("wrong_at", [None, 0, 2], ids=["right", "wrong-first", "wrong-third"])
def test_pipelined_verification_keeps_plain_outputs(plain, static, wrong_at, monkeypatch):
    seed = random.randrange(1 << 30)
    prompts = _prompts(seed)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=seed % 997, max_tokens=13, ignore_eos=True,
                             logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]
    expected, ref_outs = _run(plain, prompts, params)
    monkeypatch.setattr(runner_mod, "propose_drafts", _oracle(expected, wrong_at))
    patches = _count_patches(monkeypatch)
    spec = LLM("tiny", speculative=True, spec_overlap=True, **OPTS)
    if static:
        _static_paths(spec)
    got, outs = _run(spec, prompts, params)
    assert got == expected, f"seed {seed}"
    assert [list(d) for d in outs[1].outputs[0].logprobs] == \
        [list(d) for d in ref_outs[1].outputs[0].logprobs]
    stats = spec.engine.stats
    assert stats.overlapped_steps > 0 and stats.resolved_first == 0
    assert patches["static" if static else "eager"] > 0, patches
    if wrong_at != 0:  # (a wrong first draft rejects the whole block)
        assert stats.drafts_accepted > 0
    else:
        assert stats.drafts_accepted == 0


def test_pipelined_verification_under_preemption(monkeypatch):
    """Two 127-token prompts in a 3-block pool: drafts counted ahead make the requests take
    their second block early, one is preempted and recomputed; outputs equal plain
    decoding's."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(BLOCK - 1)] for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(speculative: bool, overlap: bool) -> tuple[list[list[int]], Engine]:
        config = small_pool_config(num_blocks=3, num_slots=2)
        config = dataclasses.replace(config, runner=dataclasses.replace(
            config.runner, async_scheduling=overlap, speculative=speculative,
            spec_overlap=True))
        engine = Engine(config)
        groups = [engine.add_request(p, params) for p in prompts]
        for _ in range(60):
            if not engine.has_unfinished():
                break
            engine.step()
        assert not engine.has_unfinished()
        return [engine.output(g).outputs[0].token_ids for g in groups], engine

    expected, _ = run(False, False)
    monkeypatch.setattr(runner_mod, "propose_drafts", _oracle(expected, 3))
    for overlap in (False, True):
        got, engine = run(True, overlap)
        assert got == expected, overlap
        assert engine.stats.preemptions >= 1 and engine.stats.drafts_accepted > 0
        assert engine.stats.overlapped_steps > 0 or not overlap


def test_staggered_random_workload_keeps_plain_outputs(monkeypatch):
    """Requests of random lengths and parameters (greedy and seeded sampling, logprobs, stop
    ids, min_tokens, max_tokens of 1) arrive between steps, while drafts are right or wrong at
    random: every output equals plain decoding's (tokens, finish reason, logprobs)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    params = []
    for _ in prompts:
        p = SamplingParams(temperature=rng.choice([0.0, 0.0, 0.7, 1.0]), seed=rng.randrange(99),
                           max_tokens=rng.choice([1, 2, 7, 15]), ignore_eos=True,
                           logprobs=rng.choice([None, 1]))
        params.append(p.replace(min_tokens=min(p.max_tokens, rng.choice([0, 3]))))
    plain = LLM("tiny", async_scheduling=False, **OPTS)
    long = plain.generate([{"prompt_token_ids": q} for q in prompts],
                          [p.replace(max_tokens=15) for p in params], use_tqdm=False)
    futures = [o.outputs[0].token_ids for o in long]
    params = [p.replace(stop_token_ids=[f[4]]) if rng.random() < 0.3 else p
              for p, f in zip(params, futures, strict=True)]
    want = plain.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
    draft_rng = random.Random(seed + 1)

    class Oracle:  # drafts from the plain run, each wrong with probability 0.3
        def __call__(self, *args, **kwargs):
            proposal = _oracle(futures)(*args, **kwargs)
            if proposal is not None:
                for b in range(proposal.next_ids.shape[0]):
                    for j in range(1, proposal.next_ids.shape[1]):
                        if draft_rng.random() < 0.3:
                            proposal.next_ids[b, j] += 1
            return proposal

    monkeypatch.setattr(runner_mod, "propose_drafts", Oracle())
    spec = LLM("tiny", speculative=True, spec_overlap=True, **OPTS)
    engine = spec.engine
    pending = list(range(len(prompts)))
    groups: dict[int, str] = {}
    for _ in range(400):
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                i = pending.pop(0)
                groups[i] = engine.add_request(None, params[i], prompt_token_ids=prompts[i],
                                               request_index=i)
        if not pending and not engine.has_unfinished():
            break
        if engine.has_unfinished():
            engine.step()
    engine.flush()
    assert not pending and not engine.has_unfinished()

    def view(out):
        (c,) = out.outputs
        return (c.token_ids, c.finish_reason,
                [sorted((t, v.logprob) for t, v in e.items()) for e in c.logprobs or []])

    assert [view(engine.output(groups[i])) for i in range(len(prompts))] == \
        [view(o) for o in want], f"seed {seed}"
    assert engine.stats.overlapped_steps > 0 and engine.stats.drafts_accepted > 0
