"""The OpenAI request bodies (pydantic) and their translation into shoal's SamplingParams and
prompts; OpenAI-style error bodies. vLLM's extra fields (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, structured_outputs and the older guided_json /
guided_regex / guided_choice / guided_grammar, chat_template_kwargs) are accepted under the
same names.

Invariant: a body that validates here gives a SamplingParams or a ValueError naming the field;
nothing past this module sees an HTTP body.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shoal.engine.outputs import CompletionOutput, RequestOutput
from shoal.sampling import SamplingParams
from shoal.sampling.structured import StructuredOutputSpec
from shoal.tokenizer.encoding import template_kwargs_options
from shoal.tokenizer.messages import check_tools
from shoal.tokenizer.tool_grammar import tool_call_grammar


def finish_reason(reason: str | None, tool_calls: bool = False) -> str | None:
    """OpenAI's finish reason: out of room (max_tokens, the context, the KV pool) is `length`,
    even inside a tool call (as vLLM: a cut call is not a call); a stream the server cut
    (shutdown, an engine failure) `abort` and a sequence that failed mid-way `error` (as
    vLLM; its stream then ends with an error event); a parsed tool call `tool_calls`; anything
    else `stop`."""
    if reason is None:
        return None
    if reason in ("abort", "error"):
        return reason
    if reason in ("length", "kv_capacity"):
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage_of(*outs: RequestOutput) -> dict:
    """OpenAI's `usage` of finished requests (one per prompt)."""
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(len(c.token_ids) for out in outs for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def assistant_message(c: CompletionOutput) -> dict[str, Any]:
    """The chat `message` of a parsed completion (content, reasoning, tool calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": c.content}
    if c.reasoning_content is not None:
        message["reasoning_content"] = c.reasoning_content
    if c.tool_calls:
        message["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": t.get("name"), "arguments": t.get("arguments") or "{}"}}
            for t in c.tool_calls]
    return message


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its form since v0.12, which dropped `guided_*`): one of
    json (a schema), regex, choice, grammar, json_object; `disable_any_whitespace` makes a
    JSON output compact. vLLM's other options are refused by name."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool | None = None  # (one backend: nothing to fall back from)

    def spec(self) -> StructuredOutputSpec | None:
        if self.model_extra:
            name = sorted(self.model_extra)[0]
            raise ValueError(f"structured_outputs.{name}: not supported (json, regex, choice, "
                             "grammar, json_object and disable_any_whitespace are)")
        given = {k: v for k, v in (("json", self.json_), ("regex", self.regex),
                                   ("choice", self.choice), ("grammar", self.grammar),
                                   ("json_object", self.json_object or None)) if v is not None}
        if len(given) > 1:
            raise ValueError(f"structured_outputs: got {sorted(given)}, expected one of them")
        if "json" in given or "json_object" in given:
            schema = given.get("json", {"type": "object"})
            if self.disable_any_whitespace:
                schema = json.loads(schema) if isinstance(schema, str) else dict(schema)
                schema["x-guidance"] = {**schema.get("x-guidance", {}),
                                        "whitespace_flexible": False}
            return StructuredOutputSpec(json_schema=schema)
        return StructuredOutputSpec(**given) if given else None


class SamplingBody(BaseModel):
    # unknown fields are kept aside and ignored, with a warning (as vLLM: OpenAI clients send
    # fields such as store, metadata or service_tier that mean nothing here)
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    priority: int = 0  # scheduling_policy='priority': lower runs sooner

    def ignored_fields(self) -> list[str]:
        """The body's fields this server does not know (ignored)."""
        return sorted(self.model_extra or ())

    def sampling_fields(self) -> dict[str, Any]:
        names = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                 "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                 "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
                 "logit_bias", "allowed_token_ids", "truncate_prompt_tokens", "bad_words")
        fields = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        guided = {k: v for k, v in (("json_schema", self.guided_json),
                                    ("regex", self.guided_regex),
                                    ("choice", self.guided_choice),
                                    ("grammar", self.guided_grammar)) if v is not None}
        if len(guided) > 1:
            raise ValueError(f"guided_*: got {sorted(guided)}, expected at most one")
        if guided:
            fields["structured"] = StructuredOutputSpec(**guided)
        if self.structured_outputs is not None and (spec := self.structured_outputs.spec()):
            if guided:
                raise ValueError("structured_outputs and guided_*: give one of them")
            fields["structured"] = spec
        return fields


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: continue the final assistant message (a prefix) instead of starting a new turn
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return None if tools is None else check_tools(tools, "tools")

    def params(self) -> SamplingParams:
        """Without max_tokens / max_completion_tokens a chat answer runs until it ends or the
        context is full (OpenAI's and vLLM's default)."""
        fields = self.sampling_fields()
        fields["max_tokens"] = self.max_completion_tokens or self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        forced = self.forced_tool()
        if forced is not None:
            if "structured" in fields or self.response_format is not None:
                raise ValueError("tool_choice: a forced call takes no response_format, "
                                 "structured_outputs or guided_*")
            fields["structured"] = StructuredOutputSpec(grammar=tool_call_grammar(
                self.tools or (), None if forced is True else forced,
                self.parallel_tool_calls is not False))
        if self.response_format is not None and self.response_format.type != "text":
            if "structured" in fields:
                raise ValueError("response_format and structured_outputs / guided_*: give one "
                                 "of them")
            fmt = self.response_format
            schema = {"type": "object"} if fmt.type == "json_object" else \
                (fmt.json_schema or {}).get("schema", {"type": "object"})
            fields["structured"] = StructuredOutputSpec(json_schema=schema)
        return SamplingParams(**fields)

    def forced_tool(self) -> str | bool | None:
        """`tool_choice` as a forced call: True ("required": any tool), a function's name
        ({"type": "function", "function": {"name": ...}}), or None (auto / none)."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        if choice == "required":
            return True
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
            choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            else None
        if not isinstance(name, str):
            raise ValueError(f"tool_choice: got {json.dumps(choice)}, expected 'auto', 'none', "
                             "'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")
        return name

    def encode_options(self) -> dict[str, Any]:
        """Keyword arguments of `encode_messages` (tools, reasoning, thinking)."""
        choice = self.tool_choice
        self.forced_tool()  # a bad tool_choice is a 400 here too
        options: dict[str, Any] = {}
        if self.tools and choice != "none":
            options["tools"] = self.tools
        if self.reasoning_effort is not None:
            options["reasoning_effort"] = self.reasoning_effort
        options.update(template_kwargs_options(self.chat_template_kwargs))
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message: add_generation_prompt must be false with it")
        if not self.add_generation_prompt:
            options["add_generation_prompt"] = False
        if self.continue_final_message:
            options["continue_final_message"] = True
        return options

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's and vLLM's default; null: no limit
    max_completion_tokens: int | None = Field(None, ge=1)  # (over max_tokens, as vLLM)

    def params(self) -> SamplingParams:
        """`echo` with `logprobs` asks for the prompt's log-probs too (the first token has
        none), as lm-eval-harness-style scoring does."""
        fields = self.sampling_fields()
        fields["max_tokens"] = self.max_completion_tokens or self.max_tokens
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
            if self.echo:
                fields["prompt_logprobs"] = self.logprobs
        return SamplingParams(**fields)

    def prompt_inputs(self) -> list[tuple[str | None, list[int] | None]]:
        """Per prompt: (text, None) or (None, token ids); a list of texts or of token-id
        lists is several prompts, as in OpenAI's API."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [(prompt, None)]
        if not prompt:
            raise ValueError("prompt: empty")
        if all(isinstance(t, str) for t in prompt):
            return [(text, None) for text in prompt]  # type: ignore[misc]
        if all(isinstance(t, list) for t in prompt):
            return [(None, list(ids)) for ids in prompt]  # type: ignore[arg-type]
        if all(isinstance(t, int) for t in prompt):
            return [(None, list(prompt))]  # type: ignore[arg-type]
        raise ValueError("prompt: expected a string, a list of strings, a list of token ids "
                         "or a list of such lists")


def chat_deltas(events, calls: dict[int, str]) -> list[dict]:
    """The chat stream's deltas of parser events (reasoning, content, tool-call starts and
    argument text); `calls` maps a call's index to the id given at its start."""
    deltas = []
    for e in events:
        if e.kind == "reasoning" and e.text:
            deltas.append({"reasoning_content": e.text})
        elif e.kind == "content" and e.text:
            deltas.append({"content": e.text})
        elif e.kind == "tool_call":
            calls[e.index] = f"call_{uuid.uuid4().hex[:24]}"
            deltas.append({"tool_calls": [{"index": e.index, "id": calls[e.index],
                                           "type": "function", "function": {
                                               "name": e.name, "arguments": ""}}]})
        elif e.kind == "tool_arguments" and e.text:
            deltas.append({"tool_calls": [{"index": e.index,
                                           "function": {"arguments": e.text}}]})
    return deltas
