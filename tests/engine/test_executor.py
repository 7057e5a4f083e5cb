"""The executor seam carries plain data only: every plan, structured-output mask set and result
of a run pickles and unpickles equal, requests reach the runner once (with their sampling
parameters), and the runner forgets them when a plan reports them finished."""

from __future__ import annotations

import pickle

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.sampling.structured import StructuredOutputSpec


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plans_masks_and_results_pickle(async_scheduling: bool) -> None:
    llm = LLM("tiny", device="cpu", max_num_seqs=8, max_model_len=64,
              max_num_batched_tokens=24, async_scheduling=async_scheduling)
    executor = llm.engine.executor
    submitted, collected = [], []
    submit, collect = executor.submit, executor.collect

    def spy_submit(plan, grammar_masks):
        submitted.append((plan, grammar_masks))
        submit(plan, grammar_masks)

    def spy_collect():
        out = collect()
        collected.append(out)
        return out

    executor.submit, executor.collect = spy_submit, spy_collect
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, max_tokens=4, prompt_logprobs=1,
                             presence_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=6,
                             structured=StructuredOutputSpec(regex=r"[ab]{1,4}-[0-9]"))]
    prompts = [list(range(5, 25)), [7, 8, 9], "a structured prompt"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs[:2]] == [5, 4]
    assert len(submitted) == len(collected) >= 5
    assert any(masks for _, masks in submitted)  # the structured request's masks
    assert any(o.prompt_logprobs for o in collected)
    for plan, masks in submitted:
        assert pickle.loads(pickle.dumps(plan)) == plan
        assert _same(pickle.loads(pickle.dumps(masks)), masks)
        assert all(m.dtype == torch.bool and m.shape == (llm.config.model_config.vocab_size,)
                   for m in masks.values())
    for out in collected:
        assert pickle.loads(pickle.dumps(out)) == out
    news = [n.request_id for plan, _ in submitted for n in plan.new_requests]
    assert sorted(news) == ["0", "1", "2"]  # each request reaches the runner once
    first = {n.request_id: n for plan, _ in submitted for n in plan.new_requests}
    assert first["1"].sampling == params[1] and first["1"].prompt_token_ids == (7, 8, 9)
    llm.generate([[3, 4]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert set(executor.runner.requests) <= {"3"}  # the first run's requests were dropped


def test_execute_refuses_a_step_in_flight() -> None:
    llm = LLM("tiny", device="cpu", max_num_seqs=2, max_model_len=32)
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    plan = engine.scheduler.schedule()
    engine.executor.submit(plan)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.executor.execute(plan)
