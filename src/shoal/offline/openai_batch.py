"""The OpenAI batch file format (`shoal run-batch`, as `vllm run-batch`): request lines
`{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" |
"/v1/responses", "body"}` in,
result lines `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`
out. A body is read by the server's request models (serve/protocol.py: the same fields,
defaults and checks as `shoal serve`) and answered with the server's response bodies
(serve/responses.py, serve/responses_api.py), so a line gives what the same request to the
server would (a Responses body without `previous_response_id`: a batch stores no responses).

Invariant: every request line gives exactly one result line; a bad line or a failed request
gives status 400, an error body (`{"error": {"message", "type", ...}}`) and the message as the
line's `error` (as vLLM), never an abort.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from shoal.engine.outputs import RequestOutput
from shoal.offline.requests import line_error
from shoal.serve import responses_api
from shoal.serve.logprobs import LogprobFormat
from shoal.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body
from shoal.serve.responses import chat_response, completion_response
from shoal.serve.responses_api import ResponsesRequest

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
_MODELS = {URLS[0]: ChatCompletionRequest, URLS[1]: CompletionRequest, URLS[2]: ResponsesRequest}
# body fields that mean nothing in a batch (a result is never streamed)
_DROPPED = ("stream", "stream_options", "metadata", "store")


@dataclass(frozen=True)
class BatchLine:
    """One request line: its LLM.run items (a completion with a list of prompts has one per
    prompt; a bad line one error item) and the parsed body (None for a bad line)."""

    line: int
    custom_id: str | None
    url: str
    body: ChatCompletionRequest | CompletionRequest | ResponsesRequest | None
    items: tuple[dict, ...]


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    field = ".".join(str(x) for x in first.get("loc", ()))
    return f"body.{field}: {first.get('msg')}" if field else f"body: {first.get('msg')}"


def _fields_set(body: ChatCompletionRequest | CompletionRequest, params) -> set[str]:
    """The SamplingParams fields the body gives (command-line flags fill only the others)."""
    given = set(body.sampling_fields())
    if {"max_tokens", "max_completion_tokens"} & body.model_fields_set:
        given.add("max_tokens")
    if body.logprobs not in (None, False):
        given.add("logprobs")
    if params.structured is not None:
        given.add("structured")
    return given


def _items(body: ChatCompletionRequest | CompletionRequest, flags: dict[str, Any]
           ) -> tuple[dict, ...]:
    params = body.params()
    unset = {k: v for k, v in flags.items() if k not in _fields_set(body, params)}
    if unset:
        params = params.replace(**unset)
    common = {"sampling_params": params, "priority": body.priority}
    if isinstance(body, ChatCompletionRequest):
        return ({"messages": body.message_dicts(), **body.encode_options(), **common},)
    return tuple({"prompt": text, **common} if ids is None else
                 {"prompt_token_ids": ids, **common} for text, ids in body.prompt_inputs())


def parse_batch_line(text: str, line: int, model: str, flags: dict[str, Any],
                     warn: Callable[[str], None] = lambda message: None) -> BatchLine:
    """The request line (a bad one becomes one error item). `model`: the served model's name
    (a body may leave it out); `flags`: the sampling fields given on the command line, used
    where the body gives none; `warn` hears of the body's unknown fields (ignored, as by the
    server)."""
    custom_id, url = None, URLS[0]
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str):
            custom_id = None
            raise ValueError("custom_id: expected a string")
        url = obj.get("url")
        if url not in URLS:
            raise ValueError(f"url: got {url!r}, expected one of {URLS}")
        if obj.get("method", "POST") != "POST":
            raise ValueError(f"method: got {obj.get('method')!r}, expected 'POST'")
        raw = obj.get("body")
        if not isinstance(raw, dict):
            raise ValueError("body: expected a JSON object")
        raw = {"model": model, **{k: v for k, v in raw.items() if k not in _DROPPED}}
        try:
            body = _MODELS[url].model_validate(raw)
        except ValidationError as exc:
            raise ValueError(_validation_message(exc)) from None
        if body.ignored_fields():
            warn(f"line {line}: body field(s) ignored: {', '.join(body.ignored_fields())}")
        if isinstance(body, ResponsesRequest):
            if body.previous_response_id is not None:
                raise ValueError("previous_response_id: a batch stores no responses")
            items = _items(body.chat_request([]), flags)
        else:
            items = _items(body, flags)
    except (ValueError, TypeError) as exc:
        return BatchLine(line, custom_id, url, None, ({"error": f"line {line}: {exc}"},))
    return BatchLine(line, custom_id, url, body, items)


def batch_result(b: BatchLine, outs: list[RequestOutput], model: str,
                 fmt: LogprobFormat) -> dict:
    """The result line of one request line (`outs`: one per item). A line without a string
    custom_id also carries its `line` number (what --resume knows it by)."""
    request_id = f"shoal-{uuid.uuid4().hex[:16]}"
    result: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex[:24]}",
                              "custom_id": b.custom_id, "error": None}
    if b.custom_id is None:
        result["line"] = b.line
    error = next((out.error for out in outs if out.error is not None), None)
    if error is not None or b.body is None:
        message = line_error(b.line, error or b.items[0]["error"])
        result["error"] = message
        result["response"] = {"status_code": 400, "request_id": request_id,
                              "body": error_body(message, code=400)}
        return result
    created = int(time.time())
    if isinstance(b.body, ResponsesRequest):
        body = responses_api.finished_response(f"resp_{request_id}", created, model, b.body,
                                               outs[0], fmt.tokenizer)
    elif isinstance(b.body, ChatCompletionRequest):
        body = chat_response(f"chatcmpl-{request_id}", created, model, b.body, outs[0], fmt)
    else:
        body = completion_response(f"cmpl-{request_id}", created, model, b.body, outs, fmt)
    result["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return result
