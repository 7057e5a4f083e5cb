"""`SamplingParams`: the per-request sampling and stopping knobs (vLLM-compatible names).

Owns: the user-facing parameter record and its validation. Invariant: a constructed
`SamplingParams` is frozen and already valid in every field that does not depend on the model
(`__post_init__`); `validate(vocab_size)` adds the checks that need the vocabulary. Sequence fields
(`stop`, `stop_token_ids`) are normalised to tuples so the record is hashable and can be shared
between requests; change it with `replace()` (copy-on-write, re-validated).

Semantics that differ from a plain reading of the names:
- `temperature < GREEDY_TEMPERATURE` (1e-5, as vLLM) means greedy (argmax, ties to the lowest id).
- `top_k` of 0 or -1 means off; -1 is normalised to 0.
- `seed=None` means the engine derives a per-request seed (`rng.request_seed`); a request's samples
  depend only on (seed, position), never on the batch it ran in.
- `max_tokens=None` means "until the context is full" (the engine bounds it).
- `logprobs=N` returns the sampled token's logprob and rank plus the top N (N = 0: only the sampled
  token); values are from the raw model logits (vLLM's default `raw_logprobs`).
- `logit_bias` ({token id: bias in [-100, 100]}, OpenAI's; ids may be decimal strings, as JSON
  keys are) is added to the model's logits before the penalties, masks and temperature; it is
  kept as sorted (id, bias) pairs.
- `allowed_token_ids` (vLLM's) restricts every sampled token to those ids (with structured
  output: to those the grammar also allows).
- `truncate_prompt_tokens=N` (vLLM's) keeps only the prompt's last N tokens.
- `bad_words` (vLLM's): strings never generated. The engine tokenizes each (as is and after a
  space) into `bad_words_token_ids`, which can also be given directly: a sequence's last token
  is banned whenever the outputs end with the tokens before it (a one-token word: always).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`)."""

MAX_LOGIT_BIAS = 100.0
"""logit_bias values are limited to [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI)."""

MAX_PENALTY = 2.0
"""Presence/frequency penalties are limited to [-MAX_PENALTY, MAX_PENALTY] (OpenAI and vLLM)."""

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(name: str, value: object, low: int | None, allowed: str) -> None:
    if not _is_int(value) or (low is not None and value < low):  # type: ignore[operator]
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {allowed}")


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs; ValueError on a bad id or bias."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, str) and all(
            isinstance(p, Sequence) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise ValueError(f"SamplingParams.logit_bias={value!r} is invalid: expected a mapping "
                         "{token id: bias} or None")
    pairs = {}
    for t, b in items:
        if isinstance(t, str) and t.isdecimal():  # JSON keys (OpenAI's {"50256": -100})
            t = int(t)
        if not _is_int(t) or t < 0:
            raise ValueError(f"SamplingParams.logit_bias has key {t!r}: expected token ids >= 0")
        if not _is_real(b) or abs(b) > MAX_LOGIT_BIAS:
            raise ValueError(f"SamplingParams.logit_bias[{t}]={b!r} is invalid: expected a "
                             f"number in [{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")
        pairs[t] = float(b)
    return tuple(sorted(pairs.items()))


def _token_sequences(value: object) -> tuple[tuple[int, ...], ...]:
    """bad_words_token_ids as a tuple of non-empty tuples of token ids >= 0."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"SamplingParams.bad_words_token_ids={value!r} is invalid: expected "
                         "a list of token-id lists")
    out = []
    for seq in value:
        if isinstance(seq, str) or not isinstance(seq, Sequence) or not seq or not all(
                _is_int(t) and t >= 0 for t in seq):
            raise ValueError(f"SamplingParams.bad_words_token_ids has {seq!r}: expected a "
                             "non-empty list of token ids >= 0")
        out.append(tuple(seq))
    return tuple(out)


def _check_real(
    name: str, value: object, low: float, high: float, allowed: str, *, low_open: bool = False
) -> None:
    ok = _is_real(value) and (value > low if low_open else value >= low) and value <= high  # type: ignore[operator]
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {allowed}")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping parameters of one request (see the module docstring)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured: Any = None
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = None
    allowed_token_ids: Sequence[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: Sequence[str] | None = None
    bad_words_token_ids: Sequence[Sequence[int]] | None = None

    def __post_init__(self) -> None:
        # Normalise sequences to tuples (frozen dataclass: assign through object.__setattr__).
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, Sequence):
            stop = tuple(stop)
        else:
            raise ValueError(
                f"SamplingParams.stop={stop!r} is invalid: expected a string, a list of strings "
                "or None"
            )
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, Sequence) and not isinstance(ids, str):
            ids = tuple(ids)
        else:
            raise ValueError(
                f"SamplingParams.stop_token_ids={ids!r} is invalid: expected a list of token ids "
                "or None"
            )
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        words = self.bad_words
        if words is not None:
            if isinstance(words, str) or not isinstance(words, Sequence) or not all(
                    isinstance(w, str) and w for w in words):
                raise ValueError(f"SamplingParams.bad_words={words!r} is invalid: expected a "
                                 "list of non-empty strings or None")
            object.__setattr__(self, "bad_words", tuple(words))
        object.__setattr__(self, "bad_words_token_ids", _token_sequences(
            self.bad_words_token_ids))
        allowed = self.allowed_token_ids
        if allowed is not None:
            if isinstance(allowed, str) or not isinstance(allowed, Sequence) or not allowed:
                raise ValueError(
                    f"SamplingParams.allowed_token_ids={allowed!r} is invalid: expected a "
                    "non-empty list of token ids or None"
                )
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
        if _is_int(self.top_k) and self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            if _is_int(value):
                object.__setattr__(self, name, float(value))
        self._check()

    def _check(self) -> None:
        _check_int("n", self.n, 1, "an integer >= 1")
        _check_real(
            "temperature", self.temperature, 0.0, math.inf, "a finite number >= 0 (0 = greedy)"
        )
        _check_real("top_p", self.top_p, 0.0, 1.0, "a number in (0, 1] (1 = off)", low_open=True)
        _check_int("top_k", self.top_k, 0, "an integer >= 1, or 0 / -1 for off")
        _check_real("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1] (0 = off)")
        _check_real(
            "repetition_penalty",
            self.repetition_penalty,
            0.0,
            math.inf,
            "a finite number > 0 (1 = off)",
            low_open=True,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(
                name,
                getattr(self, name),
                -MAX_PENALTY,
                MAX_PENALTY,
                f"a number in [{-MAX_PENALTY}, {MAX_PENALTY}] (0 = off)",
            )
        if self.seed is not None and not (
            _is_int(self.seed) and _SEED_MIN <= self.seed <= _SEED_MAX
        ):
            raise ValueError(
                f"SamplingParams.seed={self.seed!r} is invalid: expected None or an integer in "
                f"[-2**63, 2**64 - 1]"
            )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, "None or an integer >= 1")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1,
                       "None or an integer >= 1")
        _check_int("min_tokens", self.min_tokens, 0, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens={self.min_tokens} is invalid: expected <= "
                f"max_tokens={self.max_tokens}"
            )
        for s in self.stop:  # type: ignore[union-attr]
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop contains {s!r}: expected non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError(
                f"SamplingParams.stop={self.stop!r} needs detokenize=True: stop strings are "
                "matched on the decoded text"
            )
        for name in ("stop_token_ids", "allowed_token_ids"):
            for t in getattr(self, name) or ():
                if not _is_int(t) or t < 0:
                    raise ValueError(
                        f"SamplingParams.{name} contains {t!r}: expected token ids >= 0"
                    )
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "detokenize",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected a bool")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, "None (off) or an integer >= 0 (number of top tokens)")

    def validate(self, vocab_size: int, max_logprobs: int | None = None) -> None:
        """Check the fields that depend on the model; raise ValueError naming the field.

        Args:
            vocab_size: number of logits per row (V).
            max_logprobs: engine limit on `logprobs` / `prompt_logprobs` (None = vocab_size).
        """
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r} is invalid: expected an integer >= 1")
        ids = {"stop_token_ids": self.stop_token_ids,
               "allowed_token_ids": self.allowed_token_ids or (),
               "logit_bias": [t for t, _ in self.logit_bias],  # type: ignore[union-attr]
               "bad_words_token_ids": [t for seq in self.bad_words_token_ids for t in seq]}
        for name, values in ids.items():
            for t in values:
                if t >= vocab_size:
                    raise ValueError(
                        f"SamplingParams.{name} contains {t}: expected ids < vocab_size="
                        f"{vocab_size}"
                    )
        limit = vocab_size if max_logprobs is None else min(max_logprobs, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > limit:
                raise ValueError(
                    f"SamplingParams.{name}={value} is invalid: expected at most {limit}"
                )

    # --- derived views -------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        """True when the request samples by argmax."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def reads_outputs(self) -> bool:
        """True when sampling a token reads the output tokens' values (penalties, a bad word
        of several tokens)."""
        return self.has_penalties or any(len(s) > 1 for s in self.bad_words_token_ids)

    def banned_after(self, outputs: Sequence[int]) -> tuple[int, ...]:
        """The bad words' tokens banned as the token after `outputs`."""
        return tuple(s[-1] for s in self.bad_words_token_ids  # type: ignore[union-attr]
                     if len(s) == 1 or tuple(outputs[len(outputs) - len(s) + 1:]) == s[:-1])

    @property
    def has_penalties(self) -> bool:
        """True when any of repetition/presence/frequency penalty is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def replace(self, **changes: Any) -> SamplingParams:
        """Return a copy with `changes` applied (re-validated); the original is unchanged."""
        return dataclasses.replace(self, **changes)
