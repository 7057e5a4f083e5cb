"""Golden renderings of the DeepSeek-V4.1 chat encoding, written by hand from the official
format (model.md §8; SGLang encoding_dsv41.py / vLLM deepseek_v41_encoding.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.tokenizer.encoding import EffortTable, encode_messages
from shoal.tokenizer.special import IMAGE_PLACEHOLDER
from support.chat import WEATHER, user

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYS = "<｜System｜>"
USR = "<｜User｜>"
AST = "<｜Assistant｜>"


def effort(n: int) -> str:
    return (
        f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the "
        "reasoning)\n\n"
    )


E75 = SYS + effort(75)

# The tools block, typed out from the reference template (byte for byte).
TOOLS_BLOCK = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

def test_single_turn_thinking_default_effort():
    assert encode_messages([user("Hi")]) == BOS + E75 + USR + "Hi" + AST + "<think>"


def test_single_turn_with_system():
    msgs = [{"role": "system", "content": "Be brief."}, user("Hi")]
    assert encode_messages(msgs) == BOS + E75 + "Be brief." + USR + "Hi" + AST + "<think>"
    chat = encode_messages(msgs, reasoning_effort="none")
    assert chat == BOS + SYS + "Be brief." + USR + "Hi" + AST + "</think>"


def test_chat_mode_none():
    assert encode_messages([user("Hi")], reasoning_effort="none") == (
        BOS + USR + "Hi" + AST + "</think>"
    )
    assert encode_messages([user("Hi")], thinking=False, reasoning_effort="max") == (
        BOS + USR + "Hi" + AST + "</think>"
    )
    with pytest.raises(ValueError, match="reasoning_effort='none'"):
        encode_messages([user("Hi")], reasoning_effort="none", thinking=True)


@pytest.mark.parametrize(
    "value, budget",
    [
        (None, 75),
        ("low", 50),
        ("high", 75),
        ("xhigh", 75),
        ("max", 100),
        (1, 1),
        (37, 37),
        (100, 100),
    ],
)
def test_effort_values(value, budget):
    got = encode_messages([user("x")], reasoning_effort=value)
    assert got == BOS + SYS + effort(budget) + USR + "x" + AST + "<think>"


@pytest.mark.parametrize("value", [0, 101, -5, "medium", "50", 50.0, True, "LOW", ""])
def test_bad_effort_values(value):
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages([user("x")], reasoning_effort=value)


def test_custom_effort_table():
    table = EffortTable(low=25, high=50, xhigh=75, max=100, default=50)
    assert effort(25) in encode_messages([user("x")], reasoning_effort="low", effort_table=table)
    assert effort(50) in encode_messages([user("x")], effort_table=table)
    with pytest.raises(ValueError, match="EffortTable.low"):
        EffortTable(low=0)


def test_multi_turn_reasoning_dropped():
    msgs = [user("a"), {"role": "assistant", "reasoning_content": "r1", "content": "b"}, user("c")]
    want = BOS + E75 + USR + "a" + AST + "</think>" + "b" + EOS + USR + "c" + AST + "<think>"
    assert encode_messages(msgs) == want
    keep = BOS + E75 + USR + "a" + AST + "<think>" + "r1</think>b" + EOS
    keep += USR + "c" + AST + "<think>"
    assert encode_messages(msgs, drop_thinking=False) == keep
    chat = BOS + USR + "a" + AST + "</think>" + "b" + EOS + USR + "c" + AST + "</think>"
    assert encode_messages(msgs, reasoning_effort="none") == chat


def test_developer_dropped_before_last_user_in_thinking_mode():
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "developer", "content": "D"},
        user("a"),
        {"role": "assistant", "content": "b"},
        {"role": "developer", "content": "D2"},
        user("c"),
    ]
    want = BOS + E75 + "S" + USR + "a" + AST + "</think>b" + EOS + USR + "c" + AST + "<think>"
    assert encode_messages(msgs) == want
    chat = BOS + SYS + "S" + USR + "D" + USR + "a" + AST + "</think>b" + EOS
    chat += USR + "D2" + USR + "c" + AST + "</think>"
    assert encode_messages(msgs, reasoning_effort="none") == chat


def test_tools_calls_and_results_reordered():
    msgs = [
        {"role": "system", "content": "S"},
        user("q"),
        {
            "role": "assistant",
            "reasoning_content": "r",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"city": "Paris", "days": 3}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "g", "arguments": {"flag": True, "obj": {"a": [1, 2]}}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "R2"},
        {"role": "tool", "tool_call_id": "c1", "content": "R1"},
        {"role": "assistant", "reasoning_content": "r2", "content": "done"},
        user("thanks"),
    ]
    schemas = json.dumps(WEATHER["function"], ensure_ascii=False)
    calls = (
        "\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="g">\n'
        '<｜DSML｜ parameter name="flag" string="false">true</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="obj" string="false">{"a": [1, 2]}</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls>"
    )
    # tools present -> drop_thinking is forced off: the first turn keeps its reasoning.
    want = (
        BOS
        + E75
        + "S\n\n"
        + TOOLS_BLOCK.format(schemas=schemas)
        + USR
        + "q"
        + AST
        + "<think>"
        + "r</think>"
        + calls
        + EOS
        + USR
        + "<tool_result>R1</tool_result>\n\n<tool_result>R2</tool_result>"
        + AST
        + "<think>"
        + "r2</think>done"
        + EOS
        + USR
        + "thanks"
        + AST
        + "<think>"
    )
    assert encode_messages(msgs, tools=[WEATHER]) == want


def test_tools_without_system_insert_empty_system_first():
    schemas = json.dumps(WEATHER["function"], ensure_ascii=False)
    got = encode_messages([user("q")], tools=[WEATHER], reasoning_effort="none")
    assert got == BOS + SYS + "\n\n" + TOOLS_BLOCK.format(schemas=schemas) + USR + "q" + AST + (
        "</think>"
    )


def test_tool_results_merge_with_following_user_text():
    msgs = [
        user("q"),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "function": {"name": "f", "arguments": "{}"}},
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "b",
            "content": [{"type": "text", "text": "B1"}, {"type": "text", "text": "B2"}],
        },
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        user("more"),
    ]
    got = encode_messages(msgs, reasoning_effort="none")
    tail = USR + "<tool_result>A</tool_result>\n\n<tool_result>B1\n\nB2</tool_result>\n\nmore"
    assert got.endswith(EOS + tail + AST + "</think>")
    empty_invoke = '<｜DSML｜ invoke name="f">\n\n</｜DSML｜ invoke>'
    assert empty_invoke + "\n" + empty_invoke in got


def test_response_format():
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    block = (
        "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        '{"type": "object"}'
    )
    got = encode_messages([{"role": "system", "content": "S"}, user("Hi")], response_format=rf)
    assert got == BOS + E75 + "S" + block + USR + "Hi" + AST + "<think>"
    got = encode_messages([user("Hi")], response_format={"type": "json_object"})
    assert got == BOS + E75 + USR + "Hi" + AST + "<think>"
    got = encode_messages([user("Hi")], response_format={"a": "é"}, reasoning_effort="none")
    assert got == BOS + SYS + RESPONSE_PREFIX + '{"a": "é"}' + USR + "Hi" + AST + "</think>"


RESPONSE_PREFIX = (
    "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


def test_mid_conversation_system_counts_as_user():
    msgs = [user("a"), {"role": "assistant", "content": "b"}, {"role": "system", "content": "S2"}]
    want = BOS + E75 + USR + "a" + AST + "</think>b" + EOS + SYS + "S2" + AST + "<think>"
    assert encode_messages(msgs) == want


def test_latest_reminder_and_tasks():
    got = encode_messages([user("a"), {"role": "latest_reminder", "content": "R"}])
    assert got == BOS + E75 + USR + "a" + AST + "<think>" + "<｜latest_reminder｜>R"
    assert encode_messages([user("q", task="query")], reasoning_effort="none") == (
        BOS + USR + "q<｜query｜>"
    )
    assert encode_messages([user("q", task="action")]) == (
        BOS + E75 + USR + "q" + AST + "<think><｜action｜>"
    )
    msgs = [user("q", task="title"), {"role": "assistant", "content": "T"}, user("n")]
    want = BOS + E75 + USR + "q<｜title｜>" + "T" + EOS + USR + "n" + AST + "<think>"
    assert encode_messages(msgs, drop_thinking=False) == want
    with pytest.raises(ValueError, match=r"messages\[0\]\.task"):
        encode_messages([user("q", task="summarize")])


def test_generation_prompt_continuation_and_context():
    assert encode_messages([user("a")], add_generation_prompt=False) == BOS + E75 + USR + "a"
    part = [user("a"), {"role": "assistant", "content": "Par"}]
    got = encode_messages(part, continue_final_message=True)
    assert got == BOS + E75 + USR + "a" + AST + "<think></think>Par"
    part = [user("a"), {"role": "assistant", "reasoning_content": "let me"}]
    assert encode_messages(part, continue_final_message=True).endswith(AST + "<think>let me")
    with pytest.raises(ValueError, match="continue_final_message"):
        encode_messages([user("a")], continue_final_message=True)
    ctx = [user("a"), {"role": "assistant", "content": "b"}]
    new = [user("c")]
    suffix = encode_messages(new, context=ctx, drop_thinking=False)
    assert suffix == USR + "c" + AST + "<think>"
    whole = encode_messages(ctx + new, drop_thinking=False)
    assert whole == encode_messages(ctx, drop_thinking=False) + suffix


def test_images():
    content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u"}}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: image"):
        encode_messages([user(content)])
    got = encode_messages([user(content)], allow_images=True, reasoning_effort="none")
    assert got == BOS + USR + "look\n\n<｜deepseek_image｜>" + AST + "</think>"
    with pytest.raises(ValueError, match="deepseek_image"):
        encode_messages([user("<｜deepseek_image｜>")])


def _texts(max_size: int):
    """Any text but the image placeholder, which message text rejects by design (images come as
    blocks; test_images)."""
    return st.text(max_size=max_size).filter(lambda s: IMAGE_PLACEHOLDER not in s)


@settings(max_examples=60, deadline=None)
@given(
    turns=st.lists(
        st.tuples(_texts(20), _texts(20), _texts(10)),
        min_size=1,
        max_size=3,
    ),
    last=_texts(20),
    chat=st.booleans(),
)
def test_property_structure(turns, last, chat):
    """For any text: BOS first, one user token per turn, and the turn texts appear in order."""
    msgs: list[dict] = []
    for u, a, r in turns:
        msgs += [user(u), {"role": "assistant", "content": a, "reasoning_content": r}]
    msgs.append(user(last))
    got = encode_messages(msgs, reasoning_effort="none" if chat else None)
    assert got.startswith(BOS)
    assert got.endswith(USR + last + AST + ("</think>" if chat else "<think>"))
    pos = 0
    for u, a, _ in turns:
        seg = USR + u + AST + "</think>" + a + EOS
        found = got.find(seg, pos)
        assert found >= pos
        pos = found + len(seg)
