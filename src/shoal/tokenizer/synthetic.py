"""Synthetic byte-level BPE tokenizer for scaled-down test checkpoints (no downloads).

Owns `build_synthetic_tokenizer(config)`: a `tokenizers.Tokenizer` with exactly
`config.vocab_size` ids, trained deterministically on the small built-in English corpus below.

Id layout (invariant):
- 0 `<｜begin▁of▁sentence｜>` (BOS), 1 `<｜end▁of▁sentence｜>` (EOS), 2 `<｜▁pad▁｜>` (pad), the
  official ids of DeepSeek-V4.x (model.md §8);
- 3 .. 258: the 256 byte-level symbols; then the learned merges;
- then the chat tokens of model.md §8 (turn, thinking, task and DSML tokens) as added tokens;
- `<｜deepseek_image｜>` at `config.image_token_id` when the config has one;
- every remaining id up to vocab_size - 1 is a reserved special token
  `<｜place▁holder▁no▁N｜>`, at least `MIN_RESERVED` of them, so `dspark_noise_token_id` and the
  last ids are real tokens.
Turn, task, image and reserved tokens are *special* (dropped by `skip_special_tokens`); `<think>`,
`</think>` and `｜DSML｜` are plain added tokens, so reasoning and tool markers survive decoding.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from shoal.model.config import ModelConfig

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
IMAGE = "<｜deepseek_image｜>"
CHAT_SPECIAL = ("<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>",
                "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>",
                "<｜read_url｜>")
CHAT_PLAIN = ("<think>", "</think>", "｜DSML｜")
MIN_RESERVED = 8
MAX_MERGES = 4000  # the corpus supports far fewer; larger vocabularies are mostly reserved ids


def reserved_token(index: int) -> str:
    return f"<｜place▁holder▁no▁{index}｜>"


_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. It was the best of times, it was the worst of times, it was the age of wisdom, it was the
age of foolishness. Call me Ishmael. Some years ago, never mind how long precisely, having little
or no money in my purse, and nothing particular to interest me on shore, I thought I would sail
about a little and see the watery part of the world.
In the beginning the engineers built a small machine. They tested it every morning and wrote down
what they saw. When the numbers did not agree, they looked again, and again, until the reason
was clear. Then they wrote the answer in the notebook and went home.
The weather today is sunny with a light wind from the west. Tomorrow there will be rain in the
morning and clouds in the afternoon. Please remember to bring an umbrella if you go outside.
How are you? I am fine, thank you. What would you like to eat for dinner tonight? Let us cook
rice, vegetables and fish. My friend prefers pasta with tomatoes, cheese and fresh basil.
Question: what is two plus three? Answer: two plus three is five. Question: what is ten times
ten? Answer: one hundred. The year 2024 had 366 days; 3.14159 is close to pi; 1,000,000 is a
million. Numbers like 42, 7, 19 and 256 appear in many stories.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, 1))
{"name": "shoal", "version": 1, "tags": ["inference", "engine"], "ok": true}
Water boils at one hundred degrees. The river flows to the sea, and the sea gives rain back to
the mountains. Children play in the park while their parents talk under the old trees.
The library opens at nine and closes at five. Students read books about history, science,
mathematics, music and art. Teachers explain difficult ideas with simple examples.
Café, naïve, résumé, Zürich and São Paulo have accents. 你好，世界。こんにちは。Привет, мир!
Emoji are bytes too: 🙂 🚀 ✨. Tabs\tand newlines\nare whitespace.
"""


def _train(vocab_target: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target, min_frequency=2, show_progress=False,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok


def build_synthetic_tokenizer(config: ModelConfig) -> Tokenizer:
    """A deterministic byte-level BPE with exactly `config.vocab_size` ids (layout above)."""
    vocab = config.vocab_size
    image_id = config.image_token_id if config.image_token_id is not None else None
    n_chat = len(CHAT_SPECIAL) + len(CHAT_PLAIN) + (1 if image_id is not None else 0)
    fixed = 3 + 256 + n_chat + MIN_RESERVED
    if vocab < fixed:
        raise ValueError(f"vocab_size: got {vocab}, a synthetic tokenizer needs at least {fixed} "
                         "ids (3 specials, 256 bytes, chat tokens and reserved ids)")
    merges = min(vocab - fixed, MAX_MERGES)
    tok = _train(3 + 256 + merges)
    trained = tok.get_vocab_size(with_added_tokens=True)
    if image_id is not None and image_id < trained + len(CHAT_SPECIAL) + len(CHAT_PLAIN):
        raise ValueError(f"image_token_id: got {image_id}, which would collide with the "
                         f"trained vocabulary or chat tokens (first free id {trained + n_chat})")
    for text in CHAT_SPECIAL:
        tok.add_special_tokens([AddedToken(text, special=True, normalized=False)])
    for text in CHAT_PLAIN:
        tok.add_tokens([AddedToken(text, special=False, normalized=False)])
    start = tok.get_vocab_size(with_added_tokens=True)
    extra: list[AddedToken] = []
    for i, token_id in enumerate(range(start, vocab)):
        text = IMAGE if token_id == image_id else reserved_token(i)
        extra.append(AddedToken(text, special=True, normalized=False))
    tok.add_special_tokens(extra)
    # Post-conditions: the exact size and the fixed ids.
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab:
        raise AssertionError(f"synthetic tokenizer has {size} ids, expected {vocab}")
    for token_id, text in ((0, BOS), (1, EOS), (2, PAD)):
        assert tok.token_to_id(text) == token_id, (text, tok.token_to_id(text))
    if image_id is not None:
        assert tok.token_to_id(IMAGE) == image_id
    return tok
