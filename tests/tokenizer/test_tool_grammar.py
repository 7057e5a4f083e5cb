"""The forced tool-call grammar (`tool_choice` "required" / a named function): it admits exactly
the DSML calls blocks that `render_dsml_tool_calls` writes for the allowed tools with arguments
valid against their schemas, and the output parser reads them back as the same calls."""

from __future__ import annotations

import json

import pytest

from shoal.config import EngineConfig
from shoal.sampling.structured import StructuredOutputBackend, StructuredOutputSpec
from shoal.tokenizer.parser import OutputParser
from shoal.tokenizer.render import render_dsml_tool_calls
from shoal.tokenizer.tokenizer import load_tokenizer
from shoal.tokenizer.tool_grammar import tool_call_grammar

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "required": ["city"],
            "properties": {"city": {"type": "string"},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14},
                           "units": {"enum": ["metric", "imperial"]}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
WEATHER = ("get_weather", {"city": "Paris", "days": 3})


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(EngineConfig.create("tiny", device="cpu"))


@pytest.fixture(scope="module")
def backend(tok):
    return StructuredOutputBackend(tok.backend, eos_token_id=tok.eos_token_id)


def _admits(backend, tok, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole and then ends."""
    matcher = backend.matcher(StructuredOutputSpec(grammar=grammar))
    return all(matcher.accept(t) for t in tok.encode(text)) and matcher.is_finished()


def test_it_admits_rendered_calls_and_the_parser_reads_them_back(backend, tok) -> None:
    grammar = tool_call_grammar(TOOLS)
    calls = [WEATHER, ("get_weather", {"city": "Oslo", "units": "metric"}), ("now", {})]
    for chosen in ([WEATHER], calls):
        text = render_dsml_tool_calls(chosen)
        if ("now", {}) in chosen:  # no parameters: the renderer's empty line is optional
            text = text.replace('name="now">\n\n', 'name="now">\n')
        assert _admits(backend, tok, grammar, text), text
        parser = OutputParser.for_prompt("")
        parser.feed(text)
        calls_back = parser.finish().tool_calls
        assert [(c["name"], json.loads(c["arguments"])) for c in calls_back] == chosen


@pytest.mark.parametrize("text, why", [
    (render_dsml_tool_calls([("get_time", {})]), "an unknown tool"),
    (render_dsml_tool_calls([("get_weather", {"days": 3})]), "a required parameter missing"),
    (render_dsml_tool_calls([("get_weather", {"city": "Paris", "days": 30})]),
     "a value outside the schema"),
    (render_dsml_tool_calls([("get_weather", {"city": "Paris", "units": "si"})]),
     "a value outside the enum"),
    (render_dsml_tool_calls([("get_weather", {"city": "Paris", "extra": 1})]),
     "an unknown parameter"),
    ("Sure, let me look.", "no call at all"),
])
def test_it_refuses_calls_outside_the_tools(backend, tok, text: str, why: str) -> None:
    assert not _admits(backend, tok, tool_call_grammar(TOOLS), text), why


def test_a_named_function_and_single_calls(backend, tok) -> None:
    named = tool_call_grammar(TOOLS, name="now")
    assert not _admits(backend, tok, named, render_dsml_tool_calls([WEATHER]))
    single = tool_call_grammar(TOOLS, parallel=False)
    assert _admits(backend, tok, single, render_dsml_tool_calls([WEATHER]))
    assert not _admits(backend, tok, single, render_dsml_tool_calls([WEATHER, WEATHER]))
    with pytest.raises(ValueError, match="no function named"):
        tool_call_grammar(TOOLS, name="missing")
    with pytest.raises(ValueError, match="at least one function"):
        tool_call_grammar([])
