"""`shoal serve` when a request fails: a grammar that cannot be built, or grows too complex
mid-way, or a sequence with no valid token left, ends that request with an error (400 before
its first token, 500 or a stream's error event after) and the server keeps serving; a forced
call cut by max_tokens reports `length`; malformed tools are a 400; unknown fields are ignored;
malformed JSON is named as such."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from support.chat import TOOL_BLOCK
from support.live_server import API_KEY, LiveServer, post

UNDERSCORE = 65  # tiny's id of "_"
STUCK = {"model": "tiny", "prompt": "x", "max_tokens": 8, "allowed_token_ids": [UNDERSCORE],
         "guided_regex": "_{3}[0-9]"}  # after "___" no allowed token fits the regex


def _healthy(live: LiveServer) -> bool:
    code, reply = post(live, "/v1/completions", {"model": "tiny", "prompt": [5, 6],
                                                 "max_tokens": 2})
    return code == 200 and reply["usage"]["completion_tokens"] == 2


def _stream(live: LiveServer, body: dict) -> list:
    req = urllib.request.Request(
        live.base + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = [line.decode().strip() for line in r]
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_a_failure_after_the_first_token_is_an_error_not_a_stop(live: LiveServer) -> None:
    code, reply = post(live, "/v1/completions", STUCK)
    assert code == 500 and "no valid token" in reply["error"]["message"], reply
    events = _stream(live, STUCK)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert "no valid token" in error["error"]["message"]
    reasons = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
    assert reasons[-1] == "error" and "stop" not in reasons
    too_complex = {"model": "tiny", "prompt": [5, 6], "max_tokens": 20,
                   "guided_choice": [f"option number {i}" for i in range(3000)]}
    code, reply = post(live, "/v1/completions", too_complex)
    assert code in (400, 500) and "structured output failed" in reply["error"]["message"]
    assert "\n" not in reply["error"]["message"]
    assert _healthy(live)


def test_a_request_that_fails_while_added_ends_alone(live: LiveServer, monkeypatch) -> None:
    """A matcher that cannot be built (as llguidance's panic on a huge grammar), then any
    exception while a request is added: that request's 400, the server unharmed."""
    from shoal.sampling.structured import StructuredOutputBackend

    def panic(self, spec):
        raise ValueError("invalid structured output grammar: panic: assertion failed\n"
                         "stack backtrace:\n   0: frame")

    monkeypatch.setattr(StructuredOutputBackend, "matcher", panic)
    code, reply = post(live, "/v1/completions", {**STUCK, "allowed_token_ids": None})
    assert code == 400 and "panic" in reply["error"]["message"], reply
    monkeypatch.undo()
    engine = live.llm.engine
    add = engine.add_request
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug\nwith details")
        return add(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", broken)
    code, reply = post(live, "/v1/completions", {"model": "tiny", "prompt": [5], "max_tokens": 2})
    assert code == 400 and reply["error"]["message"] == "RuntimeError: a bug", reply
    monkeypatch.undo()
    assert live.engine_loop.alive and _healthy(live)


def test_a_forced_call_cut_by_max_tokens_is_length(live: LiveServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}],
            "max_tokens": 12, "temperature": 0.0, "guided_choice": [TOOL_BLOCK],
            "chat_template_kwargs": {"enable_thinking": False}}
    code, reply = post(live, "/v1/chat/completions", body)
    assert code == 200 and reply["choices"][0]["finish_reason"] == "length", reply


@pytest.mark.parametrize("tool, field", [
    ({"type": "function", "function": "f"}, "tools[0].function.name"),
    ({"type": "function", "function": {"name": "f", "parameters": "str"}},
     "tools[0].function.parameters"),
    ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": "string"}}}}, "properties"),
    ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": 5}}}, "required"),
])
def test_malformed_tools_are_a_400(live: LiveServer, tool: dict, field: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "tools": [tool], "tool_choice": "required"}
    code, reply = post(live, "/v1/chat/completions", body)
    assert code == 400 and field in reply["error"]["message"], reply


def test_unknown_fields_are_ignored_and_bad_json_is_named(live: LiveServer) -> None:
    code, reply = post(live, "/v1/completions", {
        "model": "tiny", "prompt": [5, 6], "max_tokens": 9, "max_completion_tokens": 2,
        "store": False, "metadata": {"a": "b"}, "service_tier": "auto"})
    assert code == 200 and reply["usage"]["completion_tokens"] == 2, reply
    code, reply = post(live, "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert code == 400 and reply["error"]["message"].startswith("body: invalid JSON")
    assert reply["error"]["param"] is None
    code, reply = post(live, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    assert code == 400 and "top_logprobs" in reply["error"]["message"]


def test_cors_preflight_and_origins() -> None:
    """--allowed-origins: a browser's preflight is answered without the key (it carries none),
    an allowed origin's calls get its CORS header, another origin's preflight is refused; a
    server without origins sends no CORS header."""
    live = LiveServer(max_num_seqs=2, max_model_len=128, allowed_origins=["http://ui.example"])
    try:
        def preflight(origin: str):
            return urllib.request.Request(
                live.base + "/v1/chat/completions", method="OPTIONS",
                headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization,content-type"})

        with urllib.request.urlopen(preflight("http://ui.example"), timeout=10) as r:
            assert r.status == 200
            assert r.headers["access-control-allow-origin"] == "http://ui.example"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(preflight("http://evil.example"), timeout=10)
        assert refused.value.code == 400
        models = urllib.request.Request(live.base + "/v1/models", headers={
            "Origin": "http://ui.example", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(models, timeout=10) as r:
            assert r.headers["access-control-allow-origin"] == "http://ui.example"
        with pytest.raises(urllib.error.HTTPError) as no_key:  # the key is still required
            urllib.request.urlopen(urllib.request.Request(
                live.base + "/v1/models", headers={"Origin": "http://ui.example"}), timeout=10)
        assert no_key.value.code == 401
    finally:
        live.stop()
    plain = LiveServer(max_num_seqs=2, max_model_len=128)
    try:
        with urllib.request.urlopen(urllib.request.Request(plain.base + "/health", headers={
                "Origin": "http://ui.example"}), timeout=10) as r:
            assert "access-control-allow-origin" not in r.headers
    finally:
        plain.stop()


def test_open_paths_stay_open_under_a_root_path() -> None:
    """`--root-path /api --api-key K`: uvicorn puts the root path into the request's path;
    /health, /metrics and /version still answer without the key, /v1 still needs it."""
    import socket
    import threading
    import time

    import uvicorn

    from shoal import LLM
    from shoal.serve.app import create_app

    app = create_app(LLM("tiny", device="cpu", max_num_seqs=2, max_model_len=128),
                     model_name="tiny", api_key=API_KEY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", root_path="/api"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        for path in ("/health", "/version", "/metrics"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                assert r.status == 200, path
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert refused.value.code == 401
    finally:
        server.should_exit = True
        thread.join(30)
