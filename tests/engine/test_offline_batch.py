"""Offline batches as users run them: no input aborts a batch, an interrupt leaves the LLM
usable, output in input order with resume after a killed run, checks before the model loads,
and `shoal run-batch` in the OpenAI batch format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal import LLM, SamplingParams
from shoal.cli import main
from shoal.config import ShoalError
from shoal.offline.output import ResultWriter, written_keys
from support.interrupt import interrupt_after

OPTS = {"device": "cpu", "max_num_seqs": 8, "max_model_len": 64}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CLI = ["--model", "tiny", "--device", "cpu", "--max-model-len", "64", "--max-tokens", "3",
       "--quiet"]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _without_latency(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "latency_s"} for r in records]


BAD_IDS = {  # prompt_token_ids value -> what the error names
    "[1, null]": "prompt_token_ids[1]", "[[1, 2]]": "prompt_token_ids[0]",
    "5": "expected a list", "[1.7, 2.2]": "prompt_token_ids[0]", '"abc"': "expected a list",
    "[]": "empty", "[1, 99999]": "vocabulary",
}


def test_bad_token_ids_are_per_request_errors_through_the_api() -> None:
    llm = LLM("tiny", **OPTS)
    prompts = [{"prompt_token_ids": json.loads(v)} for v in BAD_IDS] + [[5, 6, 7]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(outs) == len(BAD_IDS) + 1
    for out, expected in zip(outs, BAD_IDS.values(), strict=False):
        assert out.error is not None and expected in out.error, (out.error, expected)
    assert outs[-1].error is None and len(outs[-1].outputs[0].token_ids) == 4
    assert not llm.engine.requests and not llm.engine.scheduler.has_unfinished()
    (bad,) = llm.generate([[5, 6]], ["not params"], use_tqdm=False)  # type: ignore[list-item]
    assert bad.error is not None and "SamplingParams" in bad.error


def test_every_bad_line_becomes_its_entry(tmp_path: Path, capsys) -> None:
    lines = [f'{{"prompt_token_ids": {v}}}' for v in BAD_IDS] + [
        '{"prompt": "hi", "temprature": 0.5, "custom_id": "typo"}', "5", "[1, 2]",
        '{"prompt": "x", "temperature": "hot"}', '{"prompt": "x", "custom_id": 7}',
        '{"prompt": "x", "structured": "a+"}', '{"prompt": "fine", "custom_id": "ok"}']
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["generate", *CLI, "--input", str(src), "--output", str(dst)]) == 0
    records = _records(dst)
    assert [r["line"] for r in records] == list(range(1, len(lines) + 1))  # input order
    for r, expected in zip(records, BAD_IDS.values(), strict=False):
        assert expected in r["error"] and r["error"].startswith(f"line {r['line']}: ")
    typo, obj5, list12, hot, cid, structured, ok = records[len(BAD_IDS):]
    assert "error" not in typo and typo["custom_id"] == "typo"
    assert "unknown field 'temprature'" in capsys.readouterr().err
    assert obj5["error"].startswith(f"line {obj5['line']}:") and "JSON object" in obj5["error"]
    assert "JSON object" in list12["error"] and "temperature" in hot["error"]
    assert "custom_id" in cid["error"] and "structured" in structured["error"]
    assert "error" not in ok and ok["custom_id"] == "ok" and len(ok["outputs"][0]["token_ids"])
    strict = tmp_path / "strict.jsonl"
    assert main(["generate", *CLI, "--input", str(src), "--output", str(strict),
                 "--strict"]) == 0
    assert "unknown field" in _records(strict)[len(BAD_IDS)]["error"]


@pytest.mark.parametrize("async_scheduling, speculative",
                         [(False, False), (True, False), (True, True)])
def test_interrupt_leaves_the_llm_usable(async_scheduling: bool, speculative: bool) -> None:
    """An interrupt before, during and well into a run: the LLM serves the next request with
    the same tokens and no leaked block (with speculative decoding: a verify step planned on
    drafts in flight is settled too)."""
    llm = LLM("tiny", async_scheduling=async_scheduling, speculative=speculative,
              spec_overlap=speculative, **{**OPTS, "max_model_len": 256})
    free = llm.engine.scheduler.usage().num_free_blocks
    (expected,) = LLM("tiny", **OPTS).generate([[9, 8, 7]], GREEDY, use_tqdm=False)
    long = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)  # seconds of work
    for delay in (0.05, 0.4, 1.2):  # before, during and well into the run
        with pytest.raises(KeyboardInterrupt), interrupt_after(delay):
            llm.generate([[5, 6, 7]] * 6, long, use_tqdm=False)
        (out,) = llm.generate([[9, 8, 7]], GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert llm.engine.scheduler.usage().num_free_blocks == free  # no leaked block
        assert not llm.engine.requests and not llm.engine.in_flight


def test_result_writer_orders_by_input() -> None:
    import io

    stream = io.StringIO()
    writer = ResultWriter(stream, "input")
    for position in (2, 0, 3, 1):
        writer.add(position, {"line": position + 1})
    assert [json.loads(x)["line"] for x in stream.getvalue().splitlines()] == [1, 2, 3, 4]
    completion = io.StringIO()
    writer = ResultWriter(completion, "completion")
    for position in (2, 0):
        writer.add(position, {"line": position + 1})
    assert [json.loads(x)["line"] for x in completion.getvalue().splitlines()] == [3, 1]


@pytest.mark.parametrize("stop, status", [
    (KeyboardInterrupt(), 130),
    (ShoalError("data-parallel replica 1: replica(s) exited: rank 1 (exit code -9)"), 1)],
    ids=["ctrl-c", "dead-replica"])
def test_resume_after_a_killed_run_equals_an_uninterrupted_run(
        tmp_path: Path, monkeypatch, capsys, stop: BaseException, status: int) -> None:
    """Sampled without seeds: a resumed request keeps the seed of its place in the input."""
    prompts = [{"prompt_token_ids": [5 + i, 6, 7 + i % 3]} for i in range(7)]
    prompts[3] = {"prompt": "a text prompt", "custom_id": "text"}
    prompts[5]["seed"] = 11
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(p) for p in prompts) + "\n", encoding="utf-8")
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    cli = [*CLI, "--temperature", "1.0"]
    assert main(["generate", *cli, "--input", str(src), "--output", str(whole)]) == 0
    run = LLM.run

    def killed_run(self, items, use_tqdm=True):  # Ctrl-C or a dead replica after 4 results
        for n, pair in enumerate(run(self, items, use_tqdm)):
            if n == 4:
                raise stop
            yield pair

    monkeypatch.setattr(LLM, "run", killed_run)
    capsys.readouterr()
    assert main(["generate", *cli, "--input", str(src), "--output", str(part)]) == status
    err = capsys.readouterr().err
    assert "4 of 7 requests finished" in err and "--resume runs the rest" in err, err
    if isinstance(stop, ShoalError):
        assert "rank 1" in err
    monkeypatch.setattr(LLM, "run", run)
    written = _records(part)
    assert 0 < len(written) <= 4 and [r["line"] for r in written] == list(
        range(1, len(written) + 1))
    with part.open("a", encoding="utf-8") as f:  # a kill in the middle of a line
        f.write('{"line": 99, "prom')
    assert main(["generate", *cli, "--input", str(src), "--output", str(part),
                 "--resume"]) == 0
    assert _without_latency(_records(part)) == _without_latency(_records(whole))
    assert written_keys(str(part)) >= {"id:text", "line:1", "line:7"}


def test_resume_keeps_every_whole_result_and_names_a_foreign_line(tmp_path: Path) -> None:
    """Only a last line without its newline is cut; blank lines are skipped; a line that is not
    a result stops --resume with its number, the file untouched."""
    out = tmp_path / "out.jsonl"
    out.write_text('{"line": 1}\n\n{"custom_id": "b", "line": 2}\n{"line": 3, "pro',
                   encoding="utf-8")
    assert written_keys(str(out)) == {"line:1", "id:b"}
    assert out.read_text(encoding="utf-8") == '{"line": 1}\n\n{"custom_id": "b", "line": 2}\n'
    bad = '{"line": 1}\nnotes by hand\n{"line": 2}\n'
    out.write_text(bad, encoding="utf-8")
    with pytest.raises(ShoalError, match="line 2 of .* is not a result"):
        written_keys(str(out))
    assert out.read_text(encoding="utf-8") == bad


def test_checks_before_the_model_loads(tmp_path: Path, monkeypatch, capsys) -> None:
    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("shoal.llm.LLM.__init__", no_load)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x"}\n', encoding="utf-8")
    cases = [
        (["--input", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        (["--input", str(src), "--output", str(tmp_path / "no" / "dir" / "o.jsonl")],
         "not writable"),
        (["--input", str(src), "--device", "tpu"], "device"),
        (["--input", str(src), "--max-model-len", "100000"], "256 positions"),
        (["--input", str(src), "--prompt", "y"], "give one of them"),
    ]
    for extra, message in cases:
        args = ["generate", "--model", "tiny", "--device", "cpu", *extra]
        assert main(args) == 2
        assert message in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--threads", "0", "--prompt", "x"]) == 2
    for extra, message in ((["--reasoning-effort", "bogus"], "reasoning_effort"),
                           (["--temperature", "-1"], "temperature"),
                           (["--max-tokens", "0"], "max_tokens")):
        assert main(["chat", "--model", "tiny", "--device", "cpu", *extra]) == 2
        assert message in capsys.readouterr().err
    assert main(["info", "--model", "tiny", "--max-model-len", "300"]) == 2
    assert "256 positions" in capsys.readouterr().err


def test_every_sampling_field_has_a_flag(tmp_path: Path) -> None:
    dst = tmp_path / "o.jsonl"
    assert main(["generate", *CLI, "--prompt", "hello", "--output", str(dst), "--n", "2",
                 "--request-seed", "3", "--min-p", "0.1", "--presence-penalty", "0.5",
                 "--logprobs", "2", "--prompt-logprobs", "1", "--temperature", "0.8",
                 "--threads", "1", "--regex", "[ab]+", "--output-order", "completion"]) == 0
    (rec,) = _records(dst)
    assert len(rec["outputs"]) == 2 and all(set(c["text"]) <= set("ab") for c in rec["outputs"])
    for c in rec["outputs"]:  # each position: the top 2 and the sampled token, by rank
        assert len(c["logprobs"]) == len(c["token_ids"])
        assert abs(sum(e["logprob"] for e in _chosen(c)) - c["cumulative_logprob"]) < 1e-4
        for position, token in zip(c["logprobs"], c["token_ids"], strict=True):
            assert [e["rank"] for e in position] == sorted(e["rank"] for e in position)
            assert {1, 2} <= {e["rank"] for e in position} and token in {
                e["token_id"] for e in position}
            assert all(isinstance(e["token"], str) for e in position)
    prompt_lp = rec["prompt_logprobs"]
    assert prompt_lp[0] is None and all(len(p) in (1, 2) for p in prompt_lp[1:])


def _chosen(completion: dict) -> list[dict]:
    return [next(e for e in position if e["token_id"] == token)
            for position, token in zip(completion["logprobs"], completion["token_ids"],
                                       strict=True)]


def test_run_batch_round_trip(tmp_path: Path, capsys) -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                  "max_completion_tokens": 3, "temperature": 0}},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": "once upon", "max_tokens": 2, "seed": 4,
                  "temperature": 0.7, "stop": "zz"}},
        {"custom_id": "cmpl-ids", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [5, 6, 7], "max_tokens": 2}},
        {"custom_id": "cmpl-bias", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [5, 6, 7], "max_tokens": 2, "logit_bias": {"100": 100}}},
        {"custom_id": "cmpl-allowed", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [5, 6, 7], "max_tokens": 2, "allowed_token_ids": [100]}},
        {"custom_id": "bad-bias", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [5, 6, 7], "logit_bias": {"100": 101}}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {"custom_id": "bad-field", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "temprature": 1}},
    ]
    src, dst = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    assert main(["run-batch", "--model", "tiny", "--device", "cpu", "--max-model-len", "128",
                 "-i", str(src), "-o", str(dst), "--quiet"]) == 0
    results = _records(dst)
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
    chat, cmpl, ids, bias, allowed, bad_bias, bad_url, bad_field = results
    body = ChatCompletion.model_validate(chat["response"]["body"])
    assert chat["response"]["status_code"] == 200 and body.usage.completion_tokens <= 3
    for r in (cmpl, ids):
        done = Completion.model_validate(r["response"]["body"])
        assert r["response"]["status_code"] == 200 and done.usage.completion_tokens == 2
    forced = [Completion.model_validate(r["response"]["body"]).choices[0].text
              for r in (bias, allowed)]
    assert forced[0] == forced[1] != Completion.model_validate(
        ids["response"]["body"]).choices[0].text  # token 100 twice, both ways
    for r, message in ((bad_bias, "logit_bias"), (bad_url, "url")):
        assert r["response"]["status_code"] == 400
        assert message in r["response"]["body"]["error"]["message"]
    assert bad_field["response"]["status_code"] == 200  # ignored, as the server does
    assert "line 8: body field(s) ignored: temprature" in capsys.readouterr().err
    assert main(["run-batch", "--model", "tiny", "--device", "cpu", "--max-model-len", "128",
                 "-i", str(src), "-o", str(dst), "--quiet", "--resume"]) == 0
    assert len(_records(dst)) == len(lines)  # everything was there: nothing appended


def test_run_batch_answers_what_the_server_would(tmp_path: Path) -> None:
    """Bodies go through the server's request models and response bodies: OpenAI defaults
    (temperature 1, 16 completion tokens), max_completion_tokens over max_tokens, logprobs,
    response_format / guided_*, echo, a list of prompts; a flag fills only what a body leaves
    unset; a line without a custom_id is resumed by its line number; errors as vLLM's."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    def post(url: str, body: dict, custom_id: str | None = "x") -> dict:
        line = {"method": "POST", "url": url, "body": body}
        return line if custom_id is None else {"custom_id": custom_id, **line}

    chat, cmpl = "/v1/chat/completions", "/v1/completions"
    hello = [{"role": "user", "content": "hello"}]
    lines = [
        post(cmpl, {"prompt": [5, 6, 7], "seed": 1}, "default-1"),
        post(cmpl, {"prompt": [5, 6, 7], "seed": 2}, "default-2"),
        post(chat, {"messages": hello, "max_tokens": 5, "max_completion_tokens": 2}, "both"),
        post(chat, {"messages": hello, "max_completion_tokens": 3, "logprobs": True,
                    "top_logprobs": 2}, "chat-lp"),
        post(cmpl, {"prompt": ["ab", "cd"], "max_tokens": 2, "logprobs": 1, "echo": True,
                    "n": 2}, "prompts"),
        post(cmpl, {"prompt": [5, 6], "guided_choice": ["yes", "no"]}, "choice"),
        post(cmpl, {"prompt": [5, 6], "max_tokens": 0}, None),
    ]
    src, dst = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    run = ["run-batch", "--model", "tiny", "--device", "cpu", "--max-model-len", "128",
           "-i", str(src), "-o", str(dst), "--quiet", "--ignore-eos"]
    assert main(run) == 0
    results = _records(dst)
    d1, d2, both, chat_lp, prompts, choice, bad = results
    bodies = [Completion.model_validate(r["response"]["body"]) for r in (d1, d2)]
    assert all(b.usage.completion_tokens == 16 for b in bodies)  # OpenAI's default
    assert bodies[0].choices[0].text != bodies[1].choices[0].text  # sampled (temperature 1)
    assert ChatCompletion.model_validate(both["response"]["body"]).usage.completion_tokens <= 2
    lp = ChatCompletion.model_validate(chat_lp["response"]["body"]).choices[0].logprobs
    assert lp is not None and lp.content and all(len(t.top_logprobs) == 2 for t in lp.content)
    many = prompts["response"]["body"]["choices"]  # (an echoed first token's logprob is null,
    assert [c["index"] for c in many] == [0, 1, 2, 3]  # as OpenAI's; the SDK's type says float)
    assert [c["text"][:2] for c in many] == ["ab", "ab", "cd", "cd"]  # echoed
    assert all(c["logprobs"]["token_logprobs"][0] is None and len(c["logprobs"]["tokens"]) > 2
               for c in many)
    assert Completion.model_validate(choice["response"]["body"]).choices[0].text in (
        "yes", "no")
    assert bad["custom_id"] is None and bad["line"] == 7 and bad["response"][
        "status_code"] == 400 and bad["error"] == "line 7: custom_id: expected a string"
    assert bad["response"]["body"]["error"]["message"] == bad["error"]
    assert main([*run, "--resume"]) == 0
    assert len(_records(dst)) == len(lines)  # the line without a custom_id is not run again


def test_run_batch_flags_fill_only_what_a_body_leaves_unset() -> None:
    from shoal.offline.openai_batch import parse_batch_line

    def params(body: dict):
        line = {"custom_id": "a", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "hi"}], **body}}
        (item,) = parse_batch_line(json.dumps(line), 1, "tiny", {
            "max_tokens": 3, "temperature": 0.5, "logprobs": 1}).items
        return item["sampling_params"]

    p = params({"max_completion_tokens": 7, "temperature": 0.0})
    assert (p.max_tokens, p.temperature, p.logprobs) == (7, 0.0, 1)
    p = params({"logprobs": True, "top_logprobs": 4})
    assert (p.max_tokens, p.temperature, p.logprobs) == (3, 0.5, 4)
    p = params({"response_format": {"type": "json_object"}})
    assert p.structured is not None and p.structured.json_schema is not None
    line = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 0}}
    bad = parse_batch_line(json.dumps(line), 4, "tiny", {})
    assert bad.body is None and bad.items[0]["error"].startswith("line 4: body.max_tokens")


def test_run_batch_answers_responses_bodies(tmp_path: Path) -> None:
    """A /v1/responses line is answered as the server would: a `response` whose text is the
    chat completion's of the same messages; previous_response_id is a 400 (a batch stores
    none); flags fill what the body leaves unset."""
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    from shoal.offline.openai_batch import parse_batch_line

    hello = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    lines = [
        {"custom_id": "resp", "url": "/v1/responses", "body": {
            "instructions": "be brief", "input": "hello", "max_output_tokens": 6,
            "temperature": 0, "reasoning": {"effort": "high"}}},
        {"custom_id": "chat", "url": "/v1/chat/completions", "body": {
            "messages": hello, "max_completion_tokens": 6, "temperature": 0,
            "reasoning_effort": "high"}},
        {"custom_id": "prev", "url": "/v1/responses", "body": {
            "input": "x", "previous_response_id": "resp_1"}},
    ]
    src, dst = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    assert main(["run-batch", "--model", "tiny", "--device", "cpu", "--max-model-len", "128",
                 "-i", str(src), "-o", str(dst), "--quiet"]) == 0
    resp, chat, prev = _records(dst)
    r = Response.model_validate(resp["response"]["body"])
    message = ChatCompletion.model_validate(chat["response"]["body"]).choices[0].message
    assert r.status == "incomplete" and r.usage.output_tokens == 6
    reasoning = "".join(p.text for i in r.output if i.type == "reasoning" for p in i.content)
    assert reasoning == message.reasoning_content and r.output_text == (message.content or "")
    assert prev["response"]["status_code"] == 400 and "previous_response_id" in prev["error"]
    line = {"custom_id": "a", "url": "/v1/responses", "body": {"input": "hi"}}
    (item,) = parse_batch_line(json.dumps(line), 1, "tiny", {"max_tokens": 3}).items
    assert item["sampling_params"].max_tokens == 3
