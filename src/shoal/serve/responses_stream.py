"""The Responses API's streamed events (responses_api.py has the objects): `response.created`,
`response.in_progress`, then per output item as the text parses (reasoning, the message,
each function call) `response.output_item.added`, its content part and text deltas
(`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`), their `.done` events and
`response.output_item.done`; last `response.completed` (or `response.incomplete` when out of
room) with the whole response, whose items are the streamed ones. A request that fails after
its first token ends with `response.failed`; one the server cut (shutdown, an engine failure)
with an `error` event. Each event is an SSE `event:` line and its JSON, numbered by
`sequence_number`. With log-probs asked for, each `response.output_text.delta` carries those of
the message tokens confirmed since the last one (content_tokens.py; an empty delta carries the
rest when the message closes), so they concatenate to the done event's.

Invariant: a stream that ends early (its client went away) aborts its request.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from shoal.llm import parse_chat_output
from shoal.serve import responses_api as api
from shoal.serve.content_tokens import ContentTokens
from shoal.serve.engine_loop import Handle, Update
from shoal.serve.logprobs import LogprobFormat
from shoal.tokenizer.parser import OutputParser, ParserEvent, ParserState


class _Items:
    """The output items as parser events open, extend and close them; each method returns
    the events it makes (`event(type, **fields)` writes one)."""

    def __init__(self, event: Callable[..., str]) -> None:
        self.event = event
        self.items: list[dict[str, Any]] = []
        self.text = ""  # the open item's text so far (a call's: its arguments)
        self.logprobs: list[dict[str, Any]] = []  # the message's, confirmed and not yet sent
        self.sent: list[dict[str, Any]] = []  # the message's, sent in its deltas

    @property
    def open(self) -> dict[str, Any] | None:
        last = self.items[-1] if self.items else None
        return last if last is not None and last["status"] == "in_progress" else None

    def feed(self, e: ParserEvent) -> list[str]:
        if e.kind in ("reasoning", "content") and e.text:
            kind = "reasoning" if e.kind == "reasoning" else "message"
            out = [] if self.open is not None and self.open["type"] == kind else \
                self.close("completed") + self.start(kind)
            return out + self._delta(e.text)
        if e.kind == "tool_call":
            return self.close("completed") + self.start("function_call", e.name or "")
        if e.kind == "tool_arguments" and e.text and self.open is not None:
            return self._delta(e.text)
        return []

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def start(self, kind: str, name: str = "") -> list[str]:
        item = {"reasoning": lambda: api.reasoning_item("", "in_progress"),
                "message": lambda: api.message_item("", "in_progress"),
                "function_call": lambda: api.call_item(name, "", "in_progress")}[kind]()
        if kind != "function_call":
            item["content"] = []
        self.items.append(item)
        self.text = ""
        out = [self.event("response.output_item.added", output_index=len(self.items) - 1,
                          item=item)]
        if kind != "function_call":
            out.append(self.event("response.content_part.added", **self._where(),
                                  content_index=0, part=self._part("")))
        return out

    def _part(self, text: str) -> dict[str, Any]:
        if self.items[-1]["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _delta(self, text: str) -> list[str]:
        self.text += text
        kind = self.items[-1]["type"]
        if kind == "function_call":
            return [self.event("response.function_call_arguments.delta", **self._where(),
                               delta=text)]
        extra = {}
        if kind == "message":
            extra = {"logprobs": self.logprobs}
            self.sent += self.logprobs
            self.logprobs = []
        name = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        return [self.event(name, **self._where(), content_index=0, delta=text, **extra)]

    def close(self, status: str, call_cut: bool = False) -> list[str]:
        """Close the open item, if any, with `status` (a call: `incomplete` only when it was
        cut, `call_cut`)."""
        item = self.open
        if item is None:
            return []
        where, text = self._where(), self.text
        if item["type"] == "function_call":
            cut = status == "incomplete" and call_cut
            item.update(arguments=text or "{}", status="incomplete" if cut else "completed")
            out = [self.event("response.function_call_arguments.done", **where,
                              arguments=item["arguments"])]
        else:
            message = item["type"] == "message"
            out = self._delta("") if message and self.logprobs else []
            name = "response.output_text.done" if message else "response.reasoning_text.done"
            part = self._part(text)
            if message:
                part["logprobs"] = self.sent
            item.update(content=[part], status=status)
            out += [self.event(name, **where, content_index=0, text=text,
                               **({"logprobs": self.sent} if message else {})),
                    self.event("response.content_part.done", **where, content_index=0,
                               part=part)]
        return out + [self.event("response.output_item.done", output_index=where["output_index"],
                                 item=item)]


async def response_events(server, update: Update, handle: Handle, prompt: str, rid: str,
                          created: int, body: api.ResponsesRequest,
                          keep: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
    """The events of one response, from the request's first update to its output; `keep` is
    given the finished response (to store it)."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def response(status: str, **extra: Any) -> dict[str, Any]:
        return api.response_body(rid, created, server.model_name, body, items.items, status,
                                 **extra)

    parser, items, done = OutputParser.for_prompt(prompt), _Items(event), False
    fmt, n_top = LogprobFormat(server.tokenizer), body.top_logprobs or 0
    tokens = ContentTokens(server.tokenizer, thinking=parser.state is ParserState.REASONING) \
        if body.wants_logprobs else None
    try:
        yield event("response.created", response=response("in_progress"))
        yield event("response.in_progress", response=response("in_progress"))
        while True:
            events = parser.feed(update.text[0])
            if tokens is not None:
                confirmed = tokens.feed(update.logprobs[0] if update.logprobs else ())
                if update.finish_reasons[0] is not None:
                    confirmed += tokens.close()
                items.logprobs += fmt.chat(confirmed, n_top)["content"]
            if update.finish_reasons[0] is not None:
                events += parser.close()
            for e in events:
                for line in items.feed(e):
                    yield line
            if update.output is not None or update.finish_reasons[0] == "abort":
                break
            update = await server.next_update(handle)
        done = True
        out = update.output
        if out is None:  # cut by the server: no response to give
            yield event("error", code="server_error", message=server.loop.stopped_reason(),
                        param=None)
            return
        c = out.outputs[0]
        if out.error is not None or c.finish_reason == "error":
            error = {"code": "server_error", "message": out.error or "generation failed"}
            for line in items.close("incomplete"):
                yield line
            yield event("response.failed", response=response("failed", error=error))
            return
        parse_chat_output(out, prompt)  # (the usage counts its reasoning tokens)
        status = api.finish_status(c.finish_reason)
        if not items.items:  # nothing generated: one empty message, as the whole response has
            for line in items.start("message"):
                yield line
        for line in items.close(status, parser.call_cut):
            yield line
        final = response(status, token_usage=api.usage(out, server.tokenizer))
        keep(final)
        yield event(f"response.{status}", response=final)
    finally:
        if not done:
            server.abort(handle)
