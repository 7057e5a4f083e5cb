"""JSONL request lines -> `LLM.run` items, one per non-empty line, each carrying its 1-based
line number (and `custom_id` when given).

Invariant: no line can abort a batch. A line that is not a JSON object, has not exactly one of
`prompt` / `prompt_token_ids` / `messages`, or has a bad field becomes an item with `error`
("line N: ..."); the engine checks the prompt itself (token ids must be integers) and reports
that per request too. Unknown fields are reported once per field name through `warn` (or make
the line an error with `strict`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from shoal.sampling import SamplingParams
from shoal.sampling.structured import StructuredOutputSpec

PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")
CHAT_FIELDS = ("tools", "reasoning_effort")
# every SamplingParams field a JSON line can set ("structured" takes an object:
# {"json_schema": ...} | {"regex": ...} | {"grammar": ...} | {"choice": [...]})
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
KNOWN_FIELDS = frozenset(PROMPT_FIELDS + CHAT_FIELDS + SAMPLING_FIELDS
                         + ("custom_id", "priority"))


def line_error(line: int, error: str) -> str:
    """An error message that names its input line."""
    return error if error.startswith(f"line {line}:") else f"line {line}: {error}"


@dataclass(frozen=True)
class RequestLine:
    line: int  # 1-based line number in the input file
    custom_id: str | None
    item: dict  # an LLM.run item


def sampling_params(obj: dict, default: SamplingParams) -> SamplingParams:
    """`default` with the line's sampling fields (ValueError / TypeError on a bad value)."""
    fields = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    if "structured" in fields and fields["structured"] is not None:
        spec = fields["structured"]
        if not isinstance(spec, dict):
            raise ValueError("structured: expected an object such as {\"regex\": \"...\"}")
        fields["structured"] = StructuredOutputSpec(**spec)
    return default.replace(**fields) if fields else default


def parse_line(text: str, line: int, default: SamplingParams, *, strict: bool = False,
               warn: Callable[[str], None] | None = None) -> RequestLine:
    custom_id = None
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        custom_id = obj.get("custom_id")
        if custom_id is not None and not isinstance(custom_id, str):
            raise ValueError(f"custom_id: expected a string, got {type(custom_id).__name__}")
        unknown = sorted(set(obj) - KNOWN_FIELDS)
        if unknown and strict:
            raise ValueError(f"unknown field(s) {unknown}; known: {sorted(KNOWN_FIELDS)}")
        if unknown and warn is not None:
            warn(", ".join(unknown))
        keys = [k for k in PROMPT_FIELDS if k in obj]
        if len(keys) != 1:
            raise ValueError("expected exactly one of 'prompt', 'prompt_token_ids' or "
                             f"'messages', got {keys or 'none'}")
        item: dict[str, Any] = {keys[0]: obj[keys[0]],
                                "sampling_params": sampling_params(obj, default)}
        if keys[0] == "messages":
            item.update({k: obj[k] for k in CHAT_FIELDS if k in obj})
        if "priority" in obj:  # (scheduling_policy='priority'; the engine checks it)
            item["priority"] = obj["priority"]
    except (ValueError, TypeError) as exc:
        item = {"error": f"line {line}: {exc}", "sampling_params": default}
    return RequestLine(line, custom_id, item)


def read_requests(path: str, default: SamplingParams, *, strict: bool = False,
                  warn: Callable[[str], None] | None = None) -> Iterator[RequestLine]:
    """The request lines of a JSONL file (empty lines skipped). `warn` gets each unknown
    field name once."""
    seen: set[str] = set()

    def warn_once(names: str) -> None:
        for name in names.split(", "):
            if name not in seen and warn is not None:
                seen.add(name)
                warn(name)

    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if text.strip():
                yield parse_line(text, n, default, strict=strict, warn=warn_once)
