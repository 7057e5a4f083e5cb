"""The grammar of a forced tool call (`tool_choice` "required", or a named function): a DSML
calls block as `render_dsml_tool_calls` writes it, over the allowed tools, in the Lark dialect
of llguidance. Each parameter follows its tool's schema: the properties in schema order, the
required ones present, a string as raw text (`string="true"`, no `<` inside; one of an enum's
strings), anything else as compact JSON valid against the property's schema
(`string="false"`), as `render_dsml_parameters` writes them."""

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
)

NL = "\n"


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], name: str | None = None,
                      parallel: bool = True) -> str:
    """The grammar admitting one call (several when `parallel`) of the tools, or only of the
    tool `name`; ValueError when no tool qualifies."""
    functions = [t.get("function", {}) for t in tools if t.get("type", "function") == "function"]
    if name is not None:
        functions = [f for f in functions if f.get("name") == name]
        if not functions:
            raise ValueError(f"tool_choice: no function named {name!r} in tools")
    if not functions:
        raise ValueError("tool_choice: forcing a call needs at least one function in tools")
    rules, invokes = [], []
    close = _lit(PARAM_CLOSE + "\n")
    for i, function in enumerate(functions):
        parameters = function.get("parameters") or {}
        required = set(parameters.get("required", ()))
        lines = []
        for j, (param, schema) in enumerate((parameters.get("properties") or {}).items()):
            rule = f"p{i}_{j}"
            enum = schema.get("enum")
            if enum and all(isinstance(v, str) for v in enum):  # one of these strings
                head = _lit(f'<{DSML} parameter name="{param}" string="true">')
                rules.append(f"{rule}: {head} ({' | '.join(map(_lit, enum))}) {close}")
            elif schema.get("type") == "string":
                head = _lit(f'<{DSML} parameter name="{param}" string="true">')
                rules.append(f"{rule}: {head} TEXT {close}")
            else:
                head = _lit(f'<{DSML} parameter name="{param}" string="false">')
                compact = {**schema, "x-guidance": {"whitespace_flexible": False}}
                rules.append(f"{rule}: {head} {rule}_value {close}")
                rules.append(f"{rule}_value: %json {json.dumps(compact)}")
            lines.append(rule if param in required else rule + "?")
        opening = _lit(f'<{DSML} invoke name="{function["name"]}">\n')
        rules.append(f"invoke{i}: {opening} {' '.join(lines)} {_lit(INVOKE_CLOSE + NL)}")
        invokes.append(f"invoke{i}")
    # every literal ends its line, so that no literal is a prefix of another one that may
    # follow (llguidance's lexer does not take back a literal it has matched)
    return "\n".join([f"start: {_lit(NL + NL + CALLS_OPEN + NL)} invoke{'+' if parallel else ''}"
                       f" {_lit(CALLS_CLOSE)}",
                       "invoke: " + " | ".join(invokes), *rules, "TEXT: /[^<]*/"]) + "\n"
