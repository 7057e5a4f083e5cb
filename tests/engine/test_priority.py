"""scheduling_policy='priority' end to end (tiny, CPU): with one request running at a time,
requests complete in (priority, arrival) order, through LLM.generate, JSONL lines and the
engine; fcfs keeps arrival order; outputs do not depend on the order; a bad priority is that
request's error."""

from __future__ import annotations

import pytest

from shoal import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
PRIORITIES = [3, 0, 3, -2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_completion_order_follows_the_policy(policy: str) -> None:
    llm = LLM("tiny", device="cpu", max_num_seqs=1, scheduling_policy=policy)
    items = [{"prompt_token_ids": p, "sampling_params": GREEDY, "priority": q}
             for p, q in zip(PROMPTS, PRIORITIES, strict=True)]
    order = [i for i, _ in llm.run(items, use_tqdm=False)]
    assert order == ([3, 1, 0, 2] if policy == "priority" else [0, 1, 2, 3])
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=PRIORITIES)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


def test_a_bad_priority_is_the_requests_error() -> None:
    llm = LLM("tiny", device="cpu")
    good, bad = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[0, "high"])
    assert good.error is None and bad.error is not None and "priority" in bad.error
    with pytest.raises(ValueError, match="priority"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[0])
