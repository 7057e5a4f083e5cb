"""`shoal serve` beyond the basics, through the real `openai` client on tiny (CPU, loopback): a
list of prompts in one completion request, `echo`, forced tool calls, speculative metrics, and
an engine that fails under requests."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from support.live_server import API_KEY, LiveServer, free_blocks, post, wait_idle


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
            status, first = post(server, "/v1/completions", body)
            assert status == 503 and first["error"]["type"] == "server_error", first
        status, later = post(server, "/v1/completions", dict(body, stream=False))
        assert status == 503 and "boom" in later["error"]["message"], later
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(server.base + "/health", timeout=10)
        assert err.value.code == 503
    finally:
        server.stop()


def test_speculative_acceptance_shows_in_the_metrics() -> None:
    """With speculative decoding, /metrics counts the drafts verified and accepted per draft
    position and the verifying rows, consistent with the totals, and one inter-token latency
    sample per output token after the first."""
    server = LiveServer(max_num_seqs=2, max_model_len=128, speculative=True)
    try:
        server.client().completions.create(model="tiny", prompt="spec", max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
        wait_idle(server)
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
        # one inter-token sample per token after the first, accepted drafts included
        assert values("shoal_inter_token_latency_seconds_count")[0] == 11
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
                "tools": BOUNDED_TOOLS, "max_tokens": 240, "temperature": 0.8, "seed": 4,
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
    wait_idle(live)
    free = free_blocks(live)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt=["fine", "word " * 400], max_tokens=50)
    wait_idle(live)
    assert free_blocks(live) == free


def test_echo_returns_the_prompt_and_its_logprobs(live: LiveServer) -> None:
    """`echo` puts the prompt before each choice; with `logprobs` the prompt's tokens come
    first with their log-probs (none for the first token), as a scoring client reads them,
    streamed or not."""
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
    for given, extra in ((prompt, {}), (text, {}), (prompt, {"truncate_prompt_tokens": 3})):
        # streamed with log-probs: the same tokens and log-probs
        whole = client.completions.create(model="tiny", prompt=given, max_tokens=2, logprobs=1,
                                          temperature=0, echo=True, extra_body=extra).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(
            model="tiny", prompt=given, max_tokens=2, logprobs=1, temperature=0, echo=True,
            stream=True, extra_body=extra) if c.choices]
        got = [x for c in chunks if c.logprobs for x in zip(
            c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.text_offset, strict=True)]
        assert "".join(c.text for c in chunks) == whole.text
        assert got == list(zip(whole.logprobs.tokens, whole.logprobs.token_logprobs,
                               whole.logprobs.text_offset, strict=True))


def test_logit_bias_and_allowed_token_ids(live: LiveServer) -> None:
    """OpenAI's `logit_bias` (+100 forces a token, -100 bans it) and vLLM's
    `allowed_token_ids` reach the sampler (vLLM's `priority` is taken too); a bias out of
    range is a 400."""
    client = live.client()
    args = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    forced = live.llm.tokenizer.decode([100] * 3)
    got = client.completions.create(logit_bias={"100": 100}, **args)
    assert got.choices[0].text == forced
    got = client.completions.create(extra_body={"allowed_token_ids": [100], "priority": -3},
                                    **args)
    assert got.choices[0].text == forced
    for bias, token in ((-100, 200), (100, 100)):  # between two allowed tokens
        got = client.completions.create(logit_bias={"100": bias},
                                        extra_body={"allowed_token_ids": [100, 200]}, **args)
        assert got.choices[0].text == live.llm.tokenizer.decode([token] * 3)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(logit_bias={"100": 300}, **args)


def test_tokenize_and_detokenize(live: LiveServer) -> None:
    """/tokenize gives the ids the generation endpoints feed the engine (a prompt; chat
    messages with their template: the same prompt_tokens as the chat request reports), and
    /detokenize turns ids back into text; bad input is a 400, another model a 404."""
    tok = live.llm.tokenizer
    status, got = post(live, "/tokenize", {"model": "tiny", "prompt": "hello there",
                                           "return_token_strs": True})
    ids = tok.encode("hello there", add_special_tokens=True)
    assert status == 200 and got["tokens"] == ids and got["count"] == len(ids)
    assert got["max_model_len"] == live.llm.config.scheduler.max_model_len
    assert got["token_strs"] == [tok.id_to_token(t) for t in ids]
    messages = [{"role": "user", "content": "what is two and two?"}]
    status, chat_ids = post(live, "/tokenize", {"messages": messages})
    done = live.client().chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert status == 200 and chat_ids["count"] == done.usage.prompt_tokens
    status, text = post(live, "/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200 and text == {"prompt": tok.decode(ids)}
    for path, body, code in (("/tokenize", {"prompt": "x", "messages": messages}, 400),
                             ("/tokenize", {}, 400),
                             ("/detokenize", {"tokens": [-1]}, 400),
                             ("/detokenize", {"tokens": "abc"}, 400),
                             ("/tokenize", {"model": "other", "prompt": "x"}, 404)):
        status, _ = post(live, path, body)
        assert status == code, (path, body, status)


def test_continue_final_message(live: LiveServer) -> None:
    """vLLM's `continue_final_message`: the final assistant message is a prefix the model
    continues (no end of turn, no new generation prompt), in /v1/chat/completions and
    /tokenize alike; without a final assistant message it is a 400."""
    messages = [{"role": "user", "content": "name a colour"},
                {"role": "assistant", "content": "The colour is"}]
    _, cont = post(live, "/tokenize", {"messages": messages, "continue_final_message": True,
                                       "add_generation_prompt": False})
    _, turn = post(live, "/tokenize", {"messages": messages})
    assert cont["count"] < turn["count"]  # no end of turn, no next generation prompt
    assert cont["tokens"] == turn["tokens"][:cont["count"]]
    done = live.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert done.usage.prompt_tokens == cont["count"]
    for body in ({"continue_final_message": True},  # the default add_generation_prompt: fine
                 {"continue_final_message": True, "add_generation_prompt": True},
                 {"continue_final_message": True, "messages": messages[:1]}):
        status, _ = post(live, "/v1/chat/completions",
                         {"model": "tiny", "messages": messages, "max_tokens": 1, **body})
        assert status == (200 if len(body) == 1 else 400), body


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served() -> None:
    from shoal.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from shoal.serve.protocol import usage_of

    def out(prompt: int, cached: int) -> RequestOutput:
        return RequestOutput("r", None, list(range(prompt)),
                             [CompletionOutput(0, "ab", [1, 2], "length")],
                             metrics=RequestMetrics(0.0, num_cached_tokens=cached))

    assert usage_of(out(300, 256), out(40, 0)) == {
        "prompt_tokens": 340, "completion_tokens": 4, "total_tokens": 344,
        "prompt_tokens_details": {"cached_tokens": 256}}


def test_max_tokens_defaults_are_openais() -> None:
    """16 for a completion (OpenAI's and vLLM's default), none for a chat answer (it runs until
    it ends or the context is full); an explicit value wins, `max_completion_tokens` first."""
    from shoal.serve.protocol import ChatCompletionRequest, CompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    assert CompletionRequest(model="m", prompt="x").params().max_tokens == 16
    assert CompletionRequest(model="m", prompt="x", max_tokens=None).params().max_tokens is None
    assert ChatCompletionRequest(model="m", messages=messages).params().max_tokens is None
    assert ChatCompletionRequest(model="m", messages=messages, max_tokens=5,
                                 max_completion_tokens=7).params().max_tokens == 7


def test_serve_takes_the_model_as_vllm_serve_does(monkeypatch, tmp_path) -> None:
    """`shoal serve MODEL` (positional, as `vllm serve MODEL`) is `--model MODEL`; the app it
    would run serves that model under its name."""
    import signal

    import uvicorn

    from shoal.checkpoint.writer import write_checkpoint
    from shoal.cli import main
    from shoal.model.presets import TINY

    path = str(write_checkpoint(TINY, tmp_path / "ckpt", seed=0))

    ran = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: ran.update(
        app=self.config.app, port=self.config.port))
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # (cmd_serve replaces handlers)
    assert main(["serve", path, "--device", "cpu", "--max-model-len", "64",
                 "--port", "8123"]) == 0
    assert ran["port"] == 8123 and ran["app"].state.server.model_name == path


def test_continuous_usage_stats(live: LiveServer) -> None:
    """vLLM's `stream_options.continuous_usage_stats`: every chunk carries its request's usage
    so far (its kept prompt tokens, the tokens its choices generated up to that chunk); the
    final usage chunk still sums the request."""
    client = live.client()
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(
        model="tiny", prompt=[[5, 6, 7, 8, 9], [10, 11]], max_tokens=5, n=2, stream=True,
        temperature=1.0, seed=4, stream_options=opts,
        extra_body={"ignore_eos": True, "truncate_prompt_tokens": 4}))
    for prompt, kept in ((0, 4), (1, 2)):
        mine = [c for c in chunks if c.choices and c.choices[0].index // 2 == prompt]
        done = [c.usage.completion_tokens for c in mine]
        assert all(c.usage.prompt_tokens == kept for c in mine)
        assert done == sorted(done) and done[-1] == 10 and done[0] >= 1
        assert all(c.usage.total_tokens == kept + c.usage.completion_tokens for c in mine)
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == 6
    chat = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options=opts, extra_body={"ignore_eos": True}))
    assert chat[0].usage.completion_tokens == 0 and chat[0].choices[0].delta.role
    assert [c.usage.completion_tokens for c in chat[-2:]] == [4, 4]  # finish, usage chunk
    plain = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True))
    assert all(c.usage is None for c in plain)


def test_structured_outputs_as_vllm_takes_them() -> None:
    """vLLM's `structured_outputs` (since v0.12) asks for the same constraint as the older
    `guided_*` and `response_format`; two constraints, or an option this server lacks, are a
    ValueError naming the field (a 400)."""
    from shoal.sampling.structured import StructuredOutputSpec
    from shoal.serve.protocol import ChatCompletionRequest, CompletionRequest

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}

    def spec(**body) -> StructuredOutputSpec | None:
        return CompletionRequest(model="m", prompt="x", **body).params().structured

    pairs = [({"json": schema}, {"guided_json": schema}),
             ({"regex": "[0-9]+"}, {"guided_regex": "[0-9]+"}),
             ({"choice": ["yes", "no"]}, {"guided_choice": ["yes", "no"]}),
             ({"grammar": 'start: "a"'}, {"guided_grammar": 'start: "a"'})]
    for new, old in pairs:
        assert spec(structured_outputs=new) == spec(**old) is not None, new
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 response_format={"type": "json_object"})
    assert spec(structured_outputs={"json_object": True}) == chat.params().structured
    compact = spec(structured_outputs={"json": schema, "disable_any_whitespace": True}).schema
    assert compact == {**schema, "x-guidance": {"whitespace_flexible": False}}
    assert spec(structured_outputs={"disable_fallback": True}) is None
    for body, name in (({"structured_outputs": {"regex": "a", "choice": ["a"]}},
                        "structured_outputs"),
                       ({"structured_outputs": {"regex": "a"}, "guided_regex": "a"},
                        "guided_"),
                       ({"structured_outputs": {"structural_tag": "{}"}},
                        "structured_outputs.structural_tag")):
        with pytest.raises(ValueError, match=name):
            spec(**body)
    with pytest.raises(ValueError, match="response_format"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                              response_format={"type": "json_object"},
                              structured_outputs={"regex": "a"}).params()
