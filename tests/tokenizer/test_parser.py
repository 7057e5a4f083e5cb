"""Streaming DSML/reasoning parser: golden parses, chunking invariance, encode -> parse."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.tokenizer.encoding import encode_messages
from shoal.tokenizer.parser import OutputParser, ParserState, parse_completion

EOS = "<｜end▁of▁sentence｜>"
CALLS = "<｜DSML｜ calls>"
END_CALLS = "</｜DSML｜ calls>"


def invoke(name: str, *params: str) -> str:
    return f'<｜DSML｜ invoke name="{name}">\n' + "\n".join(params) + "\n</｜DSML｜ invoke>"


def param(key: str, value: str, string: str | None = "true") -> str:
    attr = "" if string is None else f' string="{string}"'
    return f'<｜DSML｜ parameter name="{key}"{attr}>{value}</｜DSML｜ parameter>'


def calls_block(*invokes: str) -> str:
    return "\n\n" + CALLS + "\n" + "\n".join(invokes) + "\n" + END_CALLS


def feed_chunks(text: str, sizes: list[int], reasoning: bool = True):
    parser = OutputParser(ParserState.REASONING if reasoning else ParserState.CONTENT)
    events, pos, i = [], 0, 0
    while pos < len(text):
        size = sizes[i % len(sizes)] if sizes else len(text)
        events += parser.feed(text[pos : pos + size])
        pos, i = pos + size, i + 1
    events += parser.close()
    return events, parser.finish()


def check_events(events, out):
    """Events concatenate to the final output (reasoning, content, each call's arguments)."""
    assert "".join(e.text for e in events if e.kind == "reasoning") == (out.reasoning_content or "")
    assert "".join(e.text for e in events if e.kind == "content") == out.content
    starts = [e for e in events if e.kind == "tool_call"]
    assert [e.name for e in starts] == [c["name"] for c in out.tool_calls]
    for index, call in enumerate(out.tool_calls):
        args = "".join(e.text for e in events if e.kind == "tool_arguments" and e.index == index)
        assert args == call["arguments"]


def test_reasoning_content_and_tool_calls():
    text = (
        "think</think>Answer"
        + calls_block(
            invoke("f", param("city", "Paris"), param("days", "3", "false")),
            invoke("g"),
        )
        + EOS
    )
    out = parse_completion(text)
    assert out.reasoning_content == "think"
    assert out.content == "Answer"
    assert out.tool_calls == [
        {"name": "f", "arguments": '{"city": "Paris", "days": 3}'},
        {"name": "g", "arguments": "{}"},
    ]
    assert out.errors == [] and out.warnings == [] and out.finished
    assert out.state is ParserState.DONE


def test_chat_mode_and_for_prompt():
    prompt = encode_messages([{"role": "user", "content": "x"}], reasoning_effort="none")
    parser = OutputParser.for_prompt(prompt)
    assert parser.state is ParserState.CONTENT
    parser.feed("Hello</think> world" + EOS)
    out = parser.finish()
    assert out.reasoning_content is None and out.content == "Hello</think> world"
    assert OutputParser.for_prompt(encode_messages([{"role": "user", "content": "x"}])).state is (
        ParserState.REASONING
    )
    # a continued assistant prefix: mid-reasoning, or past it
    user = {"role": "user", "content": "x"}
    for assistant, state in (({"reasoning_content": "let me"}, ParserState.REASONING),
                             ({"reasoning_content": "r", "content": "So"}, ParserState.CONTENT)):
        prompt = encode_messages([user, {"role": "assistant", **assistant}],
                                 continue_final_message=True)
        assert OutputParser.for_prompt(prompt).state is state, prompt


def test_json_values_kept_verbatim_and_lenient_fallback():
    text = "</think>" + calls_block(
        invoke(
            "f",
            param("a", '{"x": [1, 2.5, null]}', "false"),
            param("b", "not json", "false"),
            param("c", "[1]", None),
            param("d", "NaN", "false"),
        )
    )
    out = parse_completion(text + EOS)
    args = json.loads(out.tool_calls[0]["arguments"])
    assert args == {"a": {"x": [1, 2.5, None]}, "b": "not json", "c": [1], "d": "NaN"}
    assert out.tool_calls[0]["arguments"].startswith('{"a": {"x": [1, 2.5, null]}, "b": ')
    assert len(out.warnings) == 3 and not out.errors
    assert any("'c' has no string attribute" in w for w in out.warnings)


def test_duplicate_parameter_is_an_error_first_value_kept():
    text = "</think>" + calls_block(invoke("f", param("k", "1"), param("k", "2"))) + EOS
    out = parse_completion(text)
    assert json.loads(out.tool_calls[0]["arguments"]) == {"k": "1"}
    assert len(out.errors) == 1 and "duplicate parameter 'k'" in out.errors[0]


def test_tolerated_deviations():
    # calls inside the reasoning end it; no blank line before the calls block
    out = parse_completion("hmm" + CALLS + "\n" + invoke("f") + "\n" + END_CALLS + EOS)
    assert out.reasoning_content == "hmm" and out.tool_calls == [{"name": "f", "arguments": "{}"}]
    assert len(out.warnings) == 1
    # an invoke without a calls block; never leaks into the content
    out = parse_completion("Sure" + invoke("f", param("x", "1", "false")) + EOS, reasoning=False)
    assert out.content == "Sure" and json.loads(out.tool_calls[0]["arguments"]) == {"x": 1}
    # text after the block and after EOS is ignored with warnings
    out = parse_completion("</think>a" + calls_block(invoke("f")) + " junk" + EOS + "more")
    assert out.content == "a" and len(out.warnings) == 2
    # EOS while reasoning
    out = parse_completion("still thinking" + EOS)
    assert out.reasoning_content == "still thinking" and out.content == ""
    assert out.warnings and out.finished


def test_truncation():
    out = parse_completion("</think>x" + "\n\n" + CALLS + "\n" + invoke("f", param("a", "1"))[:-5])
    assert out.content == "x" and not out.finished
    assert out.tool_calls == [{"name": "f", "arguments": '{"a": "1"}'}]
    assert out.errors  # the call was not closed
    out = parse_completion("</think>abc\n\n<｜DSML")
    assert out.content == "abc" and out.warnings
    out = parse_completion("</think>abc\n\n<", reasoning=True)
    assert out.content == "abc\n\n<"


def test_partial_markers_never_leak_at_any_split():
    text = "r</think>c <tag> \n\n" + calls_block(invoke("f", param("s", "v"))) + EOS
    whole_events, whole = feed_chunks(text, [])
    for split in range(len(text) + 1):
        parser = OutputParser()
        events = parser.feed(text[:split]) + parser.feed(text[split:])
        out = parser.finish()
        assert out == whole
        for e in events:
            assert "DSML" not in e.text or e.kind == "tool_arguments"
            assert "</think>" not in e.text
    check_events(whole_events, whole)
    assert whole.content == "c <tag> \n\n"


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
TAGGY = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<｜DSML｜ invoke",
        '<｜DSML｜ parameter name="x">',
        "</｜DSML｜ invoke>",
        "</｜DSML｜ calls>",
        "｜DSML｜",
        "<tool_result>",
        "\n\n",
        "<",
        '"',
        ">",
    ]
)
STRINGS = st.lists(st.text(max_size=6) | TAGGY, max_size=5).map("".join)
KEYS = st.text(st.characters(blacklist_characters='"', blacklist_categories=("Cs",)), max_size=8)
NAMES = st.text(
    st.characters(blacklist_characters='"<>', blacklist_categories=("Cs",)), min_size=1, max_size=8
)
PLAIN = st.text(max_size=30).filter(lambda s: "<｜" not in s and "</think>" not in s)


@settings(max_examples=100, deadline=None)
@given(
    reasoning=PLAIN,
    content=PLAIN,
    calls=st.lists(st.tuples(NAMES, st.dictionaries(KEYS, STRINGS | JSON, max_size=4)), max_size=3),
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=4),
)
def test_encode_then_parse_round_trip(reasoning, content, calls, sizes):
    """An assistant turn rendered by the encoder parses back to the same message, for any
    chunking; strings with tag-like text inside parameters survive."""
    assistant = {
        "role": "assistant",
        "reasoning_content": reasoning,
        "content": content,
        "tool_calls": [
            {"id": str(i), "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ],
    }
    msgs = [{"role": "user", "content": "q"}]
    prompt = encode_messages(msgs)
    full = encode_messages(msgs + [assistant], add_generation_prompt=False)
    assert full.startswith(prompt)
    completion = full[len(prompt) :]
    events, out = feed_chunks(completion, sizes)
    _, whole = feed_chunks(completion, [])
    assert out == whole
    check_events(events, out)
    assert out.reasoning_content == reasoning and out.content == content
    assert [c["name"] for c in out.tool_calls] == [n for n, _ in calls]
    assert [json.loads(c["arguments"]) for c in out.tool_calls] == [a for _, a in calls]
    assert out.errors == [] and out.warnings == [] and out.finished


def test_token_stream_through_synthetic_tokenizer():
    """Prompt/completion tokenised by the synthetic tokenizer, detokenised id by id with special
    tokens kept, parse to the original assistant message."""
    from shoal.model.presets import get_preset
    from shoal.tokenizer import Tokenizer, build_synthetic_tokenizer

    tok = Tokenizer(build_synthetic_tokenizer(get_preset("tiny")))
    msgs = [{"role": "user", "content": "q"}]
    args = {"x": [1, "<｜DSML｜ invoke"], "s": "é </think>"}
    assistant = {
        "role": "assistant",
        "reasoning_content": "think <b>",
        "content": "Hi there",
        "tool_calls": [{"function": {"name": "f", "arguments": args}}],
    }
    prompt = encode_messages(msgs)
    completion = encode_messages(msgs + [assistant], add_generation_prompt=False)[len(prompt) :]
    detok = tok.incremental(tok.encode(prompt))
    parser = OutputParser.for_prompt(prompt)
    for token_id in tok.encode(completion):
        parser.feed(detok.step(token_id))
    parser.feed(detok.flush())
    out = parser.finish()
    assert (out.reasoning_content, out.content) == ("think <b>", "Hi there")
    assert out.tool_calls[0]["name"] == "f" and json.loads(out.tool_calls[0]["arguments"]) == args
    assert out.finished and not out.errors and not out.warnings
