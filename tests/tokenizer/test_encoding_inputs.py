"""Chat encoding inputs: message validation errors name the message index and field; DSML
tool-call rendering of unicode and nested arguments."""

from __future__ import annotations

import pytest

from shoal.tokenizer.encoding import encode_messages
from shoal.tokenizer.render import render_dsml_tool_calls
from support.chat import WEATHER, user


@pytest.mark.parametrize(
    "msgs, field",
    [
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role"),
        ([user("a"), {"role": "developer", "content": ""}], r"messages\[1\]\.content"),
        (
            [
                user("a"),
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}],
                },
            ],
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments",
        ),
        (
            [
                user("a"),
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                },
            ],
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments",
        ),
        (
            [user("a"), {"role": "assistant", "tool_calls": [{"function": {}}]}],
            r"messages\[1\]\.tool_calls\[0\]\.function\.name",
        ),
        ([user(5)], r"messages\[0\]\.content"),
        ([user([{"type": "audio"}])], r"messages\[0\]\.content\[0\]"),
        (["hello"], r"messages\[0\]"),
        ([{"role": "user", "content": "a", "tools": [WEATHER]}], r"messages\[0\]\.tools"),
    ],
)
def test_validation_errors_name_index_and_field(msgs, field):
    with pytest.raises(ValueError, match=field):
        encode_messages(msgs)


def test_render_dsml_tool_calls_unicode_and_nested():
    got = render_dsml_tool_calls([("f", {"s": "héllo <b>", "n": None, "l": [1, {"k": "v"}]})])
    assert got == (
        '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="s" string="true">héllo <b></｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="n" string="false">null</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="l" string="false">[1, {"k": "v"}]</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )
