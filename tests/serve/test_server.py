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

from support.live_server import API_KEY, LiveServer

CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def live():
    server = LiveServer(max_num_seqs=16, max_model_len=256)
    yield server
    server.stop()


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_BLOCK = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
              '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
              '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def _free_blocks(live: LiveServer) -> int:
    return live.engine_loop.snapshot["kv_blocks_total"] - \
        live.engine_loop.snapshot["kv_blocks_used"]


def _wait_idle(live: LiveServer, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        snap = live.engine_loop.snapshot
        if not (snap["running"] or snap["waiting"] or snap["kv_blocks_used"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {live.engine_loop.snapshot}")


def _post(live: LiveServer, path: str, body: bytes | dict, key: str | None = API_KEY):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(live.base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


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
    cmpl = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, logprobs=2)
    assert len(cmpl.choices[0].logprobs.token_logprobs) == 3
    out = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=24, temperature=1.0, seed=9,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    value = json.loads(out.choices[0].message.content)
    assert isinstance(value, dict) and set(value) == {"ok"} and isinstance(value["ok"], bool)
    # the tool preamble alone outgrows tiny's 256 positions: the tools reach the encoding
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=4)
    # random weights make no call by themselves: a grammar admitting only a DSML call block
    forced = {"model": "tiny", "messages": [{"role": "user", "content": "weather in Paris?"}],
              "max_tokens": 80, "temperature": 0.0,
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
    ({"model": "tiny", "messages": CHAT, "temprature": 1}, 400, "temprature"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(live: LiveServer) -> None:
    for body, status, text in BAD:
        code, reply = _post(live, "/v1/chat/completions", body)
        assert code == status, (body, reply)
        assert text in reply["error"]["message"] and reply["error"]["type"], reply
    code, reply = _post(live, "/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert code == 400 and "error" in reply
    code, reply = _post(live, "/v1/completions", {"model": "tiny", "prompt": "x"}, key=None)
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
    ok = live.client().completions.create(model="tiny", prompt="still here", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def _wait_running(live: LiveServer, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not live.engine_loop.snapshot["running"]:
        assert time.time() < deadline, "the request never started"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_client_that_disconnects_is_aborted_and_its_blocks_freed(live: LiveServer,
                                                                  stream: bool) -> None:
    _wait_idle(live)
    free, before = _free_blocks(live), live.engine_loop.snapshot["output_tokens"]
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 200, "ignore_eos": True,
            "stream": stream}
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", live.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(data)).encode() + b"\r\n\r\n" + data)
        _wait_running(live)
    _wait_idle(live)
    assert _free_blocks(live) == free
    # aborted, not run to its end (200 tokens): the blocks did not just free themselves
    assert live.engine_loop.snapshot["output_tokens"] - before < 200


def test_load_every_request_answered_once(live: LiveServer) -> None:
    _wait_idle(live)
    free = _free_blocks(live)
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
    _wait_idle(live)
    assert _free_blocks(live) == free


def test_queue_limit_answers_429() -> None:
    server = LiveServer(max_num_seqs=2, max_model_len=128, max_queued_requests=1,
                        max_queued_prompt_tokens=64)
    try:
        # a prompt larger than the token bound alone would never fit: 400, not 429 forever
        status, body = _post(server, "/v1/completions", {
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


@pytest.mark.parametrize("path", ["/v1/models", "/metrics"])
def test_key_required_but_not_for_health(live: LiveServer, path: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(live.base + path, timeout=10)
    assert err.value.code == 401


def test_sigterm_finishes_in_flight_requests_and_exits_0(tmp_path) -> None:
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
                             "--shutdown-grace", "60", "--threads", "1"],
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
        worker = threading.Thread(target=lambda: answer.append(client.completions.create(
            model="tiny", prompt="x", max_tokens=40, extra_body={"ignore_eos": True})))
        worker.start()
        time.sleep(0.5)  # the request is in flight
        proc.send_signal(signal.SIGTERM)
        worker.join(120)
        assert proc.wait(120) == 0
        assert answer and answer[0].usage.completion_tokens == 40  # finished, not cut
    finally:
        if proc.poll() is None:
            proc.kill()


def test_prefix_cache_hits_show_in_the_metrics() -> None:
    """The same 200-token prompt twice: the second resumes at the 128-token boundary (the same
    completion), and /metrics counts the hit."""
    server = LiveServer(max_num_seqs=4, max_model_len=256, block_size=128,
                        enable_prefix_caching=True, prefill_mode="full")
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
    finally:
        server.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_a_failed_engine_answers_503_and_never_hangs(stream: bool) -> None:
    """The engine fails under a request: a non-streaming one gets 503, a stream already
    answering ends with finish_reason `abort` and an error event; later requests get 503 at
    once and /health says so."""
    server = LiveServer(max_num_seqs=2, max_model_len=128)
    try:
        step, calls = server.llm.engine.step, [0]

        def fails_later() -> None:
            calls[0] += 1
            if calls[0] > 3:
                raise RuntimeError("boom")
            step()

        server.llm.engine.step = fails_later
        body = {"model": "tiny", "prompt": "x", "max_tokens": 40, "ignore_eos": True,
                "stream": stream}
        if stream:
            req = urllib.request.Request(server.base + "/v1/completions",
                                         data=json.dumps(body).encode(), headers={
                                             "Content-Type": "application/json",
                                             "Authorization": f"Bearer {API_KEY}"})
            with urllib.request.urlopen(req, timeout=60) as r:
                lines = [line.decode().strip() for line in r if line.strip()]
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            reasons = [c["finish_reason"] for e in events for c in e.get("choices", ())]
            assert any(e.get("choices") and e["choices"][0]["text"] for e in events)
            assert reasons[-1] == "abort" and "boom" in events[-1]["error"]["message"], events
            assert lines[-1] == "data: [DONE]"
        else:
            status, first = _post(server, "/v1/completions", body)
            assert status == 503 and first["error"]["type"] == "server_error", first
        status, later = _post(server, "/v1/completions", dict(body, stream=False))
        assert status == 503 and "boom" in later["error"]["message"], later
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(server.base + "/health", timeout=10)
        assert err.value.code == 503
    finally:
        server.stop()


def test_speculative_acceptance_shows_in_the_metrics() -> None:
    """With speculative decoding, /metrics counts the drafts verified and accepted per draft
    position and the verifying rows, consistent with the totals."""
    server = LiveServer(max_num_seqs=2, max_model_len=128, speculative=True)
    try:
        server.client().completions.create(model="tiny", prompt="spec", max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
        _wait_idle(server)
        req = urllib.request.Request(server.base + "/metrics",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            lines = r.read().decode().splitlines()

        def values(prefix: str) -> list[float]:
            return [float(line.split()[-1]) for line in lines if line.startswith(prefix)]

        proposed_at = values("shoal_drafts_proposed_at_total{")
        assert proposed_at and proposed_at[0] > 0
        assert sum(proposed_at) == values("shoal_drafts_proposed_total ")[0]
        assert sum(values("shoal_drafts_accepted_at_total{")) == \
            values("shoal_drafts_accepted_total ")[0]
        assert values("shoal_spec_verify_rows_total ")[0] == proposed_at[0]
    finally:
        server.stop()


BOUNDED_TOOLS = [  # arguments of bounded length: random weights finish the call
    {"type": "function", "function": {"name": "set_units", "parameters": {
        "type": "object", "required": ["units", "days"],
        "properties": {"units": {"enum": ["metric", "imperial"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}},
    {"type": "function", "function": {"name": "reset", "parameters": {"type": "object"}}},
]


def test_tool_choice_forces_a_call(tmp_path) -> None:
    """tool_choice naming a function, or "required" without parallel calls: the reply is one
    call of an allowed tool with arguments valid against its schema, streamed or not. The
    tools' preamble needs more than tiny's 256 positions: a tiny checkpoint with 1024."""
    import dataclasses

    from shoal.checkpoint.writer import write_checkpoint
    from shoal.model.presets import TINY

    ckpt = write_checkpoint(dataclasses.replace(TINY, max_position_embeddings=1024),
                            tmp_path / "tiny-1k")
    server = LiveServer(model=str(ckpt), max_num_seqs=2, max_model_len=1024)
    try:
        client = server.client(timeout=120)
        base = {"model": "tiny", "messages": [{"role": "user", "content": "metric please"}],
                "tools": BOUNDED_TOOLS, "max_tokens": 120, "temperature": 0.8, "seed": 4,
                "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
        named = client.chat.completions.create(**base, tool_choice={
            "type": "function", "function": {"name": "set_units"}})
        (call,) = named.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "set_units" and named.choices[0].finish_reason == \
            "tool_calls"
        assert args["units"] in ("metric", "imperial") and 1 <= args["days"] <= 14
        required = client.chat.completions.create(**base, tool_choice="required",
                                                  parallel_tool_calls=False, stream=True)
        deltas = [c.choices[0] for c in required if c.choices]
        names = [t.function.name for d in deltas for t in (d.delta.tool_calls or [])
                 if t.function.name]
        assert len(names) == 1 and names[0] in ("set_units", "reset")
        assert deltas[-1].finish_reason == "tool_calls"
        with pytest.raises(openai.BadRequestError, match="no function named"):
            client.chat.completions.create(**base, tool_choice={
                "type": "function", "function": {"name": "missing"}})
    finally:
        server.stop()


def test_several_prompts_in_one_completion_request(live: LiveServer) -> None:
    """A list of prompts is several requests: choice i * n + j is prompt i's j-th completion,
    each as its own request gives it, streamed or not; one bad prompt refuses them all."""
    client = live.client()
    args = {"model": "tiny", "max_tokens": 5, "temperature": 0.9, "seed": 21, "n": 2}
    prompts = ["first prompt", "the second"]
    alone = [[c.text for c in client.completions.create(prompt=p, **args).choices]
             for p in prompts]
    both = client.completions.create(prompt=prompts, **args)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == alone[0] + alone[1]
    assert both.usage.completion_tokens == 20
    chunks = list(client.completions.create(prompt=prompts, stream=True,
                                            stream_options={"include_usage": True}, **args))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(4)]
    assert texts == alone[0] + alone[1] and chunks[-1].usage.completion_tokens == 20
    ids = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    _wait_idle(live)
    free = _free_blocks(live)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt=["fine", "word " * 400], max_tokens=50)
    _wait_idle(live)
    assert _free_blocks(live) == free


def test_echo_returns_the_prompt_and_its_logprobs(live: LiveServer) -> None:
    """`echo` puts the prompt before each choice; with `logprobs` the prompt's tokens come
    first with their log-probs (none for the first token), as a scoring client reads them."""
    client = live.client()
    prompt = [5, 6, 7, 8]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, logprobs=1,
                                      temperature=0)
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, logprobs=1,
                                       temperature=0, echo=True)
    text = live.llm.tokenizer.decode(prompt)
    (choice,) = echoed.choices
    assert choice.text == text + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 2 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[len(prompt):] == plain.choices[0].logprobs.token_logprobs
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                              temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    with pytest.raises(openai.BadRequestError, match="echo"):
        list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, logprobs=1,
                                       echo=True, stream=True))
