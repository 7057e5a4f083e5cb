"""Tokenizer wrapper over a HF `tokenizers.Tokenizer` (tokenizer.json) and incremental detokenizing.

Owns: loading `tokenizer.json`, encode/decode with the engine's conventions (BOS is added by this
wrapper, never by the file's post-processor, so encoding is identical for the release and
synthetic tokenizers), the special ids, the check of the tokenizer size against the model
vocabulary, and `IncrementalDetokenizer`.

Invariant: `IncrementalDetokenizer` only ever emits complete text: the concatenation of its
deltas equals `decode(all generated ids)` once the stream ends with whole characters, and no
delta contains a U+FFFD produced by a byte sequence that is still incomplete.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers

BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"
PAD_TEXT = "<｜▁pad▁｜>"

# Tokens decoded before the first new token, so the first delta has left context (as vLLM does).
INITIAL_PREFIX_TOKENS = 5


LONG_TEXT = 1 << 16  # characters


class Tokenizer:
    """Encode/decode with DeepSeek-V4.1 conventions. `backend` is the raw Rust tokenizer."""

    def __init__(self, backend: tokenizers.Tokenizer, model_vocab_size: int | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id if bos_token_id is not None else self._id(BOS_TEXT, 0)
        self.eos_token_id = eos_token_id if eos_token_id is not None else self._id(EOS_TEXT, 1)
        self.pad_token_id = pad_token_id if pad_token_id is not None else self._id(PAD_TEXT, 2)
        added = backend.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._token_texts: dict[int, str] = {}
        if model_vocab_size is not None:
            self.check_model_vocab(model_vocab_size)

    def _id(self, text: str, default: int) -> int:
        token_id = self.backend.token_to_id(text)
        return default if token_id is None else int(token_id)

    @classmethod
    def from_file(cls, path: str | Path, model_vocab_size: int | None = None) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer: {path} does not exist")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust error type is not exported
            raise ValueError(f"tokenizer: {path} could not be parsed ({exc})") from None
        return cls(backend, model_vocab_size)

    @classmethod
    def from_dir(cls, path: str | Path, model_vocab_size: int | None = None) -> Tokenizer:
        """Load `<path>/tokenizer.json` (or `path` itself if it is the file)."""
        path = Path(path)
        return cls.from_file(path / "tokenizer.json" if path.is_dir() else path, model_vocab_size)

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def check_model_vocab(self, model_vocab_size: int) -> None:
        """The model's embedding must cover every tokenizer id (it may be larger: padding)."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(f"vocab_size: the tokenizer has {self.vocab_size} ids but the model "
                             f"vocabulary is {model_vocab_size}; ids would be out of range")

    # ---- encode / decode ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in `text` map to their ids.

        add_special_tokens: prepend BOS (unless `text` already starts with it).
        """
        # a long text through encode_batch, which releases the GIL (encode holds it): a huge
        # prompt tokenised in a worker thread does not stall the server's other threads (short
        # ones stay off its thread pool: no fork warnings, no pool overhead)
        ids = (self.backend.encode_batch([text], add_special_tokens=False)[0]
               if len(text) > LONG_TEXT else self.backend.encode(text, add_special_tokens=False)).ids
        if add_special_tokens and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token decoded alone (logprobs' `decoded_token`), cached by id: a
        logprobs stream asks for every token."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id])
        return text

    def token_to_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def incremental(self, prompt_ids: Sequence[int] = (),
                    skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas (byte-level BPE safe).

    Keeps two offsets into `ids` (prompt + generated): text is decoded from `prefix_offset`, and
    everything before `read_offset` has been emitted. A delta is emitted only when the decoded
    text grew and does not end in U+FFFD (an incomplete UTF-8 sequence); the offsets then advance.
    Decoding a short window with left context keeps merges such as leading spaces correct.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - INITIAL_PREFIX_TOKENS, 0)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_ids: int | Sequence[int]) -> str:
        """Append generated id(s); return the newly completed text ('' if none is ready)."""
        self.ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the stream: emit whatever is pending, replacement characters included."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


def load_tokenizer(config) -> Tokenizer:
    """The tokenizer of an `EngineConfig`: a preset's synthetic one, else the checkpoint's
    tokenizer.json, checked against config.json (vocabulary size, BOS and EOS ids)."""
    from shoal.config import ShoalError
    from shoal.tokenizer.synthetic import build_synthetic_tokenizer

    vocab = config.model_config.vocab_size
    if config.is_preset:
        return Tokenizer(build_synthetic_tokenizer(config.model_config), vocab)
    path = Path(config.model) / "tokenizer.json"
    if not path.exists():
        raise ShoalError(f"model {config.model!r}: no tokenizer.json in the checkpoint directory")
    tokenizer = Tokenizer.from_file(path, vocab)
    model = config.model_config
    for name, text, want in (("BOS", BOS_TEXT, model.bos_token_id),
                             ("EOS", EOS_TEXT, model.eos_token_id)):
        got = tokenizer.backend.token_to_id(text)
        if got != want:  # another model's tokenizer.json (its size alone may fit)
            raise ShoalError(f"model {config.model!r}: tokenizer.json does not match config.json:"
                             f" {name} {text} is id {got} in the tokenizer, {want} in the config")
    return tokenizer
