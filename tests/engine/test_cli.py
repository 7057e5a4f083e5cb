"""The `shoal` command line through `shoal.cli.main`: JSONL generate with bad lines (per-line
errors, exit 0), start-up errors (exit 2), `info` (890 KV bytes per token for flash),
`make-checkpoint` then generate from the directory (same tokens as the reference loop, whose
weights are the preset's), and `demo`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.refloop import assert_greedy, main_prompts
from shoal.checkpoint.writer import write_checkpoint
from shoal.cli import main
from shoal.model.presets import TINY
from shoal.tokenizer.encoding import encode_messages

MAX_TOKENS = 3
GREEDY_ARGS = ["--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--quiet"]


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_generate_jsonl_with_bad_lines(tmp_path: Path) -> None:
    ps = main_prompts()
    ref = ps.refs()[0]
    text = ps.texts[0]
    messages = [{"role": "user", "content": "hello there"}]
    lines = ['{"prompt": "unterminated', '{"temperature": 0.5}', json.dumps({"prompt": text}),
             json.dumps({"messages": messages})]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rc = main(["generate", "--model", "tiny", "--device", "cpu", "--input", str(src),
               "--output", str(dst), "--no-async-scheduling", *GREEDY_ARGS])  # (sync loop)
    assert rc == 0
    records = _records(dst.read_text(encoding="utf-8"))
    assert len(records) == len(lines)
    errors = sorted(r["error"] for r in records if "error" in r)
    assert len(errors) == 2
    assert errors[0].startswith("line 1:") and errors[1].startswith("line 2:")
    assert "prompt" in errors[1]  # names what the line lacks
    (plain,) = [r for r in records if r.get("prompt") == text]
    assert "error" not in plain
    (c,) = plain["outputs"]
    assert_greedy(c["token_ids"], c["finish_reason"], ref, MAX_TOKENS)
    chat_prompt = encode_messages(messages)
    (chat,) = [r for r in records if r.get("prompt") == chat_prompt]
    assert "error" not in chat
    (c,) = chat["outputs"]
    assert len(c["token_ids"]) <= MAX_TOKENS
    assert "reasoning_content" in c and "content" in c  # the thinking prompt's parse fields


def test_bad_model_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", "no/such/model", "--device", "cpu", "--prompt", "x"])
    assert rc == 2
    assert "no/such/model" in capsys.readouterr().err


def test_info_flash_kv_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--model", "flash"]) == 0
    assert "KV bytes per context token: 890;" in capsys.readouterr().out


def test_make_checkpoint_cli(tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny-ckpt"
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(ckpt)]) == 0
    assert (ckpt / "config.json").exists() and (ckpt / "tokenizer.json").exists()
    assert list(ckpt.glob("*.safetensors"))


def test_generate_from_checkpoint_dir(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint written with the preset's seed generates the reference loop's tokens."""
    ps = main_prompts()
    ckpt = write_checkpoint(TINY, tmp_path / "tiny-ckpt", seed=0)
    rc = main(["generate", "--model", str(ckpt), "--device", "cpu", "--prompt", ps.texts[0],
               *GREEDY_ARGS])
    assert rc == 0
    (record,) = _records(capsys.readouterr().out)
    (c,) = record["outputs"]
    assert_greedy(c["token_ids"], c["finish_reason"], ps.refs()[0], MAX_TOKENS)


def test_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in records] == ["The quick brown fox", "Hello, shoal!",
                                              "def add(a, b):"]
    assert all(r["finish_reason"] in ("stop", "length") for r in records)


def test_chat_cli_two_turns(monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """`shoal chat`: each turn is sent with the conversation so far (user, assistant, user);
    an empty line quits."""
    import shoal.tokenizer.encoding as encoding

    lines = iter(["hello", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    seen: list[list[str]] = []
    original = encoding.encode_messages

    def encode(messages, *args, **kwargs):
        seen.append([m["role"] for m in messages])
        return original(messages, *args, **kwargs)

    monkeypatch.setattr(encoding, "encode_messages", encode)
    assert main(["chat", "--model", "tiny", "--device", "cpu", "--max-tokens", "3",
                 "--temperature", "0"]) == 0
    assert seen == [["user"], ["user", "assistant", "user"]]
    assert "error" not in capsys.readouterr().out


def test_generate_with_prefix_caching_reports_the_hits(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Three requests sharing a 200-token prompt prefix, then the flags of the cache: the later
    two resume at the 128-token block boundary (a one-step wait for the first one's blocks),
    their outputs equal a run without the cache, and the summary counts the hits."""
    prefix = [3 + (11 * i) % 400 for i in range(200)]
    lines = [json.dumps({"prompt_token_ids": prefix + [5 + i]}) for i in range(3)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    common = ["generate", "--model", "tiny", "--device", "cpu", "--input", str(src),
              "--max-model-len", "256", "--block-size", "128", "--prefill-mode", "full",
              *GREEDY_ARGS]
    outs = []
    for extra in ([], ["--enable-prefix-caching", "--num-prefix-snapshots", "4",
                       "--kv-host-memory-gb", "0.01", "--kv-store-path",
                       str(tmp_path / "kv")]):
        dst = tmp_path / f"out{len(outs)}.jsonl"
        assert main([*common, "--output", str(dst), *extra]) == 0
        outs.append([r["outputs"] for r in _records(dst.read_text(encoding="utf-8"))])
    assert outs[0] == outs[1]
    err = capsys.readouterr().err
    assert "prefix cache: 256/603 prompt tokens hit (42%; 0 from host memory, 0 from the " \
           "store)" in err, err


def test_backends_flag_sets_the_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--backends a,b` reaches RunnerConfig.backends (on the CPU neither loads: the
    reference serves every op)."""
    from shoal.config import EngineConfig

    seen = []
    create = EngineConfig.create.__func__

    def spy(cls, model, **opts):
        config = create(cls, model, **opts)
        seen.append(config.runner.backends)
        return config

    monkeypatch.setattr(EngineConfig, "create", classmethod(spy))
    assert main(["generate", "--model", "tiny", "--device", "cpu", "--backends", "cuda,triton",
                 "--prompt", "x", *GREEDY_ARGS]) == 0
    assert seen and all(b == ("cuda", "triton") for b in seen)


def test_threads_default_to_omp_num_threads_else_the_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    from types import SimpleNamespace

    import torch

    from shoal.cli import _threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _threads(SimpleNamespace(threads=None))
    assert torch.get_num_threads() == 1
    for unset in ("", "0", "2,1"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        _threads(SimpleNamespace(threads=None))
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    _threads(SimpleNamespace(threads=1))  # the flag wins
    assert torch.get_num_threads() == 1


def test_kv_store_max_gb_flag_reaches_the_config_and_is_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """`--kv-store-max-gb` reaches CacheConfig.kv_store_max_gb (checked before the model
    loads); a bad value exits 2 with one line naming the option."""
    from shoal.config import EngineConfig, ShoalError

    seen = []
    create = EngineConfig.create.__func__

    def spy(cls, model, **opts):
        seen.append(create(cls, model, **opts).cache.kv_store_max_gb)
        raise ShoalError("stop before the model loads")

    store = ["generate", "--model", "tiny", "--device", "cpu", "--prompt", "x",
             "--enable-prefix-caching", "--kv-store-path", str(tmp_path / "kv"), *GREEDY_ARGS]
    with monkeypatch.context() as m:
        m.setattr(EngineConfig, "create", classmethod(spy))
        assert main([*store, "--kv-store-max-gb", "2.5"]) == 2
    assert seen == [2.5]
    capsys.readouterr()
    for value, message in (("0", "kv_store_max_gb: got 0.0, expected a size in GB > 0"),
                           ("nan", "kv_store_max_gb: got nan"),
                           ("inf", "kv_store_max_gb: got inf")):
        assert main([*store, "--kv-store-max-gb", value]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([*store, "--kv-store-max-gb", "lots"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--kv-store-max-gb: invalid float value" in err
