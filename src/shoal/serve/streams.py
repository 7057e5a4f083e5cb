"""The server-sent event streams of one request: a completion prompt's chunks and a chat
completion's deltas (reasoning, content, tool calls), each from the request's first update
to its last, over the `Server`'s update and abort helpers (`serve/app.py`).

With `stream_options.continuous_usage_stats` (and `include_usage`), every chunk carries the
request's `usage` so far, as vLLM's: its prompt tokens and the tokens its choices have
generated up to that chunk.

Invariant: a stream that ends early (its client went away, the server closed it) aborts its
request, freeing its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from shoal.serve.engine_loop import Handle, Update
from shoal.serve.protocol import chat_deltas
from shoal.serve.protocol import finish_reason as _finish_reason
from shoal.serve.sse import sse
from shoal.tokenizer.parser import OutputParser


def running_usage(body, handle: Handle, unsent: int = 0) -> dict | None:
    """The request's usage so far (less `unsent` tokens whose text no chunk has carried yet),
    when the body asked for it on every chunk, else None."""
    opts = body.stream_options
    if not (opts and opts.include_usage and opts.continuous_usage_stats):
        return None
    keep = getattr(body, "truncate_prompt_tokens", None)
    prompt = min(handle.prompt_tokens, keep) if keep else handle.prompt_tokens
    done = handle.generated - unsent
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


async def completion_chunks(server, i: int, lasts: list[Update], handle: Handle, rid: str,
                            created: int, params, body, echo: tuple) -> AsyncIterator[str]:
    """Prompt i's chunks (after `echo`, its (text, token ids) when echoed, with the prompt's
    log-probs when asked), from its update in lasts[i] to its last (kept in lasts[i])."""
    update, done, want_lp = lasts[i], False, params.logprobs
    (echo, echo_ids), echo_lp = echo, None

    def chunk(index: int, text: str, lp, reason: str | None = None) -> str:
        event = {"id": rid, "object": "text_completion", "created": created,
                 "model": server.model_name, "choices": [{
                     "index": index, "text": text, "logprobs": lp, "finish_reason": reason}]}
        usage = running_usage(body, handle)
        return sse(event if usage is None else {**event, "usage": usage})

    try:
        if echo and want_lp is not None:
            lps = update.prompt_logprobs or [None] * len(echo_ids)
            echo_lp = server.logprobs.completion(list(zip(echo_ids, lps, strict=True)), want_lp)
        # where each choice's next token starts (text_offset)
        offsets = [sum(map(len, echo_lp["tokens"])) if echo_lp else len(echo)] * params.n
        for j in range(params.n if echo else 0):
            yield chunk(i * params.n + j, echo, echo_lp)
        while True:
            for j, (text, entries, reason) in enumerate(zip(
                    update.text, update.logprobs, update.finish_reasons, strict=True)):
                if text or reason is not None or entries:
                    lp = server.logprobs.completion(entries, want_lp, offsets[j]) \
                        if want_lp is not None and entries else None
                    if lp is not None:
                        offsets[j] += sum(len(x) for x in lp["tokens"])
                    yield chunk(i * params.n + j, text, lp, _finish_reason(reason))
            if update.output is not None or all(r is not None for r in update.finish_reasons):
                break
            update = lasts[i] = await server.next_update(handle)
        done = True
    finally:
        if not done:
            server.abort(handle)


async def chat_stream(server, update: Update, handle: Handle, rid: str, created: int,
                      prompt: str, want_lp: int | None, body) -> AsyncIterator[str]:
    """A chat completion's chunks: each choice's role, then its deltas as its text parses,
    its finish reason, and the stream's end (`Server.stream_end`)."""
    n = len(update.text)
    parsers = [OutputParser.for_prompt(prompt) for _ in range(n)]
    calls: list[dict[int, str]] = [{} for _ in range(n)]  # call index -> id
    ended = [False] * n

    def chunk(index: int, delta: dict, reason: str | None = None, lp=None,
              unsent: int = 0) -> str:
        event = {"id": rid, "object": "chat.completion.chunk", "created": created,
                 "model": server.model_name, "choices": [{
                     "index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}]}
        usage = running_usage(body, handle, unsent)
        return sse(event if usage is None else {**event, "usage": usage})

    done = False
    try:
        first = sum(map(len, update.token_ids))  # (the role chunks carry no token yet)
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""}, unsent=first)
        while True:
            for i in range(n):
                if ended[i]:
                    continue
                events = parsers[i].feed(update.text[i])
                reason = update.finish_reasons[i]
                if reason is not None:
                    events += parsers[i].close()
                lp = server.logprobs.chat(update.logprobs[i], want_lp) \
                    if want_lp is not None and update.logprobs[i] else None
                for delta in chat_deltas(events, calls[i]):
                    yield chunk(i, delta, lp=lp)
                    lp = None
                if lp is not None:
                    yield chunk(i, {}, lp=lp)
                if reason is not None:
                    ended[i] = True
                    yield chunk(i, {}, _finish_reason(reason, bool(calls[i])))
            if all(ended) or update.output is not None:
                break
            update = await server.next_update(handle)
        done = True
        for line in server.stream_end([update], body, rid, created, "chat.completion.chunk"):
            yield line
    finally:
        if not done:
            server.abort(handle)
