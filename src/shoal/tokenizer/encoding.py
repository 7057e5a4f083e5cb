"""DeepSeek-V4.1 chat encoding: OpenAI-style messages -> prompt text (model.md §8).

Owns the exact prompt format of the official V4.1 encoder (tool prompt, DSML tool calls, effort
line, drop-thinking rules, tool-result merging and ordering, transitions). Pure functions only.

Invariant: for any accepted input the output is byte-identical to the release reference encoder
(``encoding/encoding.py``, ported as SGLang ``encoding_dsv41.py`` / vLLM
``deepseek_v41_encoding.py``), except for two documented decisions: the effort alias table is the
release one (configurable, :class:`EffortTable`), and images are an error unless asked for.

Example (thinking mode, default effort 75), ``[{"role": "user", "content": "Hi"}]`` renders as::

    <｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value,
    the more thorough the reasoning)\n\n<｜User｜>Hi<｜Assistant｜><think>

(one line; ``\n\n`` are two newlines). Chat mode (``reasoning_effort="none"``)::

    <｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.tokenizer.messages import check_tools, normalize_messages
from shoal.tokenizer.render import (
    render_dsml_tool_calls,
    render_response_format,
    render_tools,
)
from shoal.tokenizer.special import (
    ASSISTANT_TOKEN,
    BOS,
    EOS,
    LATEST_REMINDER_TOKEN,
    SYSTEM_TOKEN,
    TASK_TOKENS,
    THINK_END,
    THINK_START,
    USER_TOKEN,
)

EFFORT_LINE = (
    "Reasoning Effort: {budget} "
    "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
@dataclass(frozen=True)
class EffortTable:
    """Reasoning-effort aliases -> the integer budget written in the effort line.

    Defaults are the release checkpoint's table (model.md §8, open question 14); the pre-release
    SGLang snapshot used low 25 / high 50 / xhigh 75 / max 100 with default "high" (= 50).
    """

    low: int = 50
    high: int = 75
    xhigh: int = 75
    max: int = 100
    default: int = 75

    def __post_init__(self) -> None:
        for name in ("low", "high", "xhigh", "max", "default"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= 100:
                raise ValueError(f"EffortTable.{name}={value!r}: expected an int in [1, 100]")

    def resolve(self, effort: str | int | None) -> int:
        """Map ``None`` / an alias / an int in [1, 100] to the budget; ValueError otherwise."""
        if effort is None:
            return self.default
        if type(effort) is int and 1 <= effort <= 100:
            return effort
        if isinstance(effort, str) and effort in ("low", "high", "xhigh", "max"):
            return int(getattr(self, effort))
        raise ValueError(
            f"reasoning_effort={effort!r}: expected 'none', 'low', 'high', 'xhigh', 'max' "
            "or an integer in [1, 100]"
        )


RELEASE_EFFORT_TABLE = EffortTable()


def _is_user_like(messages: Sequence[Mapping[str, Any]], index: int) -> bool:
    role = messages[index].get("role")
    return role in ("user", "developer") or (role == "system" and index > 0)


def last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    """Index of the last user or developer message, or system message at index > 0; else -1."""
    for index in range(len(messages) - 1, -1, -1):
        if _is_user_like(messages, index):
            return index
    return -1


def _merge_tool_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn tool messages into ``tool_result`` blocks of user turns; merge successive users."""
    merged: list[dict[str, Any]] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg["role"]
        prev_user = bool(merged) and merged[-1]["role"] == "user" and "blocks" in merged[-1]
        if role == "tool":
            block = {
                "type": "tool_result",
                "id": msg.get("tool_call_id", ""),
                "text": msg["content"],
            }
            if prev_user:
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            blocks = msg.pop("blocks")
            if prev_user and merged[-1].get("task") is None:
                merged[-1]["blocks"].extend(blocks)
            else:
                msg["blocks"] = blocks
                merged.append(msg)
        else:
            merged.append(msg)
    return merged


def _sort_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reorder each user turn's tool results into the preceding assistant's call order.

    Unknown ids sort as position 0 (stable), as in the reference; other blocks keep their slots.
    """
    order: dict[str, int] = {}
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            order = {tc["id"]: i for i, tc in enumerate(msg["tool_calls"]) if tc.get("id")}
        elif msg["role"] == "user" and msg.get("blocks"):
            results = [b for b in msg["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                ordered = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))
                msg["blocks"] = [
                    next(ordered) if b["type"] == "tool_result" else b for b in msg["blocks"]
                ]
    return messages


def _drop_thinking(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before the last user-like message: strip assistant reasoning, drop developer messages."""
    last = last_user_index(messages)
    kept = []
    for index, msg in enumerate(messages):
        role = msg["role"]
        if role in ("user", "system", "tool", "latest_reminder") or index >= last:
            kept.append(msg)
        elif role == "assistant":
            kept.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return kept


def _render_user_blocks(blocks: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for block in blocks:
        if block["type"] == "tool_result":
            parts.append(f"<tool_result>{block['text']}</tool_result>")
        else:
            parts.append(block["text"])
    return "\n\n".join(parts)


def _render_message(
    index: int,
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool,
    drop_thinking: bool,
    effort: int,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> str:
    msg = messages[index]
    role = msg["role"]
    content = msg.get("content") or ""
    is_last = index == len(messages) - 1
    last_user = last_user_index(messages)

    effort_line = EFFORT_LINE.format(budget=effort) if index == 0 and thinking else ""
    prompt = SYSTEM_TOKEN if index == 0 and (effort_line or role == "system") else ""
    prompt += effort_line

    if role in ("system", "developer"):
        if role == "system":
            prompt += (SYSTEM_TOKEN if index > 0 else "") + content
        else:
            prompt += USER_TOKEN + content
        if msg.get("tools"):
            prompt += "\n\n" + render_tools([t["function"] for t in msg["tools"]])
        if msg.get("response_format"):
            prompt += "\n\n" + render_response_format(msg["response_format"])
    elif role == "user":
        prompt += USER_TOKEN + _render_user_blocks(msg["blocks"])
    elif role == "latest_reminder":
        prompt += LATEST_REMINDER_TOKEN + content
    elif role == "assistant":
        calls = msg.get("tool_calls") or []
        tool_text = (
            render_dsml_tool_calls(
                [(tc["function"]["name"], tc["function"]["arguments"]) for tc in calls]
            )
            if calls
            else ""
        )
        reasoning = msg.get("reasoning_content") or ""
        prev_has_task = index > 0 and messages[index - 1].get("task") is not None
        thinking_part = ""
        if thinking and not prev_has_task and (not drop_thinking or index > last_user):
            thinking_part = reasoning + THINK_END
            if is_last and continue_final_message and reasoning and not content and not calls:
                thinking_part = reasoning  # continue inside the open reasoning
        prompt += thinking_part + content + tool_text
        if not (msg.get("wo_eos") or (is_last and continue_final_message)):
            prompt += EOS
    else:  # pragma: no cover - normalize_messages rejects other roles
        raise AssertionError(role)

    if is_last and not add_generation_prompt:
        return prompt
    if not is_last and messages[index + 1]["role"] not in ("assistant", "latest_reminder"):
        return prompt
    task = msg.get("task")
    if task is not None:
        if task == "action":
            prompt += ASSISTANT_TOKEN + (THINK_START if thinking else THINK_END)
        prompt += TASK_TOKENS[task]
    elif _is_user_like(messages, index):
        open_thinking = thinking and (not drop_thinking or index >= last_user)
        prompt += ASSISTANT_TOKEN + (THINK_START if open_thinking else THINK_END)
    return prompt


def _attach(messages: list[dict[str, Any]], key: str, value: Any) -> None:
    """Put ``key`` on the first system message, inserting an empty one at index 0 if none."""
    for msg in messages:
        if msg["role"] == "system":
            msg[key] = value
            return
    messages.insert(0, {"role": "system", "content": "", key: value})


def response_format_schema(response_format: Any) -> Any:
    """What the prompt shows for an OpenAI ``response_format``; ``None`` means nothing.

    ``{"type": "json_schema", "json_schema": {"schema": S}}`` -> ``S``; ``{"type": "text"}`` and
    ``{"type": "json_object"}`` -> ``None``; any other object is shown as given.
    """
    if isinstance(response_format, Mapping) and "type" in response_format:
        kind = response_format["type"]
        if kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, Mapping) or "schema" not in inner:
                raise ValueError("response_format.json_schema.schema is required")
            return inner["schema"]
        if kind in ("text", "json_object"):
            return None
    return response_format


def template_kwargs_options(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs` as `encode_messages` options: `enable_thinking` (or
    `thinking`) -> `thinking`; ValueError for any other key (this encoding has no other)."""
    kwargs = kwargs or {}
    unknown = sorted(set(kwargs) - {"enable_thinking", "thinking"})
    if unknown:
        raise ValueError(f"chat_template_kwargs: unsupported key(s) {unknown}")
    thinking = kwargs.get("enable_thinking", kwargs.get("thinking"))
    return {} if thinking is None else {"thinking": bool(thinking)}


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str | int | None = None,
    thinking: bool | None = None,
    drop_thinking: bool = True,
    response_format: Any = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    context: Sequence[Mapping[str, Any]] | None = None,
    effort_table: EffortTable = RELEASE_EFFORT_TABLE,
    allow_images: bool = False,
) -> str:
    """Render OpenAI-style chat messages as a DeepSeek-V4.1 prompt string.

    Args:
        messages: dicts with ``role`` in system / developer / user / assistant / tool /
            latest_reminder (see :func:`normalize_messages`).
        tools: OpenAI tool list; attached to the first system message (an empty one is inserted
            at index 0 if there is none), like ``tools`` on a system message.
        reasoning_effort: ``"none"`` (chat mode), ``"low" | "high" | "xhigh" | "max"``, an int in
            [1, 100], or None (table default). Resolved through ``effort_table``.
        thinking: force thinking mode on/off; None means on unless ``reasoning_effort="none"``.
        drop_thinking: drop earlier turns' reasoning (forced off when any message has tools).
        response_format: schema (or OpenAI ``response_format``) shown to the model, attached to
            the first system message. It does not constrain decoding (see sampling/structured).
        add_generation_prompt: append ``<｜Assistant｜><think>`` (or ``</think>``) after a final
            user-like message; if False the last message gets no transition.
        continue_final_message: the final assistant message is a prefix to continue: no EOS and
            no generation prompt (reasoning-only: no ``</think>`` either).
        context: messages already in the KV cache (rendered earlier). Only ``messages`` are
            rendered, without BOS, with indices continuing after the context.
        effort_table: alias table (release values by default).
        allow_images: render image blocks as ``<｜deepseek_image｜>``; otherwise ValueError.

    Returns:
        the prompt text; starts with BOS unless ``context`` is given.

    Raises:
        ValueError: naming ``messages[i].field`` (or the argument) for invalid input.

    Multi-turn with thinking (reasoning of earlier turns dropped)::

        [user "a", assistant(reasoning "r", content "b"), user "c"] ->
        BOS + "<｜System｜>Reasoning Effort: 75 (...)\\n\\n<｜User｜>a<｜Assistant｜></think>b"
        + EOS + "<｜User｜>c<｜Assistant｜><think>"
    """
    if reasoning_effort == "none":
        if thinking:
            raise ValueError("reasoning_effort='none' selects chat mode but thinking=True")
        thinking, effort = False, effort_table.default
    else:
        effort = effort_table.resolve(reasoning_effort)
        thinking = True if thinking is None else bool(thinking)

    ctx = normalize_messages(context or [], allow_images=allow_images, name="context")
    new = normalize_messages(messages, allow_images=allow_images, name="messages")
    if continue_final_message:
        if not new or new[-1]["role"] != "assistant":
            raise ValueError("continue_final_message=True requires a final assistant message")
        add_generation_prompt = False

    if tools is not None or response_format is not None:
        full = ctx + new
        if tools:
            _attach(full, "tools", check_tools(tools, "tools"))
        schema = response_format_schema(response_format)
        if schema is not None:
            _attach(full, "response_format", schema)
        inserted = len(full) - len(ctx) - len(new)
        n_ctx = len(ctx) + (inserted if ctx else 0)
        ctx, new = full[:n_ctx], full[n_ctx:]

    new = _merge_tool_messages(new)
    new = _sort_tool_results(ctx + new)[len(ctx) :]
    if ctx:
        ctx = _sort_tool_results(_merge_tool_messages(ctx))
    full = ctx + new
    prompt = "" if ctx else BOS

    effective_drop = drop_thinking and not any(m.get("tools") for m in full)
    if thinking and effective_drop:
        full = _drop_thinking(full)
        start = len(_drop_thinking(ctx))  # the reference's (quirky) context length
    else:
        start = len(ctx)
    for index in range(start, len(full)):
        prompt += _render_message(
            index,
            full,
            thinking=thinking,
            drop_thinking=effective_drop,
            effort=effort,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    return prompt
