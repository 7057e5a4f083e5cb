"""End-to-end equivalences of the engine on the tiny model (CPU).

- greedy `LLM.generate` = a plain prefill + argmax-decode loop over the reference model, with
  chunked prefill (a token budget below the longest prompt) and queued requests
  (max_num_seqs below the number of prompts), for the exact tail-only modes "full" and
  "staircase"; in "full" mode also the logprobs of every step and the prompt logprobs across
  prefill chunks;
- sampled requests (temperature 0.8, top_p 0.9, fixed seeds) give the same tokens alone, in a
  batch of 8, and in a shuffled batch through `generate_iter`.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.refloop import (
    assert_greedy,
    main_prompts,
    random_prompt,
    session_seed,
    shared_llm,
)
from shoal import LLM, SamplingParams

MAX_TOKENS = 4
SAMPLED_TOKENS = 3
LOGPROBS, PROMPT_LOGPROBS = 3, 2
LP_TOL = 1e-4


def _check_logprob_entry(entry, token: int, logits: torch.Tensor, top_n: int) -> None:
    """One position's logprob dict vs log_softmax of the reference logits at that position:
    the top N (up to ties within noise) plus the chosen / target token, values and its rank."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    nth = float(lp.topk(top_n).values[-1])
    for tid, value in entry.items():
        assert math.isclose(value.logprob, float(lp[tid]), abs_tol=LP_TOL), (tid, value, lp[tid])
        if tid != token:
            assert float(lp[tid]) >= nth - LP_TOL, f"token {tid} is not in the top {top_n}"
    others = len(entry) - (1 if token in entry else 0)
    assert token in entry
    assert others in (top_n - 1, top_n), sorted(entry)
    if others == top_n:  # the token was not among the top N
        assert float(lp[token]) <= nth + LP_TOL
    ref = float(lp[token])
    lo, hi = 1 + int((lp > ref + LP_TOL).sum()), int((lp > ref - LP_TOL).sum())
    assert lo <= entry[token].rank <= hi, (entry[token].rank, lo, hi)


@pytest.mark.parametrize("mode, budget, max_seqs", [("full", 16, 2), ("staircase", 24, 3)])
def test_greedy_generate_equals_reference_loop(mode: str, budget: int, max_seqs: int) -> None:
    ps = main_prompts()
    refs = ps.refs()
    assert max(map(len, ps.ids)) > budget > 8  # chunked prefill, prompts beyond the window
    assert len(ps.ids) > max_seqs  # requests wait in the queue
    llm = LLM("tiny", device="cpu", prefill_mode=mode, max_num_batched_tokens=budget,
              max_num_seqs=max_seqs)
    with_lp = mode == "full"  # prompt logprobs force every decoder row: keep staircase pure
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            logprobs=LOGPROBS if with_lp else None,
                            prompt_logprobs=PROMPT_LOGPROBS if with_lp else None)
    outs = llm.generate(ps.engine_prompts(), params, use_tqdm=False)
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs, strict=True):
        assert out.error is None
        assert tuple(out.prompt_token_ids) == ref.prompt
        (completion,) = out.outputs
        assert_greedy(completion.token_ids, completion.finish_reason, ref, MAX_TOKENS)
        if not with_lp:
            assert completion.logprobs is None and out.prompt_logprobs is None
            continue
        tokens = completion.token_ids
        assert len(completion.logprobs) == len(tokens)
        for step, (entry, token) in enumerate(zip(completion.logprobs, tokens, strict=True)):
            if token != ref.tokens[step]:
                break  # after a near-tie swap the contexts differ
            _check_logprob_entry(entry, token, ref.step_logits[step], LOGPROBS)
            assert entry[token].rank == 1
        expected_cum = sum(e[t].logprob for e, t in zip(completion.logprobs, tokens, strict=True))
        assert math.isclose(completion.cumulative_logprob, expected_cum, abs_tol=1e-6)
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(ref.prompt)
        assert plp[0] is None
        for pos in range(1, len(ref.prompt)):
            _check_logprob_entry(plp[pos], ref.prompt[pos], ref.prompt_logits[pos - 1],
                                 PROMPT_LOGPROBS)


def test_sampled_tokens_do_not_depend_on_the_batch() -> None:
    rng = random.Random(session_seed() + 1)
    prompts = [random_prompt(rng, rng.randint(3, 12)) for _ in range(8)]
    assert len({tuple(p) for p in prompts}) == 8
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 40),
                             max_tokens=SAMPLED_TOKENS, ignore_eos=True) for _ in prompts]
    llm = shared_llm()
    together = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in together]
    assert all(len(t) == SAMPLED_TOKENS for t in tokens)
    assert len({tuple(t) for t in tokens}) > 1  # the seeds matter
    for i in rng.sample(range(8), 1):
        (alone,) = llm.generate([prompts[i]], params[i], use_tqdm=False)
        assert alone.outputs[0].token_ids == tokens[i], f"prompt {i} alone vs in a batch of 8"
    order = list(range(8))
    rng.shuffle(order)
    seen: dict[tuple[int, ...], list[int]] = {}
    ids = []
    for out in llm.generate_iter([prompts[i] for i in order], [params[i] for i in order]):
        ids.append(out.request_id)
        seen[tuple(out.prompt_token_ids)] = out.outputs[0].token_ids
    assert len(ids) == len(set(ids)) == 8  # every request exactly once
    for i, p in enumerate(prompts):
        assert seen[tuple(p)] == tokens[i], f"prompt {i} in shuffled order {order}"
