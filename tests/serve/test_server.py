"""`shoal serve` through the real `openai` client on tiny (CPU, loopback): completions and chat,
streaming equal to non-streaming, tool calls, JSON schema output, logprobs, n, usage; bad
requests with OpenAI error bodies; the API key; cancellation and a bounded load test without a
leaked KV block; 429 past the queue limit."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

import shoal
from support.chat import TOOL_BLOCK
from support.live_server import (
    API_KEY,
    LiveServer,
    free_blocks,
    post,
    wait_idle,
    wait_running,
)

CHAT = [{"role": "user", "content": "hello there"}]


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_completions_and_chat_stream_equal_non_stream(live: LiveServer) -> None:
    client = live.client()
    args = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 8,
            "temperature": 0.9, "seed": 11}
    whole = client.completions.create(**args)
    parts = client.completions.create(**args, stream=True,
                                      stream_options={"include_usage": True})
    chunks = list(parts)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 8
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0.9, "seed": 5,
            "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}  # vLLM's alias
    whole = client.chat.completions.create(**chat)
    assert whole.choices[0].message.content and whole.usage.completion_tokens == 8
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**chat, stream=True)
              if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    thinking = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6,
                                              temperature=0.0)
    assert thinking.choices[0].message.reasoning_content  # the thinking prompt's reasoning


def test_n_logprobs_json_schema_and_tool_calls(live: LiveServer) -> None:
    client = live.client()
    two = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, n=2,
                                         temperature=1.0, seed=3, logprobs=True,
                                         top_logprobs=2)
    assert [c.index for c in two.choices] == [0, 1]
    for choice in two.choices:
        assert len(choice.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    cmpl = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, logprobs=2,
                                     seed=2)
    lp = cmpl.choices[0].logprobs
    assert len(lp.token_logprobs) == 3
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(3)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=3, logprobs=2, seed=2, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset
    out = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=24, temperature=1.0, seed=9,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    value = json.loads(out.choices[0].message.content)
    assert isinstance(value, dict) and set(value) == {"ok"} and isinstance(value["ok"], bool)
    pick = client.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=1.0,
                                     seed=1, extra_body={"structured_outputs": {
                                         "choice": ["alpha", "beta"]}})
    assert pick.choices[0].text in ("alpha", "beta")  # (vLLM's form since v0.12)
    # the tool preamble alone outgrows tiny's 256 positions: the tools reach the encoding
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=4)
    # random weights make no call by themselves: a grammar admitting only a DSML call block
    forced = {"model": "tiny", "messages": [{"role": "user", "content": "weather in Paris?"}],
              "max_tokens": 100, "temperature": 0.0,  # (the block is 86 tokens)
              "extra_body": {"guided_choice": [TOOL_BLOCK],
                             "chat_template_kwargs": {"enable_thinking": False}}}
    call = client.chat.completions.create(**forced)
    (tool,) = call.choices[0].message.tool_calls
    assert call.choices[0].finish_reason == "tool_calls"
    assert tool.function.name == "get_weather" and json.loads(tool.function.arguments) == {
        "city": "Paris"}
    streamed = [c.choices[0].delta for c in client.chat.completions.create(**forced,
                                                                             stream=True)
                if c.choices]
    starts = [t for d in streamed for t in (d.tool_calls or []) if t.function.name]
    args = "".join(t.function.arguments or "" for d in streamed for t in (d.tool_calls or []))
    assert [t.function.name for t in starts] == ["get_weather"]
    assert json.loads(args) == {"city": "Paris"}


BAD = [  # (body, status, text the message names)
    ({"messages": CHAT}, 400, "model"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ({"model": "tiny", "messages": CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "tiny", "messages": CHAT, "top_p": 2}, 400, "top_p"),
    ({"model": "tiny", "messages": CHAT, "tools": TOOLS, "tool_choice": "sometimes"}, 400,
     "tool_choice"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 400}]}, 400,
     "max_model_len"),
    ({"model": "other", "messages": CHAT}, 404, "other"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(live: LiveServer) -> None:
    for body, status, text in BAD:
        code, reply = post(live, "/v1/chat/completions", body)
        assert code == status, (body, reply)
        assert text in reply["error"]["message"] and reply["error"]["type"], reply
    code, reply = post(live, "/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert code == 400 and "error" in reply
    code, reply = post(live, "/v1/completions", {"model": "tiny", "prompt": "x"}, key=None)
    assert code == 401 and reply["error"]["type"] == "authentication_error"
    with urllib.request.urlopen(live.base + "/health", timeout=10) as r:  # no key needed
        assert r.status == 200
    req = urllib.request.Request(live.base + "/metrics",
                                 headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    for name in ("shoal_running", "shoal_kv_blocks_used", "shoal_output_tokens_total",
                 "shoal_time_to_first_token_seconds_bucket", "shoal_preemptions_total"):
        assert name in text
    assert [m.id for m in live.client().models.list().data] == ["tiny"]
    assert live.client().models.retrieve("tiny").max_model_len == 256
    with pytest.raises(openai.NotFoundError):
        live.client().models.retrieve("other")
    req = urllib.request.Request(live.base + "/version",
                                 headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read())["version"] == shoal.__version__
    ok = live.client().completions.create(model="tiny", prompt="still here", max_tokens=2)
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_client_that_disconnects_is_aborted_and_its_blocks_freed(live: LiveServer,
                                                                  stream: bool) -> None:
    wait_idle(live)
    free, before = free_blocks(live), live.engine_loop.snapshot["output_tokens"]
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 200, "ignore_eos": True,
            "stream": stream}
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", live.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(data)).encode() + b"\r\n\r\n" + data)
        wait_running(live)
    wait_idle(live)
    assert free_blocks(live) == free
    # aborted, not run to its end (200 tokens): the blocks did not just free themselves
    assert live.engine_loop.snapshot["output_tokens"] - before < 200


def test_load_every_request_answered_once(live: LiveServer) -> None:
    wait_idle(live)
    free = free_blocks(live)
    clients, per_client = 64, 10
    results: list[list[int]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        client = live.client(timeout=120)
        try:
            for j in range(per_client):
                r = client.completions.create(model="tiny", prompt=[5 + i, 6 + j, 7],
                                              max_tokens=3, temperature=0.0,
                                              extra_body={"ignore_eos": True})
                results[i].append(r.usage.completion_tokens)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert results == [[3] * per_client for _ in range(clients)]
    wait_idle(live)
    assert free_blocks(live) == free


def test_queue_limit_answers_429() -> None:
    server = LiveServer(max_num_seqs=2, max_model_len=128, max_queued_requests=1,
                        max_queued_prompt_tokens=64)
    try:
        # a prompt larger than the token bound alone would never fit: 400, not 429 forever
        status, body = post(server, "/v1/completions", {
            "model": "tiny", "prompt": list(range(3, 3 + 65)), "max_tokens": 1})
        assert status == 400 and body["error"]["param"] == "prompt", body
        assert "max_queued_prompt_tokens" in body["error"]["message"]
        codes: list[int] = []

        def one() -> None:
            try:
                server.client(timeout=120).completions.create(
                    model="tiny", prompt="x", max_tokens=20, extra_body={"ignore_eos": True})
                codes.append(200)
            except openai.RateLimitError:
                codes.append(429)

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert 429 in codes and 200 in codes and len(codes) == 8
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/tokenize"])
def test_key_required_but_not_for_health_and_metrics(live: LiveServer, path: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(live.base + path, timeout=10)
    assert err.value.code == 401
    for open_path in ("/health", "/metrics", "/version"):
        with urllib.request.urlopen(live.base + open_path, timeout=10) as reply:
            assert reply.status == 200


@pytest.mark.parametrize("grace", [60, 1])
def test_sigterm_finishes_in_flight_requests_and_exits_0(tmp_path, grace: int) -> None:
    """Within the grace an in-flight request finishes; past it, the requests still running end
    as promised: 503, or a stream's `abort` and error event (not a bare 500, not a cut)."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--model", "tiny",
                             "--device", "cpu", "--port", str(port), "--max-model-len", "128",
                             "--shutdown-grace", str(grace), "--threads", "1",
                             # (uvicorn's pass-throughs: the server must still start)
                             "--root-path", "/api", "--allowed-origins", "http://ui.example",
                             "--uvicorn-log-level", "error"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise AssertionError("the server did not come up") from None
                time.sleep(0.2)
        answer: list = []
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        tokens = 40 if grace > 1 else 120  # (tiny: 120 tokens take longer than a second)

        def ask(stream: bool) -> None:
            try:
                reply = client.completions.create(model="tiny", prompt="x", max_tokens=tokens,
                                                  stream=stream, extra_body={"ignore_eos": True})
                answer.append(list(reply) if stream else reply)
            except openai.APIError as exc:
                answer.append(exc)

        workers = [threading.Thread(target=ask, args=(s,)) for s in (False, True)]
        for w in workers:
            w.start()
        time.sleep(0.5)  # the requests are in flight
        proc.send_signal(signal.SIGTERM)
        for w in workers:
            w.join(120)
        assert proc.wait(120) == 0
        done = [a for a in answer if not isinstance(a, (list, Exception))]
        streams = [a for a in answer if isinstance(a, list)]
        if grace > 1:
            assert done and done[0].usage.completion_tokens == 40  # finished, not cut
            assert sum(len(c.choices[0].text) > 0 for c in streams[0] if c.choices) > 0
        else:
            errors = [a for a in answer if isinstance(a, Exception)]
            assert any(getattr(e, "status_code", None) == 503 for e in errors), answer
            assert any("shutting down" in str(e) for e in errors), answer
    finally:
        if proc.poll() is None:
            proc.kill()


def test_prefix_cache_hits_show_in_the_metrics(tmp_path) -> None:
    """The same 200-token prompt twice: the second resumes at the 128-token boundary (the same
    completion), and /metrics counts the hit, and the KV store's counters."""
    server = LiveServer(max_num_seqs=4, max_model_len=256, block_size=128,
                        enable_prefix_caching=True, prefill_mode="full",
                        kv_store_path=str(tmp_path / "kv"))
    try:
        prompt = [3 + (7 * i) % 400 for i in range(200)]
        texts = [server.client().completions.create(
            model="tiny", prompt=prompt, max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text for _ in range(2)]
        assert texts[0] == texts[1]
        req = urllib.request.Request(server.base + "/metrics",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        assert "shoal_prefix_hit_tokens_total 128.0" in text, text
        assert "shoal_prefix_query_tokens_total 400.0" in text
        assert "shoal_kv_store_puts_total" in text
        assert "shoal_kv_store_dropped_puts_total 0.0" in text
        assert "shoal_kv_store_lost_reads_total 0.0" in text
    finally:
        server.stop()
