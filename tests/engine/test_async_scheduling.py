"""Async scheduling end to end (tiny, CPU): each workload runs on a synchronous engine and on an
async one (otherwise the same options) and must give identical outputs: token ids, text,
finish and stop reasons, logprobs, prompt logprobs, errors, and the order in which requests
complete. CPU torch finishes every launch at once, so nothing is faster here, but all of the
logic runs: placeholders, input ids patched from the previous step's tokens, finishes deferred
to resolve, rows of finished requests dropped, steps finished first for penalties and
structured output. A spy on the runner checks that steps really overlap.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re

import pytest
import torch

from engine.refloop import EOS, main_prompts, random_prompt, session_seed
from engine.test_generate import find_eos_seed
from engine.test_preemption import BLOCK, small_pool_config
from shoal import LLM, SamplingParams
from shoal.engine.engine import Engine
from shoal.model.presets import TINY
from shoal.runner import inflight
from shoal.sampling import request_seed
from shoal.sampling.rng import seed_to_int64
from shoal.sampling.structured import StructuredOutputSpec

OPTS = {"device": "cpu", "max_num_seqs": 24, "max_model_len": 64}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def pair(**options) -> tuple[LLM, LLM]:
    merged = {**OPTS, **options}
    return (LLM("tiny", async_scheduling=False, **merged),
            LLM("tiny", async_scheduling=True, **merged))


def snapshot(out) -> tuple:
    """Everything a user sees of one RequestOutput (metrics aside)."""
    def logprobs(entries):
        return None if entries is None else [
            None if e is None else sorted((t, lp.logprob, lp.rank) for t, lp in e.items())
            for e in entries]

    return (out.request_id, out.error, tuple(out.prompt_token_ids),
            logprobs(out.prompt_logprobs),
            [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
              logprobs(c.logprobs), c.cumulative_logprob) for c in out.outputs])


def run_both(engines: tuple[LLM, LLM], items: list[dict]) -> list[list[tuple]]:
    """LLM.run on both engines: (input index, snapshot) in completion order, once each."""
    results = []
    for llm in engines:
        done = [(i, snapshot(out)) for i, out in llm.run(items, use_tqdm=False)]
        assert sorted(i for i, _ in done) == list(range(len(items)))
        sched = llm.engine.scheduler
        assert not (sched.running or sched.waiting or llm.engine.in_flight)
        results.append(done)
    return results


def greedy_tokens(llm: LLM, prompt, n: int) -> tuple[list[int], str]:
    (out,) = llm.generate([prompt], GREEDY.replace(max_tokens=n, ignore_eos=True),
                          use_tqdm=False)
    return out.outputs[0].token_ids, out.outputs[0].text


@pytest.mark.parametrize("speculative", [False, True])
def test_mixed_batch_equals_sync(speculative: bool) -> None:
    """One batch with every stopping and sampling feature; penalties and a structured-output
    request force some steps to be finished before the next is scheduled. With speculative
    decoding (exact verification) both engines also equal plain decoding; their plans differ
    (async counts drafts in flight as accepted), so only the order of completions may."""
    rng = random.Random(session_seed() + 11)
    ps = main_prompts()
    prompts = ps.engine_prompts()
    refs = ps.refs()
    eos_seed = find_eos_seed(refs[0], 1.0, rng)
    engines = pair(speculative=speculative, spec_overlap=speculative)
    tokens, text = greedy_tokens(engines[0], prompts[1], 8)  # (on both: request ids, seeds
    assert greedy_tokens(engines[1], prompts[1], 8) == (tokens, text)  # stay in step)
    # a stop id that first occurs as token k: with max_tokens=k, stop must beat length
    k = next(j for j in range(2, 8) if tokens[j - 1] not in tokens[:j - 1])
    # a 2-character stop string, from the text's second half if it has one (else its first)
    starts = [*range(len(text) // 2, len(text) - 1), *range(1, len(text) // 2)]
    stop_str = next(text[i:i + 2] for i in starts
                    if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    long_prompt = random_prompt(rng, OPTS["max_model_len"] - 5)
    plain = GREEDY.replace(ignore_eos=True)  # (eos cannot cut these short)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=rng.randrange(1 << 30),
                             max_tokens=7, logprobs=3)
    cases = [
        (prompts[0], GREEDY),
        (prompts[1], plain.replace(max_tokens=k, stop_token_ids=[tokens[k - 1]])),
        (prompts[1], plain.replace(max_tokens=8, stop=[stop_str])),
        (prompts[1], plain.replace(max_tokens=8, stop=[stop_str],
                                   include_stop_str_in_output=True)),
        (prompts[0], SamplingParams(temperature=1.0, seed=eos_seed, max_tokens=1)),  # eos last
        (prompts[0], SamplingParams(temperature=1.0, seed=eos_seed, max_tokens=5)),
        (prompts[0], SamplingParams(temperature=1.0, seed=eos_seed, max_tokens=5, min_tokens=2)),
        (prompts[2], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, min_tokens=2,
                                    stop_token_ids=list(range(3, 300)))),
        (prompts[3], sampled),
        (prompts[4], sampled.replace(n=2, logprobs=None, seed=None)),
        (prompts[2], SamplingParams(temperature=1.0, min_p=0.05, max_tokens=1)),
        (prompts[3], GREEDY.replace(max_tokens=3, prompt_logprobs=2)),
        (long_prompt, plain.replace(max_tokens=None)),  # max_model_len
        ([5, TINY.vocab_size], GREEDY),  # rejected at add_request
        (prompts[0], sampled.replace(repetition_penalty=1.3, frequency_penalty=0.5,
                                     presence_penalty=0.3)),
        (prompts[2], SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                    structured=StructuredOutputSpec(regex=r"[ab]{1,4}-[0-9]"))),
    ]
    items = [{"prompt": p, "sampling_params": sp} for p, sp in cases]
    sync_done, async_done = run_both(engines, items)
    if speculative:
        plain = LLM("tiny", async_scheduling=False, **OPTS)
        greedy_tokens(plain, prompts[1], 8)  # (request ids and seeds in step)
        assert sorted(async_done) == sorted(sync_done) == sorted(run_both((plain,), items)[0])
        assert engines[1].engine.stats.overlapped_steps > 0
    else:
        assert async_done == sync_done  # same outputs, completed in the same order
    out = dict(sync_done)

    def completions(i):
        return out[i][4]

    (c,) = completions(1)
    assert (len(c[1]), c[3], c[4]) == (k, "stop", tokens[k - 1])
    assert completions(2)[0][3:5] == ("stop", stop_str) and completions(3)[0][2].endswith(stop_str)
    assert completions(4)[0][1:2] == ([EOS],) and completions(4)[0][3:5] == ("stop", None)
    assert completions(5)[0][1] == [EOS] and completions(5)[0][3] == "stop"
    assert len(completions(6)[0][1]) >= 2 and EOS not in completions(6)[0][1][:2]
    assert any(c[3] == "stop" and isinstance(c[4], int) for c in completions(7))
    assert len(completions(8)[0][5]) == len(completions(8)[0][1])  # a logprob per token
    assert len(completions(12)[0][1]) == 5 and completions(12)[0][3] == "length"
    assert out[13][1] is not None and "vocabulary" in out[13][1]
    assert re.fullmatch(r"[ab]{1,4}-[0-9]", completions(15)[0][2])
    stats = engines[1].engine.stats
    assert stats.overlapped_steps > 0 and stats.resolved_first > 0
    assert engines[0].engine.stats.overlapped_steps == 0


def test_async_steps_overlap(monkeypatch) -> None:
    """Without penalties or matchers every step but the first is launched before the previous
    one is finished, its decode rows take their input ids from the previous step's tokens
    on the device, and the outputs equal the synchronous engine's."""
    engines = pair()
    events: list[tuple[str, int]] = []
    runner = engines[1].engine.runner
    launch, finish = runner.launch, runner.finish

    def spy_launch(plan, grammar_masks):
        events.append(("launch", plan.step_id))
        return launch(plan, grammar_masks)

    def spy_finish(step):
        events.append(("finish", step.plan.step_id))
        return finish(step)

    monkeypatch.setattr(runner, "launch", spy_launch)
    monkeypatch.setattr(runner, "finish", spy_finish)
    patched = []
    apply = inflight.TokenPatch.apply
    monkeypatch.setattr(inflight.TokenPatch, "apply",
                        lambda self, ids: (patched.append(len(self.rows)), apply(self, ids)))
    prompts = main_prompts().engine_prompts()
    params = [GREEDY.replace(max_tokens=4 + i, ignore_eos=True) for i in range(len(prompts))]
    params[1] = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    sync_done, async_done = run_both(engines, [{"prompt": p, "sampling_params": sp}
                                               for p, sp in zip(prompts, params, strict=True)])
    assert async_done == sync_done
    stats = engines[1].engine.stats
    assert stats.steps == engines[0].engine.stats.steps  # no stop before max_tokens: same plans
    assert stats.overlapped_steps == stats.steps - 1 and stats.resolved_first == 0
    order = {e: i for i, e in enumerate(events)}
    for step in range(stats.steps - 1):
        assert order[("launch", step + 1)] < order[("finish", step)], events
    assert sum(patched) == stats.output_tokens - len(prompts)  # every decode input patched
    assert not LLM("tiny", speculative=True, **OPTS).engine.overlap  # (spec_overlap is off)
    assert LLM("tiny", speculative=True, spec_overlap=True, **OPTS).engine.overlap
    # speculative steps planned before their drafts are known would hash unknown tokens
    for extra in ({"enable_prefix_caching": True}, {"spec_confidence": 0.5}):
        assert not LLM("tiny", speculative=True, spec_overlap=True, **extra,
                       **OPTS).engine.overlap


def test_staggered_arrivals_abort_and_bad_rows() -> None:
    """Requests added between steps, an abort while its token is in flight, and a request whose
    logits turn NaN mid-run (its row in the following, already launched step is dropped)."""
    rng = random.Random(session_seed() + 12)
    prompts = [random_prompt(rng, rng.randint(3, 20)) for _ in range(5)]
    nan_seed, nan_at = 4321, len(prompts[2]) + 2  # its third output token
    target = seed_to_int64(request_seed(nan_seed, engine_seed=0, request_index=0))
    results = []
    for llm in pair():
        engine: Engine = llm.engine
        sampler = engine.runner.sampler
        real = sampler.sample

        def poisoned(logits, batch, real=real):
            bad = (batch.seeds == target) & (batch.positions == nan_at)
            return real(torch.where(bad.unsqueeze(1), math.nan, logits), batch)

        sampler.sample = poisoned  # fault injection: NaN logits for one row of one step
        script = {
            0: [(prompts[0], GREEDY.replace(max_tokens=8)),
                (prompts[1], SamplingParams(temperature=0.9, seed=1, max_tokens=8))],
            1: [(prompts[2], SamplingParams(temperature=0.7, seed=nan_seed, max_tokens=6))],
            3: [(prompts[3], SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=5))],
            4: [(prompts[4], GREEDY.replace(max_tokens=1))],
        }
        groups, completed = [], []
        for call in range(40):
            for prompt, params in script.get(call, []):
                groups.append(engine.add_request(prompt, params))
            if call == 3:
                engine.abort(groups[1])
            if call > 4 and not engine.has_unfinished():
                break
            completed += engine.step()
        assert not engine.has_unfinished()
        assert sorted(completed) == sorted(groups)  # each exactly once
        results.append(([snapshot(engine.output(g)) for g in groups], completed))
    (sync_outs, sync_order), (async_outs, async_order) = results
    assert async_outs == sync_outs and async_order == sync_order
    aborted, poisoned_out = sync_outs[1], sync_outs[2]
    assert aborted[4][0][3] == "abort" and len(aborted[4][0][1]) == 3
    assert poisoned_out[1] is not None and "no valid token" in poisoned_out[1]
    assert len(poisoned_out[4][0][1]) == 2


def test_preemption_equals_sync() -> None:
    """A 3-block pool for two 127-token prompts: one request is preempted (and recomputed)
    while the other's token is in flight; outputs equal the synchronous engine's."""
    rng = random.Random(session_seed() + 13)
    prompts = [random_prompt(rng, BLOCK - 1) for _ in range(2)]
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=3, ignore_eos=True)]
    outs = []
    for overlap in (False, True):
        config = small_pool_config(num_blocks=3, num_slots=2)
        config = dataclasses.replace(config, runner=dataclasses.replace(
            config.runner, async_scheduling=overlap))
        engine = Engine(config)
        groups = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for _ in range(30):
            if not engine.has_unfinished():
                break
            engine.step()
        assert not engine.has_unfinished()
        results = [engine.output(g) for g in groups]
        assert sum(o.metrics.num_preemptions for o in results) >= 1
        outs.append([snapshot(o) for o in results])
        assert engine.stats.overlapped_steps > 0 or not overlap
    assert outs[0] == outs[1]
    assert all(len(o[4][0][1]) == 3 and o[4][0][3] == "length" for o in outs[1])
