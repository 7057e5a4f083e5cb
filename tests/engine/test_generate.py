"""Stopping and sampling features end to end, against the plain reference loop (tiny, CPU).

Everything runs in ONE batched `generate` call (a forward step of the CPU reference model costs
about a second, whatever the batch): stop strings spanning two tokens (with and without
include_stop_str_in_output), stop_token_ids, min_tokens, max_tokens, EOS with and without
ignore_eos (a seed whose first sample is EOS is found with the engine's own sampler on the
reference logits), and n > 1 (distinct per-sample seeds; sample 0 equals the n = 1 request).
"""

from __future__ import annotations

import random

import torch

from engine.refloop import (
    EOS,
    REF_STEPS,
    TIE_GAP,
    Reference,
    assert_greedy,
    main_prompts,
    session_seed,
    shared_llm,
    tokenizer,
    trusted_steps,
)
from shoal import LLM, SamplingParams
from shoal.model.presets import TINY
from shoal.sampling import Sampler, SamplingBatch, request_seed

GREEDY = SamplingParams(temperature=0.0, max_tokens=REF_STEPS)


def output_texts(ref: Reference) -> list[str] | None:
    """T_k, the output text after k greedy tokens, as decoding prompt + output shows it."""
    tok = tokenizer()
    base = tok.decode(list(ref.prompt), skip_special_tokens=True)
    texts = []
    for k in range(len(ref.tokens) + 1):
        full = tok.decode(list(ref.prompt) + list(ref.tokens[:k]), skip_special_tokens=True)
        if not full.startswith(base):
            return None
        texts.append(full[len(base):])
    return texts


def find_spanning_stop(refs: list[Reference]) -> tuple[int, int, str, list[str]]:
    """(prompt index, i, s, texts): s = last char of token i's text + first char of token
    i+1's text, occurring first exactly there."""
    for p, ref in enumerate(refs):
        texts = output_texts(ref)
        if texts is None:
            continue
        for i in range(len(ref.tokens) - 1):
            if EOS in ref.tokens[: i + 2] or trusted_steps(ref, i + 2) < i + 2:
                break
            a, b, c = texts[i], texts[i + 1], texts[i + 2]
            if not (len(a) < len(b) < len(c) and b.startswith(a) and c.startswith(b)):
                continue
            s = b[-1] + c[len(b)]
            if "\ufffd" in s or b.endswith("\ufffd") or c.endswith("\ufffd") or s in b:
                continue
            return p, i, s, texts
    raise AssertionError("no two consecutive clean tokens in the greedy outputs")


def find_stop_token(refs: list[Reference]) -> tuple[int, int]:
    """(prompt index, j >= 1): tokens[j] occurs first at j, and nothing stops before it."""
    for p, ref in enumerate(refs):
        for j in range(1, len(ref.tokens)):
            t = ref.tokens[j]
            if EOS in ref.tokens[: j + 1] or trusted_steps(ref, j + 1) < j + 1:
                break
            if t not in ref.tokens[:j]:
                return p, j
    raise AssertionError("no usable stop token in the greedy outputs")


def find_eos_seed(ref: Reference, temperature: float, rng: random.Random) -> int:
    """A user seed whose first sampled token is EOS, robustly (the engine's logits differ from
    the reference's by fp noise): the engine's Sampler on the reference logits."""
    sampler = Sampler()
    params = SamplingParams(temperature=temperature, max_tokens=3)

    def first(logits: torch.Tensor, users: list[int]) -> torch.Tensor:
        batch = SamplingBatch.from_params(
            [params] * len(users),
            seeds=[request_seed(u, engine_seed=0, request_index=0) for u in users],
            positions=[len(ref.prompt)] * len(users), output_token_ids=[[]] * len(users),
            vocab_size=TINY.vocab_size, eos_token_ids=(EOS,))
        return sampler.sample(logits.expand(len(users), -1).contiguous(), batch).token_ids

    for _ in range(8):
        users = [rng.randrange(1 << 40) for _ in range(8192)]
        hits = [u for u, t in zip(users, first(ref.step_logits[0], users).tolist(),
                                  strict=True) if t == EOS]
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        for u in hits:
            if all(int(first(ref.step_logits[0] + TIE_GAP * torch.randn(
                    TINY.vocab_size, generator=g), [u])[0]) == EOS for _ in range(4)):
                return u
    raise AssertionError("no seed samples EOS first")


def test_stop_strings_spanning_two_tokens() -> None:
    """Own engine: a request finished by a stop string must not disturb later steps."""
    ps = main_prompts()
    refs = ps.refs()
    sp, si, stop, texts = find_spanning_stop(refs)
    print(f"stop string {stop!r} after token {si} of prompt {sp}")
    prompt = ps.engine_prompts()[sp]
    llm = LLM("tiny", device="cpu")
    # a long greedy neighbour keeps the engine stepping after the stop-string requests finish
    params = [GREEDY.replace(stop=["\x00never", stop]),
              GREEDY.replace(stop=[stop], include_stop_str_in_output=True), GREEDY]
    outs = llm.generate([prompt] * 3, params, use_tqdm=False)
    for c in (outs[0].outputs[0], outs[1].outputs[0]):
        assert c.token_ids == list(refs[sp].tokens[: si + 2])
        assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert outs[0].outputs[0].text == texts[si + 1][:-1]
    assert outs[1].outputs[0].text == texts[si + 1][:-1] + stop
    c = outs[2].outputs[0]
    assert_greedy(c.token_ids, c.finish_reason, refs[sp], REF_STEPS)
    # the engine is still usable afterwards
    (again,) = llm.generate([prompt], params[0], use_tqdm=False)
    assert again.outputs[0].token_ids == list(refs[sp].tokens[: si + 2])


def test_stops_min_max_tokens_eos_and_n() -> None:
    rng = random.Random(session_seed() + 2)
    ps = main_prompts()
    refs = ps.refs()
    prompts = ps.engine_prompts()
    tp, tj = find_stop_token(refs)
    stop_id = refs[tp].tokens[tj]
    mp = next(p for p, r in enumerate(refs) if r.tokens[0] != EOS)
    banned_first = refs[mp].tokens[0]
    ep = 0
    eos_seed = find_eos_seed(refs[ep], 1.0, rng)
    n_seed = rng.randrange(1 << 40)
    print(f"stop id {stop_id} at {tj} of prompt {tp}; eos seed {eos_seed}")
    requests = {
        "greedy": (0, GREEDY),
        "max1": (1, GREEDY.replace(max_tokens=1)),
        "stop_id": (tp, GREEDY.replace(stop_token_ids=[stop_id])),
        "min_tokens": (mp, GREEDY.replace(max_tokens=2, min_tokens=2,
                                          stop_token_ids=[banned_first])),
        "eos": (ep, SamplingParams(temperature=1.0, seed=eos_seed, max_tokens=3)),
        "ignore_eos": (ep, SamplingParams(temperature=1.0, seed=eos_seed, max_tokens=3,
                                          ignore_eos=True)),
        "n3": (2, SamplingParams(n=3, temperature=1.0, seed=n_seed, max_tokens=3,
                                 ignore_eos=True)),
        "n1": (2, SamplingParams(n=1, temperature=1.0, seed=n_seed, max_tokens=3,
                                 ignore_eos=True)),
    }
    names = list(requests)
    outs = shared_llm().generate([prompts[requests[k][0]] for k in names],
                                 [requests[k][1] for k in names], use_tqdm=False)
    assert len(outs) == len(names)
    got = dict(zip(names, outs, strict=True))
    for name, out in got.items():
        assert out.error is None, (name, out.error)
        assert tuple(out.prompt_token_ids) == refs[requests[name][0]].prompt, name

    c = got["greedy"].outputs[0]
    assert_greedy(c.token_ids, c.finish_reason, refs[0], REF_STEPS)
    texts0 = output_texts(refs[0])
    if texts0 is not None and c.token_ids == list(refs[0].tokens[: len(c.token_ids)]):
        assert c.text == texts0[len(c.token_ids)]  # incremental detokenisation = whole decode
    c = got["max1"].outputs[0]
    assert_greedy(c.token_ids, c.finish_reason, refs[1], 1)

    c = got["stop_id"].outputs[0]
    assert c.token_ids == list(refs[tp].tokens[: tj + 1])
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)

    c = got["min_tokens"].outputs[0]
    masked = refs[mp].step_logits[0].clone()
    masked[[banned_first, EOS]] = -torch.inf
    top2 = masked.topk(2)
    assert len(c.token_ids) == 2 and c.finish_reason == "length"
    assert not {banned_first, EOS} & set(c.token_ids)  # suppressed below min_tokens
    if float(top2.values[0] - top2.values[1]) >= TIE_GAP:
        assert c.token_ids[0] == int(top2.indices[0])

    c = got["eos"].outputs[0]
    assert (c.token_ids, c.finish_reason, c.text, c.stop_reason) == ([EOS], "stop", "", None)
    c = got["ignore_eos"].outputs[0]
    assert c.token_ids[0] == EOS and len(c.token_ids) == 3 and c.finish_reason == "length"

    samples = got["n3"].outputs
    assert [s.index for s in samples] == [0, 1, 2]
    assert all(len(s.token_ids) == 3 for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1, "the n samples share one seed"
    assert samples[0].token_ids == got["n1"].outputs[0].token_ids
