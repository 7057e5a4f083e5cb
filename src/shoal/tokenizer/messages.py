"""Validation and normalisation of OpenAI-style chat messages before rendering.

Owns the accepted message shapes (roles, content strings or blocks, tool calls with JSON-string
or dict arguments, tools, tasks). Invariant: every rejection is a ValueError naming the offending
``messages[i].field``; accepted messages come out as plain dicts the encoder can render.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from shoal.tokenizer.special import IMAGE_PLACEHOLDER, TASK_TOKENS

_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
_IMAGE_TYPES = ("image", "image_url", "input_image", "image_pil")


def _content_parts(value: Any, where: str, allow_images: bool) -> list[str]:
    """Text parts of a ``content`` value (str, None or a list of OpenAI content blocks)."""
    if value is None:
        return [""]
    if isinstance(value, str):
        if IMAGE_PLACEHOLDER in value:
            raise ValueError(f"{where}: contains {IMAGE_PLACEHOLDER!r}; send images as blocks")
        return [value]
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a string, null or a list of content blocks")
    parts = []
    for j, block in enumerate(value):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.extend(_content_parts(block["text"], f"{where}[{j}].text", allow_images))
        elif kind in _IMAGE_TYPES:
            if not allow_images:
                raise ValueError(f"{where}[{j}]: image blocks are not supported (text-only model)")
            parts.append(IMAGE_PLACEHOLDER)
        else:
            raise ValueError(f"{where}[{j}]: expected a text or image block, got type {kind!r}")
    return parts


def _normalize_tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.function.name: required string")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}.function.arguments: invalid JSON ({err})") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"{where}.function.arguments: expected a JSON object")
    call_id = call.get("id") or function.get("id") or ""
    return {"id": call_id, "function": {"name": function["name"], "arguments": dict(arguments)}}


def check_tools(tools: Any, where: str) -> list[Any]:
    """Validate an OpenAI tool list: each item's ``function`` an object with a string ``name``
    and, if given, ``parameters`` a JSON-schema object whose ``properties`` map names to
    objects and whose ``required`` lists strings."""
    if not isinstance(tools, list):
        raise ValueError(f"{where}: expected a list of tools")
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}[{j}].function.name: required string")
        params = fn.get("parameters")
        at = f"{where}[{j}].function.parameters"
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise ValueError(f"{at}: expected a JSON schema object")
        props = params.get("properties", {})
        if not isinstance(props, Mapping) or not all(isinstance(v, Mapping)
                                                     for v in props.values()):
            raise ValueError(f"{at}.properties: expected an object of schema objects")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"{at}.required: expected a list of property names")
    return list(tools)


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], *, allow_images: bool = False, name: str = "messages"
) -> list[dict[str, Any]]:
    """Validate OpenAI-style messages and convert them to the internal form (new dicts).

    user: ``blocks`` (text blocks); others: ``content`` string; assistant ``tool_calls`` have
    dict arguments and an ``id``; ``reasoning`` is accepted as an alias of
    ``reasoning_content``. Errors are ValueError naming ``messages[i].field``.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"{name}: expected a list of message objects")
    result = []
    for i, msg in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where}: expected an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}.role: {role!r} is not one of {list(_ROLES)}")
        out: dict[str, Any] = {"role": role}
        parts = _content_parts(msg.get("content"), f"{where}.content", allow_images)
        if role == "user":
            out["blocks"] = [{"type": "text", "text": p} for p in parts]
        else:
            out["content"] = "\n\n".join(parts)
        if role == "developer" and not out["content"]:
            raise ValueError(f"{where}.content: a developer message needs non-empty content")
        if role == "tool":
            out["tool_call_id"] = str(msg.get("tool_call_id") or "")
        if role == "assistant":
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}.reasoning_content: expected a string")
            if reasoning and IMAGE_PLACEHOLDER in reasoning:
                raise ValueError(f"{where}.reasoning_content: contains {IMAGE_PLACEHOLDER!r}")
            out["reasoning_content"] = reasoning
            calls = msg.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"{where}.tool_calls: expected a list")
            out["tool_calls"] = [
                _normalize_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
            ]
            out["wo_eos"] = bool(msg.get("wo_eos", False))
        if msg.get("tools"):
            if role not in ("system", "developer"):
                raise ValueError(f"{where}.tools: only system or developer messages carry tools")
            out["tools"] = check_tools(msg["tools"], f"{where}.tools")
        if msg.get("response_format") is not None:
            out["response_format"] = msg["response_format"]
        task = msg.get("task")
        if task is not None:
            if task not in TASK_TOKENS:
                raise ValueError(f"{where}.task: {task!r} is not one of {sorted(TASK_TOKENS)}")
            out["task"] = task
        result.append(out)
    return result
