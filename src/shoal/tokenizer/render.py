"""Text blocks of the V4.1 chat format (model.md §8): the ``## Tools`` prompt, the ``## Response
Format:`` block and DSML tool calls. Pure functions, shared by the encoder (encoding.py) and the
output parser (parser.py).

Invariant: byte-identical to the release reference encoder's rendering of the same blocks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from shoal.tokenizer.special import (
    CALLS_CLOSE,
    CALLS_OPEN,
    DSML,
    INVOKE_CLOSE,
    PARAM_CLOSE,
    THINK_END,
    THINK_START,
)

RESPONSE_FORMAT_PREFIX = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)

_TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    f'by writing a "{CALLS_OPEN}" block like the following:\n\n'
    f"{CALLS_OPEN}\n"
    f'<{DSML} invoke name="$TOOL_NAME">\n'
    f'<{DSML} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f'<{DSML} invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f"{CALLS_CLOSE}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
    f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_FOOTER = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)



def to_json(value: Any) -> str:
    """``json.dumps`` with default separators and ``ensure_ascii=False`` (ASCII on failure)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def render_tools(functions: Sequence[Mapping[str, Any]]) -> str:
    """The ``## Tools`` block for a list of *function* schemas (``tool["function"]``).

    Rendered text (abridged)::

        ## Tools

        You have access to a set of tools ... by writing a "<｜DSML｜ calls>" block like ...
        ...
        ### Available Tool Schemas

        {"name": "get_weather", "parameters": {...}}

        You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
    """
    return _TOOLS_HEADER + "\n".join(to_json(f) for f in functions) + _TOOLS_FOOTER


def render_response_format(schema: Any) -> str:
    """``## Response Format:`` block; the schema is serialised with :func:`to_json`."""
    return RESPONSE_FORMAT_PREFIX + to_json(schema)


def render_dsml_parameters(arguments: Mapping[str, Any]) -> str:
    """One DSML parameter line per argument, joined by ``\\n``.

    ``{"city": "Paris", "days": 3}`` renders as::

        <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
        <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    """
    lines = []
    for key, value in arguments.items():
        is_str = isinstance(value, str)
        text = value if is_str else to_json(value)
        flag = "true" if is_str else "false"
        lines.append(f'<{DSML} parameter name="{key}" string="{flag}">{text}{PARAM_CLOSE}')
    return "\n".join(lines)


def render_dsml_tool_calls(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The tool-call suffix of an assistant turn, for ``(name, arguments)`` pairs.

    One call ``("f", {"x": 1})`` renders as (note the leading blank line)::

        \\n\\n<｜DSML｜ calls>
        <｜DSML｜ invoke name="f">
        <｜DSML｜ parameter name="x" string="false">1</｜DSML｜ parameter>
        </｜DSML｜ invoke>
        </｜DSML｜ calls>
    """
    invokes = [
        f'<{DSML} invoke name="{name}">\n{render_dsml_parameters(args)}\n{INVOKE_CLOSE}'
        for name, args in calls
    ]
    return "\n\n" + CALLS_OPEN + "\n" + "\n".join(invokes) + "\n" + CALLS_CLOSE
