"""Structured outputs end to end: 100 sampled completions (temperature 1.0, distinct seeds, one
batch) under a JSON-schema or a regex constraint all finish and validate independently
(json.loads + a hand check of the schema; re.fullmatch); a bad constraint fails only its own
request. Own engine: the requests finish at different steps, through the constraint.
"""

from __future__ import annotations

import json
import random
import re

from engine.refloop import random_prompt, session_seed
from shoal import LLM, SamplingParams
from shoal.sampling.structured import StructuredOutputSpec

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # compact JSON: bounded length
}
REGEX = r"[ab]{1,4}-[0-9]{1,2}"
NUM_EACH = 50
MAX_TOKENS = 24  # compact SCHEMA text is at most 16 tokens, REGEX text 7


def valid_json(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == {"ok", "n"}
            and isinstance(value["ok"], bool)
            and type(value["n"]) is int and 0 <= value["n"] <= 99)


def test_constrained_samples_all_validate() -> None:
    rng = random.Random(session_seed() + 4)
    json_spec = StructuredOutputSpec(json_schema=SCHEMA)
    regex_spec = StructuredOutputSpec(regex=REGEX)
    prompts, params, kinds = [], [], []
    for i in range(2 * NUM_EACH):
        kind = "json" if i % 2 == 0 else "regex"
        prompts.append(random_prompt(rng, rng.randint(1, 6)))
        params.append(SamplingParams(temperature=1.0, seed=rng.randrange(1 << 40),
                                     max_tokens=MAX_TOKENS,
                                     structured=json_spec if kind == "json" else regex_spec))
        kinds.append(kind)
    prompts.append([5, 6])
    params.append(SamplingParams(max_tokens=4, structured=StructuredOutputSpec(regex="(")))
    llm = LLM("tiny", device="cpu", max_num_seqs=128)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == len(prompts)
    *good, bad = outs
    assert bad.error is not None and "regex" in bad.error
    texts = {"json": [], "regex": []}
    for kind, out in zip(kinds, good, strict=True):
        assert out.error is None, out.error
        (c,) = out.outputs
        assert c.finish_reason == "stop", (kind, c.text, c.token_ids)
        if kind == "json":
            assert valid_json(c.text), c.text
        else:
            assert re.fullmatch(REGEX, c.text), c.text
        texts[kind].append(c.text)
    assert len(set(texts["json"])) > 1 and len(set(texts["regex"])) > 1  # really sampled


def test_the_constraint_starts_after_the_reasoning() -> None:
    """A prompt that opens the reasoning (ends with <think>) gets its structured output after
    the model closes it: no mask and no matcher step while it thinks, the constraint from the
    token after </think>. A prompt without open reasoning is constrained from the start."""
    from shoal.tokenizer.encoding import encode_messages
    from shoal.tokenizer.special import THINK_END

    llm = LLM("tiny", device="cpu")
    engine, tok = llm.engine, llm.tokenizer
    params = SamplingParams(max_tokens=8, structured=StructuredOutputSpec(choice=["yes", "no"]))
    messages = [{"role": "user", "content": "ok?"}]
    thinking = engine.add_request(encode_messages(messages), params)
    direct = engine.add_request(encode_messages(messages, thinking=False), params)
    think, plain = engine.requests[thinking], engine.requests[direct]
    assert not think.grammar_active and plain.grammar_active
    masks = engine.grammar_masks(engine.scheduler.schedule())  # the first step's sampling
    assert set(masks) == {direct} and masks[direct].sum() < tok.vocab_size

    thought = tok.encode("let me see")  # free text, not a word the constraint allows
    for token in thought:
        think.append_token(token)
    assert not think.grammar_active and not think.matcher.is_finished()
    think.append_token(tok.token_to_id(THINK_END))
    assert think.grammar_active
    for token in tok.encode("yes"):
        think.append_token(token)
    assert think.matcher.is_finished()
