"""`shoal serve`: the OpenAI-compatible HTTP API over one `EngineLoop`.

Endpoints: /v1/completions, /v1/chat/completions (non-streaming, or server-sent events with
reasoning / content / tool-call deltas and an optional usage chunk), /v1/models (and
/v1/models/{id}), /v1/responses (OpenAI's Responses API over the chat path, stored responses
by id: responses_api.py, responses_stream.py), /tokenize, /detokenize, /health, /metrics,
/version; the completion and chat streams' chunks are made in serve/streams.py. Errors
have OpenAI's body (`{"error": {"message", "type", "param", "code"}}`): 400 for a bad field
or a prompt the model cannot take, 401 without the API key, 404 for another model,
429 past the queue limits, 503 once the engine has stopped (shutdown, a failure; a stream it
cuts ends with finish_reason `abort` and an error event).

Invariant: every accepted request ends exactly once: answered, or aborted when its client goes
away (its KV blocks are freed in the next engine turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from shoal import __version__
from shoal.engine.outputs import RequestOutput
from shoal.llm import parse_chat_output
from shoal.serve import responses_api
from shoal.serve.auth import RequireKey
from shoal.serve.engine_loop import EngineLoop, EngineStopped, Handle, Limits, QueueFull, Update
from shoal.serve.errors import APIError, install_error_handlers
from shoal.serve.logprobs import LogprobFormat
from shoal.serve.metrics import Metrics
from shoal.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    usage_of,
)
from shoal.serve.replica_loop import ReplicaLoop
from shoal.serve.responses import chat_response, completion_response, echo_text
from shoal.serve.responses_api import ResponsesRequest
from shoal.serve.responses_stream import response_events
from shoal.serve.sse import merge, sse
from shoal.serve.streams import chat_stream, completion_chunks
from shoal.serve.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from shoal.tokenizer.encoding import encode_messages

DISCONNECT_POLL_S = 0.25
logger = logging.getLogger(__name__)


class Server:
    """The request handling; `create_app` wires it to FastAPI."""

    def __init__(self, llm, model_name: str, limits: Limits) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_name = model_name
        self.loop = EngineLoop(llm.engine, limits) if llm.replicas is None else \
            ReplicaLoop(llm.replicas, self.tokenizer, limits)
        self.metrics = Metrics(lambda: self.loop.snapshot)
        self.logprobs = LogprobFormat(self.tokenizer)
        self.stored = responses_api.ResponseStore()

    # ---- helpers ------------------------------------------------------------------------------
    def _check_model(self, model: str, body=None) -> None:
        """404 for another model; a body's unknown fields are logged (and ignored)."""
        if body is not None and body.ignored_fields():
            logger.warning("request fields ignored: %s", ", ".join(body.ignored_fields()))
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", "not_found_error", "model")

    def _submit(self, prompt, params, ids, field: str, priority: int,
                request: Request) -> Handle:
        try:
            handle = self.loop.submit(prompt, params, ids, priority)
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error") from None
        except EngineStopped as exc:
            raise APIError(503, str(exc), "server_error") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=field) from None
        handle.watcher = asyncio.create_task(self._watch(handle, request))
        return handle

    async def _watch(self, handle: Handle, request: Request) -> None:
        """Every DISCONNECT_POLL_S until the request ends, a look whether its client is still
        there; if not: abort (freeing its blocks) and wake its handler (one task per request,
        not a timeout per update)."""
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                self.loop.abort(handle)
                handle.updates.put_nowait(None)
                return

    def abort(self, handle: Handle) -> None:
        handle.watcher.cancel()
        self.loop.abort(handle)

    async def _first(self, handle: Handle) -> Update:
        """The first update; a request rejected by the engine becomes a 400, one the engine
        ended before it produced anything (shutdown, an engine failure) a 503."""
        update = await self.next_update(handle)
        if all(r == "abort" for r in update.finish_reasons) and not any(update.token_ids):
            raise APIError(503, self.loop.stopped_reason(), "server_error")
        out = update.output
        if out is not None and out.error is not None and not any(update.token_ids):
            raise APIError(400, out.error, param="messages" if "messages" in out.error
                           else None)
        return update

    async def next_update(self, handle: Handle) -> Update:
        """The request's next update (APIError 499 once its client has gone)."""
        update = await handle.updates.get()
        if update is None:
            raise APIError(499, "client disconnected")
        self._observe(handle, update)
        return update

    def _observe(self, handle: Handle, update: Update) -> None:
        now = time.perf_counter()
        tokens = sum(len(t) for t in update.token_ids)
        last = handle.last_token_time
        if tokens and last is None:
            self.metrics.ttft.observe(now - handle.submitted)
        elif tokens and last is not None:  # one sample per token (several: a verified draft)
            for _ in range(tokens):
                self.metrics.itl.observe((now - last) / tokens)
        if tokens:
            handle.last_token_time = now
            handle.generated += tokens
        if update.output is not None:
            self.metrics.e2e.observe(now - handle.submitted)
        if update.output is not None or all(r == "abort" for r in update.finish_reasons):
            handle.watcher.cancel()  # the last update

    async def _collect(self, first: Update, handle: Handle) -> RequestOutput:
        """The finished output; one that failed after its first token is a 500 (a partial
        answer is never passed off as a whole one)."""
        update = first
        while update.output is None:
            if all(r == "abort" for r in update.finish_reasons):
                raise APIError(503, self.loop.stopped_reason(), "server_error")
            update = await self.next_update(handle)
        if update.output.error is not None:
            raise APIError(500, update.output.error, "server_error")
        return update.output

    def stream_end(self, updates: list[Update], body, rid: str, created: int,
                    obj: str) -> Iterator[str]:
        """After the requests' last updates: the usage chunk when asked for
        (`stream_options.include_usage`), or an error event when the server cut the stream
        (shutdown, an engine failure) or a request failed after its first token, then
        [DONE]."""
        failed = next((u.output.error for u in updates
                       if u.output is not None and u.output.error is not None), None)
        if any(u.output is None and all(r == "abort" for r in u.finish_reasons)
               for u in updates):
            yield sse(error_body(self.loop.stopped_reason(), "server_error", code=503))
        elif failed is not None:
            yield sse(error_body(failed, "server_error", code=500))
        elif body.stream_options and body.stream_options.include_usage and \
                all(u.output is not None for u in updates):
            yield sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                        "choices": [], "usage": usage_of(*(u.output for u in updates))})
        yield "data: [DONE]\n\n"

    # ---- /v1/completions ----------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        """One engine request per prompt (a list of prompts is several); choice i * n + j is
        prompt i's j-th completion, as in OpenAI's API."""
        self._check_model(body.model, body)
        try:
            params = body.params()
            inputs = body.prompt_inputs()
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from None
        handles, firsts, prompt_ids = [], [], []
        try:
            for prompt, ids in inputs:
                if prompt and ids is None:  # once, off the event loop (the engine takes ids)
                    ids = await asyncio.to_thread(self.tokenizer.encode, prompt,
                                                  add_special_tokens=True)
                keep = body.truncate_prompt_tokens  # (the engine keeps a prompt's tail)
                prompt_ids.append(ids[-keep:] if keep and ids is not None else ids)
                handles.append(self._submit(prompt, params, ids, "prompt", body.priority,
                                            request))
            for handle in handles:
                firsts.append(await self._first(handle))
        except BaseException:  # one prompt refused: none of them runs
            for handle in handles:
                self.abort(handle)
            raise
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            echoes = [(echo_text(text, ids, body, self.tokenizer), ids) if body.echo else ("", None)
                      for (text, _), ids in zip(inputs, prompt_ids, strict=True)]
            return StreamingResponse(self._completion_streams(
                firsts, handles, rid, created, params, body, echoes),
                media_type="text/event-stream")
        outs = [await self._collect(f, h) for f, h in zip(firsts, handles, strict=True)]
        return completion_response(rid, created, self.model_name, body, outs, self.logprobs)

    async def _completion_streams(self, firsts: list[Update], handles: list[Handle],
                                  rid: str, created: int, params,
                                  body, echoes: list[tuple]) -> AsyncIterator[str]:
        """The prompts' chunks as they come (merged), then the end over all of them."""
        lasts: list[Update] = list(firsts)
        async for line in merge([completion_chunks(self, i, lasts, handle, rid, created,
                                                   params, body, echoes[i])
                                 for i, handle in enumerate(handles)]):
            yield line
        for line in self.stream_end(lasts, body, rid, created, "text_completion"):
            yield line

    # ---- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model, body)
        try:
            params = body.params()
            options = body.encode_options()
            prompt = encode_messages(body.message_dicts(), **options)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from None
        ids = await asyncio.to_thread(self.tokenizer.encode, prompt,
                                      add_special_tokens=False)
        handle = self._submit(prompt, params, ids, "messages", body.priority, request)
        first = await self._first(handle)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return StreamingResponse(chat_stream(self, first, handle, rid, created, prompt,
                                                 params.logprobs, body),
                                     media_type="text/event-stream")
        out = await self._collect(first, handle)
        parse_chat_output(out, prompt)
        return chat_response(rid, created, self.model_name, body, out, self.logprobs)


    # ---- /v1/responses ------------------------------------------------------------------------
    async def responses(self, body: ResponsesRequest, request: Request):
        """OpenAI's Responses API over the chat path (serve/responses_api.py)."""
        self._check_model(body.model, body)
        history: list[dict] = []
        if body.previous_response_id is not None:
            stored = self.stored.get(body.previous_response_id)
            if stored is None:
                raise APIError(404, f"previous_response_id: {body.previous_response_id!r} is "
                               f"not stored (this server keeps the last {self.stored.capacity} "
                               "stored responses, in memory)", "not_found_error",
                               "previous_response_id")
            history = stored.conversation
        try:
            chat = body.chat_request(history)
            params = chat.params()
            prompt = encode_messages(chat.message_dicts(), **chat.encode_options())
            conversation = history + body.input_messages()
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from None
        ids = await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=False)
        handle = self._submit(prompt, params, ids, "input", body.priority, request)
        first = await self._first(handle)
        rid, created = responses_api.new_id("resp"), int(time.time())

        def keep(response: dict) -> None:
            if body.store:
                self.stored.put(rid, response, conversation + responses_api.item_messages(
                    response["output"], "output"))

        if body.stream:
            return StreamingResponse(response_events(self, first, handle, prompt, rid, created,
                                                     body, keep),
                                     media_type="text/event-stream")
        out = await self._collect(first, handle)
        parse_chat_output(out, prompt)
        response = responses_api.finished_response(rid, created, self.model_name, body, out,
                                                   self.tokenizer)
        keep(response)
        return response


def create_app(llm, *, model_name: str, api_key: str | None = None,
               limits: Limits | None = None, allowed_origins: Sequence[str] = ()) -> FastAPI:
    """The app; `allowed_origins`: the origins browsers may call it from (CORS, outside the
    key check so that a preflight, which carries no key, is answered)."""
    server = Server(llm, model_name, limits or Limits())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        server.loop.stop(timeout=30)

    app = FastAPI(title="shoal", lifespan=lifespan)
    app.state.server = server

    if api_key is not None:
        app.add_middleware(RequireKey, key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])

    install_error_handlers(app)

    @app.get("/health")
    async def health():
        if not server.loop.alive:
            return JSONResponse({"status": "engine stopped", "error": repr(server.loop.error)},
                                status_code=503)
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()),
                "owned_by": "shoal", "max_model_len": llm.config.scheduler.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        server._check_model(model)
        return model_card()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await server.responses(body, request)

    @app.get("/v1/responses/{rid}")
    async def stored_response(rid: str):
        stored = server.stored.get(rid)
        if stored is None:
            raise APIError(404, f"response {rid!r} is not stored", "not_found_error")
        return stored.response

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        if not server.stored.delete(rid):
            raise APIError(404, f"response {rid!r} is not stored", "not_found_error")
        return {"id": rid, "object": "response", "deleted": True}

    @app.post("/tokenize")
    async def tokenize_(body: TokenizeRequest):
        server._check_model(body.model or model_name)
        try:
            return await tokenize(body, server.tokenizer, model_name,
                                  llm.config.scheduler.max_model_len)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    @app.post("/detokenize")
    async def detokenize_(body: DetokenizeRequest):
        server._check_model(body.model or model_name)
        try:
            return await detokenize(body, server.tokenizer, llm.config.model_config.vocab_size)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tokens") from None

    return app
