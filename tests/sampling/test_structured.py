"""Structured outputs: spec validation, llguidance errors, and mask-driven random walks whose
outputs are checked independently (json + a hand check of the schema, re.fullmatch)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from shoal.model.presets import get_preset
from shoal.sampling.structured import (
    StructuredOutputBackend,
    StructuredOutputSpec,
    tool_arguments_spec,
)
from shoal.tokenizer.synthetic import build_synthetic_tokenizer

EOS_ID = 1
VOCAB = 600  # wider than the 512-id tokenizer: ids >= 512 must never be allowed


@pytest.fixture(scope="module")
def tokenizer():
    return build_synthetic_tokenizer(get_preset("tiny"))


@pytest.fixture(scope="module")
def backend(tokenizer):
    return StructuredOutputBackend(tokenizer, eos_token_id=EOS_ID, vocab_size=VOCAB)


def random_walk(backend, spec, generator, max_steps=120):
    """Sample uniformly among allowed tokens until EOS; returns (text, token ids)."""
    matcher = backend.matcher(spec)
    ids: list[int] = []
    for _ in range(max_steps):
        mask = matcher.allowed_mask()
        assert mask.shape == (VOCAB,) and mask.dtype == torch.bool
        assert not mask[512:].any()
        allowed = mask.nonzero().flatten()
        assert len(allowed) > 0
        token = int(allowed[torch.randint(len(allowed), (1,), generator=generator)])
        assert matcher.accept(token)
        if token == EOS_ID:
            assert matcher.is_finished()
            return backend.decode(ids).decode("utf-8"), ids
        ids.append(token)
    raise AssertionError(f"no EOS after {max_steps} steps: {backend.decode(ids)!r}")


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


def check_schema(value) -> None:
    """Independent check of SCHEMA (no jsonschema dependency)."""
    assert isinstance(value, dict)
    assert set(value) <= {"name", "age", "tags", "ok"} and {"name", "age"} <= set(value)
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert type(value["age"]) is int and 0 <= value["age"] <= 999
    if "tags" in value:
        assert isinstance(value["tags"], list) and len(value["tags"]) <= 2
        assert all(t in ("a", "b") for t in value["tags"])
    if "ok" in value:
        assert type(value["ok"]) is bool


def test_random_walk_json_schema(backend):
    generator = torch.Generator().manual_seed(1234)
    spec = StructuredOutputSpec(json_schema=SCHEMA)
    for _ in range(50):
        text, _ = random_walk(backend, spec, generator)
        check_schema(json.loads(text))


@pytest.mark.parametrize("pattern", [r"[a-c]{2,4}-\d{1,3}", r"(yes|no|maybe)!?", r"0x[0-9a-f]{4}"])
def test_random_walk_regex(backend, pattern):
    generator = torch.Generator().manual_seed(7)
    spec = StructuredOutputSpec(regex=pattern)
    for _ in range(17):
        text, _ = random_walk(backend, spec, generator)
        assert re.fullmatch(pattern, text), text


def test_choice_and_lark(backend):
    generator = torch.Generator().manual_seed(3)
    choices = ("red", "green", "blue sky")
    seen = {
        random_walk(backend, StructuredOutputSpec(choice=list(choices)), generator)[0]
        for _ in range(12)
    }
    assert seen <= set(choices) and len(seen) >= 2
    spec = StructuredOutputSpec(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/')
    for _ in range(5):
        text, _ = random_walk(backend, spec, generator)
        assert re.fullmatch(r"\(\d{1,2}(,\d{1,2})*\)", text), text


def test_bitmask_matches_bool_mask_and_rejection_keeps_state(backend, tokenizer):
    matcher = backend.matcher(StructuredOutputSpec(regex=r"ab+c"))
    words = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(words)
    expected = [(int(words[t // 32]) >> (t % 32)) & 1 == 1 for t in range(VOCAB)]
    mask = matcher.allowed_mask()
    assert mask.tolist() == expected
    out = torch.zeros(VOCAB, dtype=torch.bool)
    matcher.fill_mask(out)
    assert torch.equal(out, mask)
    # allowed tokens are exactly those whose text is a prefix-compatible start of "ab+c"
    for token in mask.nonzero().flatten().tolist():
        assert re.fullmatch(r"ab*c?", backend.decode([token]).decode()), token
    forbidden = tokenizer.token_to_id("c")
    assert not mask[forbidden]
    assert not matcher.accept(forbidden) and not matcher.accept(EOS_ID)
    assert not matcher.accept(VOCAB - 1)  # beyond the tokenizer
    assert torch.equal(matcher.allowed_mask(), mask)  # state unchanged
    with pytest.raises(ValueError, match="bitmask"):
        matcher.fill_bitmask(torch.zeros(3, dtype=torch.int32))


def test_rollback_restores_mask(backend, tokenizer):
    matcher = backend.matcher(StructuredOutputSpec(regex=r"ab+c"))
    start = matcher.allowed_mask()
    a, b = tokenizer.token_to_id("a"), tokenizer.token_to_id("b")
    assert matcher.accept(a)
    after_a = matcher.allowed_mask()
    assert matcher.accept(b) and matcher.accept(b)
    assert matcher.count_acceptable([b, tokenizer.token_to_id("c"), a]) == 2
    matcher.rollback(2)
    assert torch.equal(matcher.allowed_mask(), after_a)
    matcher.rollback(1)
    assert torch.equal(matcher.allowed_mask(), start)
    with pytest.raises(ValueError, match="rollback"):
        matcher.rollback(1)


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutputSpec(regex="a(b"), "unclosed group"),
        (StructuredOutputSpec(grammar="start: foo"), "unknown name"),
        (StructuredOutputSpec(json_schema={"type": "foo"}), "foo"),
    ],
)
def test_invalid_constraints_raise_value_error_with_llguidance_message(backend, spec, message):
    with pytest.raises(ValueError, match=message):
        backend.matcher(spec)


def test_spec_validation_and_hashing():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputSpec()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputSpec(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="json_schema: invalid JSON"):
        StructuredOutputSpec(json_schema="{nope")
    with pytest.raises(ValueError, match="json_schema: expected a JSON object"):
        StructuredOutputSpec(json_schema="[1]")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputSpec(choice=[])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputSpec(choice="abc")
    with pytest.raises(ValueError, match="regex"):
        StructuredOutputSpec(regex="")
    a = StructuredOutputSpec(json_schema={"type": "object"})
    b = StructuredOutputSpec(json_schema='{"type": "object"}')
    assert a == b and hash(a) == hash(b) and a.schema == {"type": "object"}
    assert StructuredOutputSpec(choice=["x", "y"]).choice == ("x", "y")
    assert StructuredOutputSpec.from_response_format({"type": "text"}) is None
    assert StructuredOutputSpec.from_response_format({"type": "json_object"}) == a
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    assert StructuredOutputSpec.from_response_format(rf) == a
    with pytest.raises(ValueError, match="response_format.type"):
        StructuredOutputSpec.from_response_format({"type": "yaml"})


def test_each_grammar_is_built_once_and_matchers_are_independent(tokenizer, monkeypatch):
    """A repeated spec reuses its built grammar (errors too); every matcher is a fresh copy;
    the cache keeps `cache_size` grammars, least recently used out first."""
    backend = StructuredOutputBackend(tokenizer, eos_token_id=EOS_ID, vocab_size=VOCAB,
                                      cache_size=2)
    built = []
    build = StructuredOutputBackend._build
    monkeypatch.setattr(StructuredOutputBackend, "_build",
                        lambda self, grammar, kind: built.append(grammar) or
                        build(self, grammar, kind))
    digits = StructuredOutputSpec(regex=r"\d{3}")
    assert not backend.is_compiled(digits)
    first, second = backend.matcher(digits), backend.matcher(digits)
    assert len(built) == 1 and backend.is_compiled(digits)
    token = next(i for i in range(VOCAB) if first.allowed_mask()[i])
    assert first.accept(token) and first.num_accepted == 1
    assert torch.equal(second.allowed_mask(), backend.matcher(digits).allowed_mask())
    bad = StructuredOutputSpec(regex="a(b")
    for _ in range(2):
        with pytest.raises(ValueError, match="unclosed group"):
            backend.matcher(bad)
    assert len(built) == 2
    backend.prepare(StructuredOutputSpec(choice=["x"]))  # evicts digits (least recent)
    assert len(built) == 3 and backend.is_compiled(bad) and not backend.is_compiled(digits)
    backend.prepare(bad)  # (a cached error: nothing raised, nothing built)
    assert len(built) == 3


def test_threads_asking_for_one_new_grammar_build_it_once(tokenizer, monkeypatch):
    import threading
    import time

    backend = StructuredOutputBackend(tokenizer, eos_token_id=EOS_ID, vocab_size=VOCAB)
    built = []
    build = StructuredOutputBackend._build

    def slow(self, grammar, kind):
        built.append(grammar)
        time.sleep(0.2)  # the other threads arrive while it builds
        return build(self, grammar, kind)

    monkeypatch.setattr(StructuredOutputBackend, "_build", slow)
    spec = StructuredOutputSpec(regex=r"[a-f]{5}")
    got = []
    threads = [threading.Thread(target=lambda: got.append(backend.matcher(spec)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(built) == 1 and len(got) == 4 and len({id(m) for m in got}) == 4


def test_backend_validation(tokenizer):
    with pytest.raises(ValueError, match="vocab_size"):
        StructuredOutputBackend(tokenizer, eos_token_id=1, vocab_size=10)
    with pytest.raises(ValueError, match="eos_token_id"):
        StructuredOutputBackend(tokenizer, eos_token_id=10_000)


def test_tool_arguments_spec(backend):
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo"]},
                    "days": {"type": "integer", "maximum": 9},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
                "x-guidance": {"whitespace_flexible": False},
            },
        },
    }
    spec = tool_arguments_spec(tool)
    generator = torch.Generator().manual_seed(5)
    for _ in range(5):
        value = json.loads(random_walk(backend, spec, generator)[0])
        assert value["city"] in ("Paris", "Oslo") and type(value["days"]) is int
        assert value["days"] <= 9 and set(value) == {"city", "days"}
    no_params = tool_arguments_spec({"type": "function", "function": {"name": "f"}})
    assert no_params.schema == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="parameters.type"):
        tool_arguments_spec({"function": {"name": "f", "parameters": {"type": "array"}}})
    with pytest.raises(ValueError, match="function.name"):
        tool_arguments_spec({"function": {}})
