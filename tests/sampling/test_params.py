"""SamplingParams: defaults, normalisation, copy-on-write, and a ValueError for every bad value."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shoal.sampling.params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.detokenize and p.structured is None
    assert not p.is_greedy and not p.has_penalties


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[7, 9], top_k=-1, temperature=0)
    assert p.stop == ("###",)
    assert p.stop_token_ids == (7, 9)
    assert p.top_k == 0
    assert isinstance(p.temperature, float) and p.is_greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(frequency_penalty=0.1).has_penalties
    hash(p)  # frozen + tuples: usable as a dict key


def test_frozen_and_replace() -> None:
    p = SamplingParams(temperature=0.5, stop=["x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    q = p.replace(top_k=5, stop="y")
    assert (q.top_k, q.stop, q.temperature) == (5, ("y",), 0.5)
    assert (p.top_k, p.stop) == (0, ("x",))
    with pytest.raises(ValueError, match="top_k"):
        p.replace(top_k=-3)


BAD_VALUES = [
    ("n", 0),
    ("n", 1.5),
    ("n", True),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", math.nan),
    ("seed", 1.0),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("min_tokens", -1),
    ("stop", 5),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1),
    ("include_stop_str_in_output", "yes"),
    ("skip_special_tokens", None),
    ("detokenize", 0),
    ("logprobs", -1),
    ("logprobs", 2.0),
    ("prompt_logprobs", -2),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_names_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message
    assert "expected" in message


def test_cross_field_checks() -> None:
    with pytest.raises(ValueError, match=r"min_tokens=5 .*max_tokens=3"):
        SamplingParams(min_tokens=5, max_tokens=3)
    SamplingParams(min_tokens=5, max_tokens=None)  # unbounded is fine
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_validate_against_vocab() -> None:
    p = SamplingParams(stop_token_ids=[5], logprobs=3, prompt_logprobs=2, top_k=1000)
    p.validate(vocab_size=10)  # top_k above the vocabulary is clamped, not an error
    with pytest.raises(ValueError, match=r"stop_token_ids contains 10.*vocab_size=10"):
        SamplingParams(stop_token_ids=[10]).validate(vocab_size=10)
    with pytest.raises(ValueError, match=r"logprobs=11 .*at most 10"):
        SamplingParams(logprobs=11).validate(vocab_size=10)
    with pytest.raises(ValueError, match=r"prompt_logprobs=3 .*at most 2"):
        SamplingParams(prompt_logprobs=3).validate(vocab_size=10, max_logprobs=2)
    with pytest.raises(ValueError, match="vocab_size"):
        p.validate(vocab_size=0)


def test_logit_bias_and_allowed_token_ids_are_checked_and_normalised() -> None:
    p = SamplingParams(logit_bias={"7": -100, 2: 0.5}, allowed_token_ids=[4, 2])
    assert p.logit_bias == ((2, 0.5), (7, -100.0)) and p.allowed_token_ids == (4, 2)
    assert hash(p) == hash(SamplingParams(logit_bias=[(7, -100.0), (2, 0.5)],
                                          allowed_token_ids=(4, 2)))
    p.validate(vocab_size=8)
    for bad in ({3: 100.5}, {3: float("nan")}, {-1: 1.0}, {"x": 1.0}, {1.5: 1.0}, "3:1"):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    for bad in ([], [-2], "12", [1.0]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="logit_bias contains 8"):
        SamplingParams(logit_bias={8: 1.0}).validate(vocab_size=8)
    with pytest.raises(ValueError, match="allowed_token_ids contains 9"):
        SamplingParams(allowed_token_ids=[9]).validate(vocab_size=8)
