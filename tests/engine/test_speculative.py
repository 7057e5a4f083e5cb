"""Speculative decoding (DSpark drafts, exact-match verification): outputs are token-for-token
those of plain decoding, for greedy and for seeded sampling with penalties, stop strings, n > 1
and prompt log-probs, whatever the drafts are; accepted drafts save steps."""

from __future__ import annotations

import random

import pytest
import torch

import shoal.runner.model_runner as runner_mod
from shoal import LLM, SamplingParams
from shoal.model.presets import TINY
from shoal.runner.speculative import propose_drafts

OPTS = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=64)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY.vocab_size) for _ in range(rng.randint(3, 30))]
            for _ in range(3)]


PARAMS = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True,
                         repetition_penalty=1.2, logprobs=2)]


def _run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def _oracle(futures, wrong_at: int | None = None):
    """A `propose_drafts` that drafts (after the real one ran: its context writes stay) a
    request's future tokens: with n tokens so far, futures[request][n: n + k] (k the draft
    length), made wrong at index `wrong_at`."""
    k = TINY.dspark_draft_len

    def oracle(model, caches, batch, captures, layout, accepted, last, states, *args, **kw):
        proposal = propose_drafts(model, caches, batch, captures, layout, accepted, last,
                                  states, *args, **kw)
        if proposal is None:
            return None
        positions = proposal.positions.tolist()
        for rid, b in proposal.index.items():
            done = positions[b] + 2 - len(states[rid].prompt_token_ids)
            future = list(futures[int(rid)][done: done + k])
            if wrong_at is not None and len(future) > wrong_at:
                future[wrong_at] = (future[wrong_at] + 1) % TINY.vocab_size
            proposal.next_ids[b, 1:1 + len(future)] = torch.tensor(future, dtype=torch.int64)
            proposal.keep[b] = len(future)
        return proposal

    return oracle


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM("tiny", **OPTS)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
def test_dspark_drafts_keep_outputs_identical(plain, params):
    seed = random.randrange(1 << 30)
    prompts = _prompts(seed)
    expected, ref_outs = _run(plain, prompts, params)
    spec = LLM("tiny", speculative=True, **OPTS)
    got, outs = _run(spec, prompts, params)
    assert got == expected, f"seed {seed}"
    if params.logprobs:
        for a, b in zip(outs, ref_outs, strict=True):
            assert [list(d) for d in a.outputs[0].logprobs] == \
                [list(d) for d in b.outputs[0].logprobs]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
@pytest.mark.parametrize("wrong_at", [None, 1])
def test_oracle_drafts_are_accepted_and_save_steps(plain, params, wrong_at, monkeypatch):
    seed = random.randrange(1 << 30)
    prompts = _prompts(seed)
    expected, _ = _run(plain, prompts, params)
    plain_steps = LLM("tiny", **OPTS)
    _run(plain_steps, prompts, params)
    monkeypatch.setattr(runner_mod, "propose_drafts", _oracle(expected, wrong_at))
    spec = LLM("tiny", speculative=True, **OPTS)
    got, _ = _run(spec, prompts, params)
    assert got == expected, f"seed {seed}"
    assert spec.engine.stats.steps < plain_steps.engine.stats.steps
    stats = spec.engine.stats
    assert 0 < stats.drafts_accepted <= stats.drafts_proposed
    if wrong_at is None:  # a perfect oracle is accepted except where max_tokens cuts it
        assert stats.drafts_accepted >= stats.drafts_proposed // 2


def test_speculative_needs_draft_layers():
    from shoal.config import EngineConfig, RunnerConfig, ShoalError
    from shoal.runner.model_runner import ModelRunner

    no_drafts = TINY.replace(num_draft_layers=0, compress_ratios=TINY.compress_ratios[:12])
    config = EngineConfig("tiny", no_drafts, runner=RunnerConfig(device="cpu", speculative=True))
    with pytest.raises(ShoalError, match="draft"):
        ModelRunner(config, None)


def test_spec_rows_are_recomputed_not_rolled_back(plain):
    """A draft rejected at its first token leaves cache rows at positions that the next step
    recomputes: outputs stay equal over many steps crossing ratio-2 groups and ring wraps."""
    prompts = [[5 + i for i in range(17)]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected, _ = _run(plain, prompts, params)
    spec = LLM("tiny", speculative=True, **OPTS)
    got, _ = _run(spec, prompts, params)
    assert got == expected
    assert torch.tensor(got).numel() == 24


@pytest.mark.parametrize("cut", ["max_tokens", "stop_id"])
def test_accepted_drafts_past_the_end_are_not_emitted(plain, cut, monkeypatch):
    """Drafts that are right beyond the request's end (an oracle reading a longer plain run) get
    accepted by the verification, but the output stops where plain decoding stops: at
    max_tokens, or at a stop token id met among the accepted drafts."""
    prompts = _prompts(7)
    long_params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    long, _ = _run(plain, prompts, long_params)
    if cut == "max_tokens":
        params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 3
    else:  # each request stops at its own 4th token (first occurrence)
        params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                                 stop_token_ids=[seq[3]]) for seq in long]
    expected, _ = _run(plain, prompts, params)
    monkeypatch.setattr(runner_mod, "propose_drafts", _oracle(long))
    spec = LLM("tiny", speculative=True, **OPTS)
    got, outs = _run(spec, prompts, params)
    assert got == expected
    assert spec.engine.stats.drafts_accepted > 0
    if cut == "stop_id":
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def _stop_inside(text: str) -> list[str]:
    """A stop string from the middle of a request's own plain output (none if too short)."""
    mid = len(text) // 2
    return [text[mid:mid + 3]] if len(text) >= 6 else []


@pytest.mark.parametrize("drafts", ["dspark", "oracle"])
def test_exact_mode_with_stop_strings_n_and_prompt_logprobs(plain, drafts, monkeypatch):
    """Exact verification keeps plain decoding's outputs with text stops (cut inside accepted
    drafts when the oracle drafts the plain run), n = 2 with seeds, and prompt log-probs."""
    seed = random.randrange(1 << 30)
    prompts = _prompts(seed)
    long, long_outs = _run(plain, prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                          ignore_eos=True))
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1,
                             stop=_stop_inside(o.outputs[0].text)) for o in long_outs]
    if drafts == "dspark":  # the oracle reads futures by request index: n = 1 only
        params[1] = SamplingParams(temperature=0.8, seed=seed % 1000, n=2, max_tokens=8,
                                   ignore_eos=True, prompt_logprobs=2)
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if drafts == "oracle":
        monkeypatch.setattr(runner_mod, "propose_drafts", _oracle(long))
    spec = LLM("tiny", speculative=True, **OPTS)
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def view(outs):
        return [([(c.token_ids, c.text, c.finish_reason,
                   [sorted((t, v.logprob) for t, v in e.items()) for e in c.logprobs or []])
                  for c in o.outputs],
                 [sorted((t, v.logprob) for t, v in (e or {}).items())
                  for e in o.prompt_logprobs or []]) for o in outs]

    assert view(got) == view(want), f"seed {seed}"
    assert any(o.outputs[0].finish_reason == "stop" for o in want)  # a stop string cut
    if drafts == "oracle":
        assert spec.engine.stats.drafts_accepted > 0


def test_confidence_rule_keeps_the_leading_drafts_worth_a_row():
    from shoal.runner.speculative import verify_counts

    def drafts_worth_verifying(*args, **kwargs):
        return verify_counts(*args, **kwargs).tolist()

    logit = lambda p: float(torch.logit(torch.tensor(p)))  # noqa: E731
    conf = torch.tensor([[logit(0.9), logit(0.9), logit(0.5), logit(0.99)],
                         [logit(0.2), logit(0.99), logit(0.99), logit(0.99)]])
    assert drafts_worth_verifying(conf, 0.0) == [4, 4]
    # chances 0.9, 0.81, 0.405, 0.401 and 0.2, 0.198, 0.196, 0.194: a prefix, never a gap
    assert drafts_worth_verifying(conf, 0.5) == [2, 0]
    assert drafts_worth_verifying(conf, 0.197) == [4, 2]
    # a budget keeps the batch's largest chances (still prefixes), within the threshold
    assert drafts_worth_verifying(conf, 0.0, budget=3) == [3, 0]
    assert drafts_worth_verifying(conf, 0.0, budget=5) == [4, 1]
    assert drafts_worth_verifying(conf, 0.0, budget=8) == [4, 4]
    assert drafts_worth_verifying(conf, 0.5, budget=3) == [2, 0]
    assert drafts_worth_verifying(conf, 0.197, budget=1) == [1, 0]
    same = torch.tensor([[0.0, 0.0], [0.0, 0.0]])  # chances 0.5, 0.25 twice
    assert drafts_worth_verifying(same, 0.0, budget=3) == [2, 1]  # ties: earlier draft first
    assert drafts_worth_verifying(same, 0.0, budget=1) == [1, 0]  # then the earlier request


@pytest.mark.parametrize("threshold,budget", [(0.0, 0), (0.3, 0), (1.0, 0), (0.0, 2)])
def test_confidence_scheduled_verification_keeps_outputs_identical(plain, threshold, budget):
    seed = random.randrange(1 << 30)
    prompts = _prompts(seed)
    params = PARAMS[1]
    expected, _ = _run(plain, prompts, params)
    steps_plain = LLM("tiny", **OPTS)
    _run(steps_plain, prompts, params)
    spec = LLM("tiny", speculative=True, spec_confidence=threshold, spec_verify_budget=budget,
               **OPTS)
    got, _ = _run(spec, prompts, params)
    assert got == expected, f"seed {seed}"
    s = spec.engine.stats
    k = TINY.dspark_draft_len
    assert s.drafts_proposed + s.drafts_skipped > 0
    assert sum(s.drafts_proposed_at) == s.drafts_proposed
    assert all(a <= p for a, p in zip(s.drafts_accepted_at, s.drafts_proposed_at, strict=True))
    if threshold == 0.0 and not budget:
        assert s.drafts_skipped == 0 and len(s.drafts_proposed_at) <= k
    if budget:  # at most `budget` drafts a step, the rest counted as skipped
        assert s.drafts_proposed <= budget * s.steps and s.drafts_skipped > 0
    if threshold == 1.0:  # no chance reaches 1: nothing is verified, one token per step
        assert s.drafts_proposed == 0 and s.drafts_skipped > 0
        assert s.steps == steps_plain.engine.stats.steps


def test_rejection_verification_is_reproducible_and_exact_for_greedy(plain):
    """spec_verify='rejection': greedy requests give plain decoding's tokens; sampled ones are
    reproducible run to run (counter RNG for drafts, acceptance and residual) and have their
    lengths. (Its losslessness is tested on the sampler: tests/sampling/test_sampler.py.)"""
    seed = random.randrange(1 << 30)
    prompts = _prompts(seed)
    greedy = PARAMS[0]
    expected, _ = _run(plain, prompts, greedy)
    spec = LLM("tiny", speculative=True, spec_verify="rejection", **OPTS)
    got, _ = _run(spec, prompts, greedy)
    assert got == expected, f"seed {seed}"
    sampled = SamplingParams(temperature=1.0, seed=seed % 1000, max_tokens=12, ignore_eos=True)
    first, _ = _run(spec, prompts, sampled)
    again, _ = _run(LLM("tiny", speculative=True, spec_verify="rejection", **OPTS), prompts,
                    sampled)
    assert first == again and all(len(t) == 12 for t in first)
    assert spec.engine.stats.drafts_proposed > 0


def _static_paths(llm: LLM) -> dict[str, int]:
    """Put the static padded paths that CUDA graphs replay (run eagerly here, on the CPU) in the
    runner, as start-up does on CUDA: decode / verify steps through DecodeGraphs, draft blocks
    through DraftGraphs. Returns call counts by width / mode, filled as they run."""
    from shoal.runner.draft_graphs import DraftGraphs
    from shoal.runner.warmup import decode_graphs

    runner = llm.engine.runner
    graphs = decode_graphs(llm.config, runner.model, runner.caches, runner.memory,
                           use_graphs=False)
    drafts = DraftGraphs(runner.model, runner.caches, sizes=graphs.sizes,
                         pad_slot=runner.memory.num_slots, use_graphs=False,
                         sampled=llm.config.runner.spec_verify == "rejection")
    calls = {"decode": 0, "verify": 0, "draft": 0}
    forward, draft = graphs.forward, drafts.draft_on_device

    def counted_forward(batch, patch=None, **kwargs):
        calls["decode" if batch.num_tokens == batch.num_requests else "verify"] += 1
        return forward(batch, patch, **kwargs)

    def counted_draft(*args, **kwargs):
        calls["draft"] += 1
        return draft(*args, **kwargs)

    graphs.forward, drafts.draft_on_device = counted_forward, counted_draft
    runner.graphs, runner.draft_graphs = graphs, drafts
    return calls


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
def test_static_verify_and_draft_paths_keep_outputs_identical(plain, params):
    """What the CUDA graphs of verify steps and draft blocks compute (padded to the verify
    width and the next batch size) gives plain decoding's tokens and logprobs."""
    seed = random.randrange(1 << 30)
    prompts = _prompts(seed)
    expected, ref_outs = _run(plain, prompts, params)
    spec = LLM("tiny", speculative=True, **OPTS)
    calls = _static_paths(spec)
    got, outs = _run(spec, prompts, params)
    assert got == expected, f"seed {seed}"
    assert calls["verify"] > 0 and calls["draft"] > 0, calls
    if params.logprobs:
        for a, b in zip(outs, ref_outs, strict=True):
            assert [list(d) for d in a.outputs[0].logprobs] == \
                [list(d) for d in b.outputs[0].logprobs]


def test_static_verify_path_with_accepted_drafts(plain, monkeypatch):
    """Oracle drafts (plain decoding's own tokens) through the static verify path: accepted,
    fewer steps, the same tokens."""
    seed = random.randrange(1 << 30)
    prompts = _prompts(seed)
    params = PARAMS[0]
    expected, _ = _run(plain, prompts, params)
    monkeypatch.setattr(runner_mod, "propose_drafts", _oracle(expected))
    spec = LLM("tiny", speculative=True, **OPTS)
    calls = _static_paths(spec)
    got, _ = _run(spec, prompts, params)
    assert got == expected, f"seed {seed}"
    assert calls["verify"] > 0 and spec.engine.stats.drafts_accepted > 0, calls


def test_static_sampled_drafts_are_reproducible(plain):
    """spec_verify='rejection' with the sampled draft graphs' static path: greedy requests keep
    plain decoding's tokens, sampled ones are the same run to run."""
    seed = random.randrange(1 << 30)
    prompts = _prompts(seed)
    expected, _ = _run(plain, prompts, PARAMS[0])
    spec = LLM("tiny", speculative=True, spec_verify="rejection", **OPTS)
    calls = _static_paths(spec)
    assert _run(spec, prompts, PARAMS[0])[0] == expected, f"seed {seed}"
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    assert _run(spec, prompts, sampled)[0] == _run(spec, prompts, sampled)[0]
    assert calls["draft"] > 0, calls
