"""The OpenAI batch file format (`shoal run-batch`, as `vllm run-batch`): request lines
`{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}` in,
result lines `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`
out, with `chat.completion` / `text_completion` bodies.

Invariant: every request line gives exactly one result line; a bad line or a failed request
gives status 400 and an error body (`{"error": {"message", "type"}}`), never an abort.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from shoal.engine.outputs import RequestOutput
from shoal.offline.requests import RequestLine
from shoal.sampling import SamplingParams
from shoal.serve.protocol import assistant_message, finish_reason, usage_of

URLS = ("/v1/chat/completions", "/v1/completions")
# OpenAI body fields -> SamplingParams fields (plus the vLLM extras of the same name)
_RENAMED = {"max_completion_tokens": "max_tokens"}
_PASSED = ("n", "temperature", "top_p", "max_tokens", "stop", "seed", "presence_penalty",
           "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
           "ignore_eos", "stop_token_ids", "skip_special_tokens",
           "include_stop_str_in_output", "logit_bias", "allowed_token_ids",
           "truncate_prompt_tokens", "bad_words")
_IGNORED = ("model", "user", "stream", "metadata", "store")


def _params(body: dict, url: str, default: SamplingParams) -> SamplingParams:
    fields: dict[str, Any] = {}
    for key, value in body.items():
        name = _RENAMED.get(key, key)
        if name in _PASSED:
            fields[name] = [value] if name == "stop" and isinstance(value, str) else value
    if url == "/v1/chat/completions":
        if body.get("logprobs"):
            fields["logprobs"] = int(body.get("top_logprobs") or 0)
    elif body.get("logprobs") is not None:
        fields["logprobs"] = body["logprobs"]
    return default.replace(**fields) if fields else default


def parse_batch_line(text: str, line: int, default: SamplingParams) -> tuple[RequestLine, str]:
    """(the request line, its url); a bad line becomes an error item."""
    custom_id, url = None, URLS[0]
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str):
            raise ValueError("custom_id: expected a string")
        url = obj.get("url")
        if url not in URLS:
            raise ValueError(f"url: got {url!r}, expected one of {URLS}")
        if obj.get("method", "POST") != "POST":
            raise ValueError(f"method: got {obj.get('method')!r}, expected 'POST'")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise ValueError("body: expected a JSON object")
        unknown = sorted(set(body) - set(_PASSED) - set(_RENAMED) - set(_IGNORED)
                         - {"messages", "prompt", "logprobs", "top_logprobs", "tools",
                            "reasoning_effort", "priority"})
        if unknown:
            raise ValueError(f"body: unsupported field(s) {unknown}")
        params = _params(body, url, default)
        if url == "/v1/chat/completions":
            if "messages" not in body:
                raise ValueError("body.messages: required for /v1/chat/completions")
            item = {"messages": body["messages"], "sampling_params": params}
            item.update({k: body[k] for k in ("tools", "reasoning_effort") if k in body})
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                item = {"prompt_token_ids": prompt, "sampling_params": params}
            elif isinstance(prompt, str):
                item = {"prompt": prompt, "sampling_params": params}
            else:
                raise ValueError("body.prompt: expected a string or a list of token ids")
        if "priority" in body:  # (scheduling_policy='priority'; the engine checks it)
            item["priority"] = body["priority"]
    except (ValueError, TypeError) as exc:
        item = {"error": f"line {line}: {exc}", "sampling_params": default}
    return RequestLine(line, custom_id, item), url


def batch_result(request: RequestLine, url: str, out: RequestOutput, model: str) -> dict:
    """The result line of one request."""
    request_id = f"shoal-{uuid.uuid4().hex[:16]}"
    result: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex[:24]}",
                              "custom_id": request.custom_id, "error": None}
    if out.error is not None or "error" in request.item:
        message = out.error or request.item.get("error")
        result["response"] = {"status_code": 400, "request_id": request_id,
                              "body": {"error": {"message": message,
                                                 "type": "invalid_request_error"}}}
        return result
    usage = usage_of(out)
    created = int(time.time())
    if url == "/v1/chat/completions":
        choices = [{"index": c.index, "message": assistant_message(c), "logprobs": None,
                    "finish_reason": finish_reason(c.finish_reason, bool(c.tool_calls))}
                   for c in out.outputs]
        body = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created,
                "model": model, "choices": choices, "usage": usage}
    else:
        choices = [{"index": c.index, "text": c.text, "logprobs": None,
                    "finish_reason": finish_reason(c.finish_reason)}
                   for c in out.outputs]
        body = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created,
                "model": model, "choices": choices, "usage": usage}
    result["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return result
