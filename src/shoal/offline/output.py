"""Result lines written as requests finish, so that the file is always valid JSONL, in input
order (the longest finished prefix is flushed; later results wait in memory) or in completion
order; and resume: the keys (`line` numbers, `custom_id`s) an earlier run already wrote.

Invariant: every written line is a whole JSON object followed by a newline and flushed; a run
killed mid-write leaves at most one partial last line (no newline), which `written_keys` cuts
off; nothing else in the file is ever cut.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from typing import IO

from shoal.config import ShoalError

ORDERS = ("input", "completion")


class ResultWriter:
    """Writes result records; `add(position, record)` with positions 0..n-1 of this run."""

    def __init__(self, stream: IO[str], order: str = "input") -> None:
        if order not in ORDERS:
            raise ValueError(f"output order: got {order!r}, expected one of {ORDERS}")
        self.stream = stream
        self.order = order
        self._held: dict[int, dict] = {}
        self._next = 0  # input order: the next position to write

    def add(self, position: int, record: dict) -> None:
        if self.order == "completion":
            self._write(record)
            return
        self._held[position] = record
        while self._next in self._held:
            self._write(self._held.pop(self._next))
            self._next += 1

    @property
    def num_held(self) -> int:
        """Finished results not written yet (they wait for an earlier one)."""
        return len(self._held)

    def _write(self, record: dict) -> None:
        self.stream.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.stream.flush()


def record_key(record: dict) -> str:
    """What identifies a request across runs: its custom_id, else its input line number."""
    custom_id = record.get("custom_id")
    return f"id:{custom_id}" if custom_id is not None else f"line:{record.get('line')}"


def written_keys(path: str) -> set[str]:
    """Keys of the records in an output file (none if it does not exist). A last line without
    its newline (a run killed mid-write) is cut off the file; blank lines are skipped; any other
    line that is not a JSON object is a ShoalError naming it (nothing is cut)."""
    if not os.path.exists(path):
        return set()
    keys: set[str] = set()
    with open(path, "rb") as f:
        data = f.read()
    lines = data.splitlines(keepends=True)
    if lines and not lines[-1].endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(lines.pop()))
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise ShoalError(f"--resume: line {number} of {path} is not a result (a JSON "
                             "object); fix or remove it")
        keys.add(record_key(record))
    return keys


def check_writable(path: str) -> None:
    """OSError now, before a model loads, if `path` cannot be written (an existing file is
    opened for appending; for a new one a private temp file is made and removed in its folder,
    so ranks probing the same path at once do not collide: nothing is truncated or left)."""
    if os.path.exists(path):
        with open(path, "a", encoding="utf-8"):
            return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OSError(f"output {path!r}: folder {folder!r} does not exist or is not writable")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".shoal-probe-"):
            pass
    except OSError as exc:
        raise OSError(f"output {path!r}: folder {folder!r} does not exist or is not writable "
                      f"({exc.strerror})") from None


def keys_of(lines: Iterable) -> list[str]:
    """Keys of `RequestLine`s (see `record_key`)."""
    return [f"id:{r.custom_id}" if r.custom_id is not None else f"line:{r.line}" for r in lines]
