"""Request options end to end (tiny, CPU). scheduling_policy='priority': with one request
running at a time, requests complete in (priority, arrival) order (fcfs: arrival order),
outputs do not depend on the order, a bad priority is that request's error. bad_words: banned
as vLLM bans them, with and without speculative decoding."""

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


@pytest.mark.parametrize("speculative", [False, True])
def test_bad_words_through_the_engine(speculative: bool) -> None:
    """A greedy run's own tokens as bad words: a one-token word never appears, a two-token
    word's second token never follows its first; with speculative decoding (its verify steps
    read the outputs, so they resolve first) the outputs equal plain decoding's. Words given
    as strings are tokenized as given and after a space."""
    plain = LLM("tiny", device="cpu")
    llm = LLM("tiny", device="cpu", speculative=True) if speculative else plain
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (free,) = plain.generate([PROMPTS[2]], params, use_tqdm=False)
    ids = free.outputs[0].token_ids
    pair = (ids[2], ids[3])
    banned = params.replace(bad_words_token_ids=[[ids[0]], list(pair)])
    (want,) = plain.generate([PROMPTS[2]], banned, use_tqdm=False)
    (got,) = llm.generate([PROMPTS[2]], banned, use_tqdm=False)
    out = got.outputs[0].token_ids
    assert out == want.outputs[0].token_ids and ids[0] not in out and out != ids
    assert all((a, b) != pair for a, b in zip(out, out[1:], strict=False))
    engine = llm.engine
    words = engine._with_bad_words(params.replace(bad_words=["ab", " cd"]))
    enc = engine.tokenizer.encode
    expect = {tuple(enc(t, add_special_tokens=False)) for t in ("ab", " ab", " cd")}
    assert set(words.bad_words_token_ids) == expect
