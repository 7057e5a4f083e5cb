"""Structured outputs (JSON schema, regex, Lark grammar, choice) through llguidance.

Owns: the request-level constraint record (:class:`StructuredOutputSpec`), the per-model bridge
from a ``tokenizers.Tokenizer`` to llguidance (:class:`StructuredOutputBackend`, built once), and
the per-request matcher (:class:`StructuredMatcher`) that yields allowed-token masks and advances
on accepted tokens.

Invariants: a spec is frozen and hashable (a JSON schema is stored as its JSON text); an invalid
schema/regex/grammar raises ValueError carrying llguidance's message when the matcher is built, so
the engine can fail that one request; a matcher never enters llguidance's sticky error state
through :meth:`StructuredMatcher.accept` (rejected tokens leave the state unchanged). Masks have
``vocab_size`` entries (may exceed the tokenizer's length: those ids are never allowed).

Example::

    backend = StructuredOutputBackend(tokenizer, eos_token_id=1, vocab_size=129280)
    matcher = backend.matcher(StructuredOutputSpec(regex=r"\\d{3}"))
    mask = matcher.allowed_mask()          # torch.bool [vocab_size]
    matcher.accept(token_id)               # after sampling under the mask
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import torch
from tokenizers import Tokenizer


@dataclass(frozen=True)
class StructuredOutputSpec:
    """Exactly one of: ``json_schema`` (dict or JSON text; stored as text), ``regex`` (Rust regex
    syntax, matched in full), ``grammar`` (Lark, llguidance dialect), ``choice`` (strings; stored
    as a tuple)."""

    json_schema: str | Mapping[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json_schema", "regex", "grammar", "choice")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputSpec: set exactly one of json_schema, regex, grammar, choice "
                f"(got {given or 'none'})"
            )
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputSpec.{name}: expected a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence):
                raise ValueError("StructuredOutputSpec.choice: expected a list of strings")
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(
                    "StructuredOutputSpec.choice: expected a non-empty list of non-empty strings"
                )
            object.__setattr__(self, "choice", choice)

    @property
    def schema(self) -> Any:
        """The JSON schema as a Python object (None for other kinds)."""
        return None if self.json_schema is None else json.loads(str(self.json_schema))

    @classmethod
    def from_response_format(
        cls, response_format: Mapping[str, Any]
    ) -> StructuredOutputSpec | None:
        """OpenAI ``response_format``: ``text`` -> None, ``json_object`` -> any JSON object,
        ``json_schema`` -> its ``json_schema.schema``."""
        kind = response_format.get("type") if isinstance(response_format, Mapping) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_schema={"type": "object"})
        if kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, Mapping) or "schema" not in inner:
                raise ValueError("response_format.json_schema.schema is required")
            return cls(json_schema=inner["schema"])
        raise ValueError(
            f"response_format.type={kind!r}: expected 'text', 'json_object' or 'json_schema'"
        )

    def to_llguidance(self) -> str:
        """The llguidance grammar text (not yet validated)."""
        if self.json_schema is not None:
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(str(self.json_schema))
            except ValueError as err:
                raise ValueError(f"StructuredOutputSpec.json_schema: {err}") from None
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.grammar is not None:
            return llguidance.LLMatcher.grammar_from_lark(self.grammar)
        choice = self.choice or ()
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def kind(self) -> str:
        """``json_schema`` | ``regex`` | ``grammar`` | ``choice``."""
        for name in ("json_schema", "regex", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "choice"


def _schema_text(schema: str | Mapping[str, Any]) -> str:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"StructuredOutputSpec.json_schema: invalid JSON ({err})") from None
    elif isinstance(schema, Mapping):
        parsed = schema
    else:
        raise ValueError("StructuredOutputSpec.json_schema: expected a dict or JSON text")
    if not isinstance(parsed, (Mapping, bool)):
        raise ValueError("StructuredOutputSpec.json_schema: expected a JSON object (or boolean)")
    try:
        return json.dumps(parsed, ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"StructuredOutputSpec.json_schema: not JSON-serialisable ({err})"
        ) from None


def tool_arguments_spec(tool: Mapping[str, Any]) -> StructuredOutputSpec:
    """JSON-schema constraint for one OpenAI tool's arguments object.

    ``{"type": "function", "function": {"name": "f", "parameters": S}}`` -> ``json_schema=S``
    (an object schema with no properties when ``parameters`` is missing). A schema that is not
    an object type is rejected: tool arguments are always one JSON object.
    """
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError("tool.function.name: required string")
    params = function.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise ValueError(f"tool {function['name']!r}: function.parameters must be a JSON object")
    if params.get("type", "object") != "object":
        raise ValueError(
            f"tool {function['name']!r}: function.parameters.type must be 'object', "
            f"got {params.get('type')!r}"
        )
    return StructuredOutputSpec(json_schema=dict(params))


class StructuredOutputBackend:
    """Per-model llguidance bridge; building it costs a vocabulary scan, so build it once.

    Args:
        tokenizer: the model's ``tokenizers.Tokenizer`` (byte-level BPE with added tokens).
        eos_token_id: the id that ends a constrained generation (allowed once accepting).
        vocab_size: logits width; may exceed the tokenizer length (extra ids never allowed).
        cache_size: compiled grammars kept (a batch repeating one JSON schema builds it once).
    """

    def __init__(
        self, tokenizer: Tokenizer, *, eos_token_id: int, vocab_size: int | None = None,
        cache_size: int = 64,
    ) -> None:
        length = tokenizer.get_vocab_size(with_added_tokens=True)
        vocab_size = length if vocab_size is None else vocab_size
        if vocab_size < length:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({length})")
        if not 0 <= eos_token_id < length:
            raise ValueError(f"eos_token_id={eos_token_id} is outside the tokenizer [0, {length})")
        copy = Tokenizer.from_str(tokenizer.to_str())
        copy.no_padding()
        copy.no_truncation()
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._lltok = llguidance.LLTokenizer(
            copy.to_str(), n_vocab=vocab_size, eos_token=eos_token_id
        )
        self.cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[str, threading.Event] = {}  # grammars a thread is building (_lock)

    def compile(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher:
        """The pristine matcher of ``spec``'s grammar (never advanced: copy it), built once per
        grammar and kept in an LRU of ``cache_size``; ValueError with llguidance's message (also
        remembered). Safe from any thread: llguidance releases the interpreter lock while it
        builds, so building off the engine thread (`prepare`) keeps the engine stepping."""
        grammar = spec.to_llguidance()
        while True:
            with self._lock:
                built = self._cache.get(grammar)
                if built is not None:
                    self._cache.move_to_end(grammar)
                    break
                other = self._building.get(grammar)  # another thread builds it: wait for that
                if other is None:
                    self._building[grammar] = threading.Event()
                    break
            other.wait()
        if built is None:
            try:
                built = self._build(grammar, spec.kind())
                with self._lock:
                    self._cache[grammar] = built
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
            finally:
                with self._lock:
                    self._building.pop(grammar).set()
        if isinstance(built, str):
            raise ValueError(built)
        return built

    def _build(self, grammar: str, kind: str) -> llguidance.LLMatcher | str:
        """A fresh matcher for ``grammar``, or the error message."""
        try:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, self._lltok
            )
            if is_error:
                return f"invalid {kind} for structured output: {_brief(messages[0])}"
            matcher = llguidance.LLMatcher(self._lltok, grammar, log_level=0)
        except BaseException as exc:  # a Rust panic is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return f"invalid {kind} for structured output: {_brief(str(exc))}"
        if matcher.is_error():  # (building can fail where checking did not)
            return f"invalid structured output grammar: {_brief(matcher.get_error())}"
        return matcher

    def is_compiled(self, spec: StructuredOutputSpec) -> bool:
        """True when ``spec``'s grammar (or its error) is cached: `matcher` is then a copy."""
        with self._lock:
            return spec.to_llguidance() in self._cache

    def prepare(self, spec: StructuredOutputSpec) -> None:
        """Build ``spec``'s grammar into the cache (for a worker thread); errors are kept for
        the request's own checks."""
        try:
            self.compile(spec)
        except ValueError:
            pass

    def matcher(self, spec: StructuredOutputSpec) -> StructuredMatcher:
        """A fresh per-request matcher for ``spec`` (a copy of the cached one: microseconds)."""
        return StructuredMatcher(self, self.compile(spec).deep_copy())

    def decode(self, token_ids: Sequence[int]) -> bytes:
        """The bytes llguidance sees for ``token_ids`` (for checks and debugging)."""
        return self._lltok.decode_bytes(list(token_ids))


class StructuredMatcher:
    """Per-request constraint state. Call a mask method, sample under it, then :meth:`accept`."""

    def __init__(self, backend: StructuredOutputBackend, matcher: llguidance.LLMatcher) -> None:
        self.vocab_size = backend.vocab_size
        self.eos_token_id = backend.eos_token_id
        self._words = (self.vocab_size + 31) // 32
        self._matcher = matcher
        self._num_accepted = 0

    def fill_bitmask(self, out: torch.Tensor) -> None:
        """Write the allowed set into ``out``: int32 [ceil(V/32)], CPU, contiguous; bit j of word
        w allows token 32w+j (llguidance/xgrammar layout; see ``sampler.bitmask_to_bool``)."""
        if (
            out.dtype != torch.int32
            or out.device.type != "cpu"
            or out.shape != (self._words,)
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"bitmask must be a contiguous CPU int32 tensor of shape ({self._words},)"
            )
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), self._words * 4)

    def fill_mask(self, out: torch.Tensor) -> None:
        """Write the allowed set into ``out``: bool [V] (any device), True = allowed."""
        if out.dtype != torch.bool or out.shape != (self.vocab_size,):
            raise ValueError(f"mask must be a bool tensor of shape ({self.vocab_size},)")
        out.copy_(self.allowed_mask())

    def allowed_mask(self) -> torch.Tensor:
        """New CPU bool tensor [V] of allowed next tokens."""
        words = torch.empty(self._words, dtype=torch.int32)
        self.fill_bitmask(words)
        shifts = torch.arange(32, dtype=torch.int32)
        bits = (words.unsqueeze(-1) >> shifts) & 1  # [W, 32]
        return bits.flatten()[: self.vocab_size].to(torch.bool)

    def accept(self, token_id: int) -> bool:
        """Advance on ``token_id``; False (state unchanged) if the constraint forbids it."""
        if not 0 <= token_id < self.vocab_size:
            return False
        if token_id == self.eos_token_id:  # validate_tokens does not count EOS
            if not self._matcher.is_accepting():
                return False
        elif self._matcher.validate_tokens([token_id]) != 1:
            return False
        ok = self._matcher.consume_token(token_id)
        if ok:
            self._num_accepted += 1
        return ok

    def count_acceptable(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` would be accepted (state unchanged; for drafts)."""
        return self._matcher.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"rollback({num_tokens}): only {self._num_accepted} tokens accepted")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"rollback({num_tokens}) failed: {self._matcher.get_error()}")
        self._num_accepted -= num_tokens

    def is_finished(self) -> bool:
        """True when no token other than EOS can follow (or EOS was accepted); never in the
        error state (see `error`)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the constraint cannot go on (e.g. the grammar grew too complex at this token),
        or None."""
        if not self._matcher.is_error():
            return None
        return f"structured output failed: {_brief(self._matcher.get_error())}"

    def is_accepting(self) -> bool:
        """True when the text so far satisfies the constraint (EOS is allowed now)."""
        return self._matcher.is_accepting()

    @property
    def num_accepted(self) -> int:
        return self._num_accepted


def _brief(message: str, limit: int = 500) -> str:
    """llguidance's message on one line, without the backtrace a Rust panic appends."""
    text = " ".join(message.split("stack backtrace:")[0].split())
    return text if len(text) <= limit else text[:limit] + "..."
