"""Synthetic tokenizer layout (model.md §8 special tokens), the wrapper and incremental
detokenizing (checked against whole-sequence decoding)."""

from __future__ import annotations

import pytest

from shoal.model.presets import MINI, TINY
from shoal.tokenizer import IncrementalDetokenizer, Tokenizer, build_synthetic_tokenizer
from shoal.tokenizer.synthetic import CHAT_PLAIN, CHAT_SPECIAL, IMAGE

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_synthetic_tokenizer(TINY), model_vocab_size=TINY.vocab_size)


def test_tiny_layout(tok: Tokenizer) -> None:
    assert tok.vocab_size == len(tok) == 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert [tok.id_to_token(i) for i in range(3)] == [BOS, EOS, PAD]
    for text in CHAT_SPECIAL + CHAT_PLAIN:
        token_id = tok.token_to_id(text)
        assert token_id is not None and tok.encode(text) == [token_id], text
    assert tok.id_to_token(TINY.dspark_noise_token_id) is not None
    assert {0, 1, 2, 511} <= tok.special_ids
    assert tok.token_to_id("<think>") not in tok.special_ids


def test_deterministic() -> None:
    a = build_synthetic_tokenizer(TINY).to_str()
    assert a == build_synthetic_tokenizer(TINY).to_str()


def test_mini_layout() -> None:
    t = build_synthetic_tokenizer(MINI)
    assert t.get_vocab_size() == 129280
    assert t.token_to_id(IMAGE) == MINI.image_token_id == 129264
    assert t.id_to_token(MINI.dspark_noise_token_id) is not None


def test_chat_round_trip(tok: Tokenizer) -> None:
    prompt = (f"{BOS}<｜System｜>Be brief.<｜User｜>Hi, Café 你好 🙂?<｜Assistant｜><think>"
              "Let me think.</think>Hello!\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">"
              f"</｜DSML｜ invoke></｜DSML｜ calls>{EOS}")
    ids = tok.encode(prompt)
    assert ids[0] == 0 and ids[-1] == 1 and ids.count(0) == 1
    assert tok.decode(ids) == prompt
    stripped = tok.decode(ids, skip_special_tokens=True)
    assert stripped.startswith("Be brief.Hi, Café") and "<think>" in stripped
    assert "｜DSML｜" in stripped and "<｜User｜>" not in stripped and BOS not in stripped


def test_encode_bos(tok: Tokenizer) -> None:
    assert tok.encode("hello", add_special_tokens=True) == [0, *tok.encode("hello")]
    assert tok.encode(BOS + "hello", add_special_tokens=True) == tok.encode(BOS + "hello")


def test_from_dir_and_vocab_check(tmp_path, tok: Tokenizer) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.encode("the quick fox") == tok.encode("the quick fox")
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.from_dir(tmp_path, model_vocab_size=500)
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not be parsed"):
        Tokenizer.from_dir(tmp_path / "bad")


TEXTS = ["Hello world, the weather is fine.", "Café naïve 你好，世界。こんにちは 🙂🚀✨ done",
         "<think>a</think> b\n\n<｜DSML｜ calls> 🙂", "Ω≈ç√∫˜µ≤≥÷ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_incremental_detokenizer(tok: Tokenizer, text: str, skip: bool) -> None:
    prompt = tok.encode("<｜User｜>Say something<｜Assistant｜>", add_special_tokens=True)
    gen = tok.encode(text) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = []
    for i, token_id in enumerate(gen):
        delta = detok.step(token_id)
        assert "\ufffd" not in delta
        deltas.append(delta)
        # Emitted text is always a prefix of the final decoding (stable offsets).
        assert "".join(deltas) == tok.decode(gen[: i + 1], skip_special_tokens=skip)[
            : len("".join(deltas))]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text == tok.decode(gen, skip_special_tokens=skip)


def test_incremental_multi_token_steps_and_partial_flush(tok: Tokenizer) -> None:
    gen = tok.encode("你好 world")
    detok = tok.incremental()
    out = detok.step(gen[:2]) + detok.step(gen[2:])
    assert out == "你好 world"
    partial = tok.encode("🙂")[:2]  # first bytes of a 4-byte character
    detok = tok.incremental()
    assert len(partial) == 2 and detok.step(partial) == ""
    assert detok.flush() == tok.decode(partial) and "\ufffd" in detok.text
