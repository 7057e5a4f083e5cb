"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), as
vLLM serves it: a body's input items become chat messages (the chat endpoint's encoding,
sampling and output parsing), and a finished request becomes a `response` object whose output
items are its reasoning, its assistant message and its function calls. Streaming events are
made in responses_stream.py.

Supported: `input` (a string, or items: messages with text parts, `function_call`,
`function_call_output`, `reasoning`), `instructions` (a first system message; not carried to
the next turn, as OpenAI's), `previous_response_id` (a stored response's conversation goes
first), `max_output_tokens`, `temperature`, `top_p`, function `tools`, `tool_choice`,
`parallel_tool_calls`, `reasoning.effort` (V4.1's levels, or OpenAI's: `minimal` is `low`,
`medium` the default), `text.format` (`json_schema`, `json_object`), `store` (responses kept
in memory, the last STORED_RESPONSES, least recently used out first), `metadata`, log-probs
(`include: ["message.output_text.logprobs"]` or `top_logprobs`: the message text's tokens,
content_tokens.py), and vLLM's sampling extras. What is not served (images, files, built-in
tools, `background`) is a 400 naming the field; other `include` values and unknown fields are
ignored, as on the other endpoints.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shoal.engine.outputs import CompletionOutput, RequestOutput
from shoal.serve.content_tokens import content_entries
from shoal.serve.logprobs import LogprobFormat
from shoal.serve.protocol import ChatCompletionRequest, SamplingBody, usage_of
from shoal.tokenizer.special import THINK_END

STORED_RESPONSES = 1024
# OpenAI's effort names without a V4.1 level of their own (None: the model's default)
EFFORTS = {"minimal": "low", "medium": None}
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="allow")  # (summary: no summaries are made)

    effort: str | int | None = None


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # (verbosity)

    format: TextFormat | None = None


class ResponsesRequest(SamplingBody):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    background: bool = False
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    def input_messages(self) -> list[dict[str, Any]]:
        return item_messages(self.input, "input")

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this body asks for, after the conversation `history`."""
        if self.n != 1:
            raise ValueError("n: a response has one output")
        if self.background:
            raise ValueError("background: not supported (stream the response, or wait for it)")
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        sampling = self.model_dump(exclude_unset=True, include=set(SamplingBody.model_fields)
                                   - {"stream", "stream_options"})
        effort = self.reasoning.effort if self.reasoning is not None else None
        effort = EFFORTS.get(effort, effort) if isinstance(effort, str) else effort
        fmt = self.text.format if self.text is not None else None
        response_format = None
        if fmt is not None and fmt.type == "json_schema":
            response_format = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "output", "schema": fmt.schema_ or {"type": "object"}}}
        elif fmt is not None and fmt.type == "json_object":
            response_format = {"type": "json_object"}
        given = {"max_completion_tokens": self.max_output_tokens,
                 "tools": chat_tools(self.tools), "tool_choice": chat_tool_choice(self.tool_choice),
                 "parallel_tool_calls": self.parallel_tool_calls, "reasoning_effort": effort,
                 "response_format": response_format,
                 "logprobs": True if self.wants_logprobs else None,
                 "top_logprobs": (self.top_logprobs or 0) if self.wants_logprobs else None}
        # (only what the body gives: the request's fields_set is the body's)
        return ChatCompletionRequest(**sampling, messages=system + history + self.input_messages(),
                                     **{k: v for k, v in given.items() if v is not None})


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: expected a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}]: {kind!r} parts are not supported (text only)")
        texts.append(part["text"])
    return "".join(texts)


def item_messages(items: str | list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Input (or output) items as chat messages: consecutive function calls are one assistant
    turn's tool calls (after its message, if any), a reasoning item goes with the assistant
    turn that follows it, or is a turn of its own when none does."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning, prev = None, None
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        kind = item.get("type", "message")
        role = item.get("role") if kind == "message" else None
        if reasoning is not None and kind not in ("function_call", "reasoning") and \
                role != "assistant":  # a turn of reasoning alone (cut, or ended in it)
            messages.append(_reasoning_turn(reasoning))
            reasoning = None
        if kind == "message":
            msg = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ValueError(f"{where}: a function_call needs call_id, name and arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if prev in ("message", "function_call") and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}.call_id: required string")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output", ""), f"{where}.output")})
        else:
            raise ValueError(f"{where}.type: {kind!r} is not supported (message, reasoning, "
                             "function_call, function_call_output)")
        prev = kind
    if reasoning is not None:
        messages.append(_reasoning_turn(reasoning))
    return messages


def _reasoning_turn(reasoning: str) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "reasoning_content": reasoning}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({type, name, description, parameters}) as chat tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ValueError(f"tools[{i}].type: {tool.get('type')!r}: only function tools are "
                             "served")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ValueError("tool_choice: expected 'auto', 'none', 'required' or "
                             "{\"type\": \"function\", \"name\": ...}")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str, item_id: str | None = None,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant",
            "status": status, "content": [{"type": "output_text", "text": text,
                                           "annotations": [], "logprobs": logprobs or []}]}


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def call_item(name: str, arguments: str, status: str, item_id: str | None = None,
              call_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("fc"), "type": "function_call",
            "call_id": call_id or f"call_{uuid.uuid4().hex[:24]}", "name": name,
            "arguments": arguments, "status": status}


def output_items(c: CompletionOutput,
                 logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A parsed completion's output items: its reasoning, its message (with its tokens'
    `logprobs`) and its calls, those that have text (at least one item); a text or a call cut
    by the token limit is `incomplete`."""
    items = [reasoning_item(c.reasoning_content, "completed")] if c.reasoning_content else []
    if c.content or not (items or c.tool_calls):  # (an empty answer: one empty message)
        items.append(message_item(c.content or "", "completed", logprobs=logprobs))
    items += [call_item(t.get("name") or "", t.get("arguments") or "{}", "completed")
              for t in c.tool_calls or ()]
    if finish_status(c.finish_reason) == "incomplete" and (
            items[-1]["type"] != "function_call" or c.tool_call_cut):
        items[-1]["status"] = "incomplete"  # the text or the call that was cut
    return items


def finish_status(reason: str | None) -> str:
    """A response's status by its finish reason: out of room is `incomplete`."""
    return "incomplete" if reason in ("length", "kv_capacity") else "completed"


def usage(out: RequestOutput, tokenizer) -> dict[str, Any]:
    """The Responses `usage` of a parsed output (`parse_chat_output`): reasoning tokens are
    those up to and including `</think>` (all of them when the reasoning never closed)."""
    u, c = usage_of(out), out.outputs[0]
    reasoning = 0
    if c.reasoning_content is not None:
        ids, think_end = list(c.token_ids), tokenizer.token_to_id(THINK_END)
        reasoning = ids.index(think_end) + 1 if think_end in ids else len(ids)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": u["total_tokens"]}


def response_body(rid: str, created: int, model: str, body: ResponsesRequest,
                  items: list[dict[str, Any]], status: str,
                  token_usage: dict[str, Any] | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `response` object (status `in_progress`, `completed`, `incomplete` or `failed`)."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "model": model, "output": items, "usage": token_usage, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature, "top_p": body.top_p,
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                 if fmt is not None else {"type": "text"}},
        "metadata": body.metadata or {}, "store": body.store, "user": body.user}


def finished_response(rid: str, created: int, model: str, body: ResponsesRequest,
                      out: RequestOutput, tokenizer) -> dict[str, Any]:
    """The whole `response` of a finished, parsed output (the server's and run-batch's)."""
    c = out.outputs[0]
    logprobs = None
    if body.wants_logprobs and c.logprobs:
        entries = content_entries(c.token_ids, c.logprobs, tokenizer,
                                  thinking=c.reasoning_content is not None)
        logprobs = LogprobFormat(tokenizer).chat(entries, body.top_logprobs or 0)["content"]
    return response_body(rid, created, model, body, output_items(c, logprobs),
                         finish_status(c.finish_reason), usage(out, tokenizer))


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, the response's output included


class ResponseStore:
    """Stored responses by id, the last `capacity` (least recently used out first)."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, response: dict[str, Any],
            conversation: list[dict[str, Any]]) -> None:
        self._items[rid] = Stored(response, conversation)
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        stored = self._items.get(rid)
        if stored is not None:
            self._items.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None
