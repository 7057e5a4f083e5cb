"""The whole (non-streaming) OpenAI response bodies of finished requests: `text_completion`
and `chat.completion`. The server and `shoal run-batch` both answer with these.
"""

from __future__ import annotations

from shoal.engine.outputs import RequestOutput
from shoal.serve.logprobs import LogprobFormat
from shoal.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    assistant_message,
    finish_reason,
    usage_of,
)


def echo_text(prompt: str | None, ids: list[int], body: CompletionRequest, tokenizer) -> str:
    """The prompt `echo` shows: the one the engine saw (`ids`, a truncated prompt's kept tail,
    decoded; else the prompt's own text)."""
    if prompt is not None and body.truncate_prompt_tokens is None:
        return prompt
    return tokenizer.decode(ids)


def echo_of(out: RequestOutput, body: CompletionRequest, fmt: LogprobFormat
            ) -> tuple[str, list]:
    """What `echo` puts before each choice: the prompt's text, and its (token, logprobs)
    entries when log-probs are asked for."""
    if not body.echo:
        return "", []
    ids = out.prompt_token_ids
    text = echo_text(out.prompt, ids, body, fmt.tokenizer)
    return text, list(zip(ids, out.prompt_logprobs or [None] * len(ids), strict=True)) \
        if body.logprobs is not None else []


def completion_response(rid: str, created: int, model: str, body: CompletionRequest,
                        outs: list[RequestOutput], fmt: LogprobFormat) -> dict:
    """One output per prompt of `body`; choice i * n + j is prompt i's j-th completion, as in
    OpenAI's API."""
    want_lp, n = body.logprobs, body.n
    echoes = [echo_of(out, body, fmt) for out in outs]
    choices = [{"index": i * n + c.index, "text": echoes[i][0] + c.text,
                "finish_reason": finish_reason(c.finish_reason), "logprobs":
                fmt.completion(echoes[i][1] + list(zip(c.token_ids, c.logprobs, strict=False)),
                               want_lp)
                if want_lp is not None and c.logprobs is not None else None}
               for i, out in enumerate(outs) for c in out.outputs]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_of(*outs)}


def chat_response(rid: str, created: int, model: str, body: ChatCompletionRequest,
                  out: RequestOutput, fmt: LogprobFormat) -> dict:
    """`out`'s completions parsed (reasoning, content, tool calls) as chat choices."""
    want_lp = (body.top_logprobs or 0) if body.logprobs else None
    choices = [{"index": c.index, "message": assistant_message(c),
                "logprobs": fmt.chat(list(zip(c.token_ids, c.logprobs, strict=False)), want_lp)
                if want_lp is not None and c.logprobs else None,
                "finish_reason": finish_reason(c.finish_reason, bool(c.tool_calls))}
               for c in out.outputs]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_of(out)}
