"""Streaming parser for DeepSeek-V4.1 generated text: reasoning, content and DSML tool calls.

Owns the output side of the chat format (model.md §8, "Output parser"). Input is the generated
text decoded *with* special tokens, fed in arbitrary chunks.

Invariants:
- feeding the text in any chunking yields the same events (concatenated) and the same
  :class:`ParsedOutput` as feeding it whole: any suffix that could start a marker is held back;
- DSML markup never reaches ``content`` or ``reasoning_content``;
- the concatenated ``tool_arguments`` event texts of a call equal its final ``arguments``.

States (the prompt decides the start: REASONING if it ended with ``<think>``, else CONTENT)::

    REASONING --</think>--> CONTENT --(\\n\\n)<｜DSML｜ ...--> TOOLS --</｜DSML｜ calls>--> END
    REASONING --(\\n\\n)<｜DSML｜ calls>--> TOOLS          any --<｜end▁of▁sentence｜>--> DONE

Example::

    p = OutputParser(ParserState.REASONING)
    p.feed('hmm</think>Hi\\n\\n<｜DSML｜ calls>\\n<｜DSML｜ invoke name="f">\\n'
           '<｜DSML｜ parameter name="x" string="false">1</｜DSML｜ parameter>\\n'
           '</｜DSML｜ invoke>\\n</｜DSML｜ calls><｜end▁of▁sentence｜>')
    p.finish() -> ParsedOutput(reasoning_content='hmm', content='Hi',
                               tool_calls=[{'name': 'f', 'arguments': '{"x": 1}'}], ...)
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Literal

from shoal.tokenizer.render import to_json
from shoal.tokenizer.special import (
    CALLS_CLOSE,
    CALLS_OPEN,
    DSML,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN_PREFIX,
    PARAM_CLOSE,
    PARAM_OPEN_PREFIX,
    THINK_END,
    THINK_START,
)


class ParserState(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOLS = "tools"
    END = "end"  # after </｜DSML｜ calls>: only EOS may follow
    DONE = "done"  # EOS seen; later text is ignored


EventKind = Literal["reasoning", "content", "tool_call", "tool_arguments"]


@dataclass(frozen=True)
class ParserEvent:
    """One streaming delta.

    ``reasoning`` / ``content``: ``text`` is the delta. ``tool_call``: call ``index`` begins,
    ``name`` is set. ``tool_arguments``: ``text`` is the next fragment of call ``index``'s
    arguments JSON.
    """

    kind: EventKind
    text: str = ""
    index: int = -1
    name: str | None = None


@dataclass(frozen=True)
class ParsedOutput:
    """Final result. ``tool_calls`` items are ``{"name": str, "arguments": JSON object text}``.

    ``reasoning_content`` is None when the parser did not start in REASONING. ``errors`` are
    format violations that lost information (duplicate parameter, truncated call, malformed tag);
    ``warnings`` are tolerated deviations from the reference format.
    """

    reasoning_content: str | None
    content: str
    tool_calls: list[dict[str, str]]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    finished: bool = False  # EOS was seen
    state: ParserState = ParserState.DONE
    call_cut: bool = False  # the output ended inside the last tool call


_DSML_OPEN = f"<{DSML}"
_REASONING_MARKERS = (THINK_END, "\n\n" + CALLS_OPEN, CALLS_OPEN, EOS)
_CONTENT_MARKERS = ("\n\n" + _DSML_OPEN, _DSML_OPEN, EOS)
_TOOL_TAGS = (CALLS_OPEN, CALLS_CLOSE, INVOKE_CLOSE, INVOKE_OPEN_PREFIX, PARAM_OPEN_PREFIX, EOS)
_INVOKE_RE = re.compile(rf'^{re.escape(INVOKE_OPEN_PREFIX)}\s+name="(.*)"\s*>$', re.DOTALL)
_PARAM_RE = re.compile(
    rf'^{re.escape(PARAM_OPEN_PREFIX)}\s+name="(.*?)"(?:\s+string="(.*?)")?\s*>(.*)'
    rf"{re.escape(PARAM_CLOSE)}$",
    re.DOTALL,
)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _holdback(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker."""
    longest = min(len(text), max(len(m) for m in markers) - 1)
    for size in range(longest, 0, -1):
        suffix = text[-size:]
        if any(m.startswith(suffix) for m in markers):
            return size
    return 0


def _find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """Earliest marker occurrence (the longer marker wins a tie)."""
    best, found = len(text), None
    for marker in markers:
        pos = text.find(marker)
        if pos != -1 and (pos < best or (pos == best and found and len(marker) > len(found))):
            best, found = pos, marker
    return best, found


@dataclass
class _Call:
    name: str
    fragments: list[str] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    closed: bool = False


class OutputParser:
    """Incremental parser; one per request. ``feed`` returns deltas, ``finish`` the result."""

    def __init__(self, initial_state: ParserState = ParserState.REASONING) -> None:
        if initial_state not in (ParserState.REASONING, ParserState.CONTENT):
            raise ValueError(f"initial_state={initial_state}: expected REASONING or CONTENT")
        self.state = initial_state
        self._started_in_reasoning = initial_state is ParserState.REASONING
        self._buf = ""
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[_Call] = []
        self._calls_open = False
        self._finished = False
        self._closed = False
        self.call_cut = False  # the output ended inside the last call (cut by a token limit)
        self.errors: list[str] = []
        self.warnings: list[str] = []

    @classmethod
    def for_prompt(cls, prompt: str) -> OutputParser:
        """A parser that starts in reasoning when the prompt leaves a thinking block open (the
        generation prompt's `<think>`, or an assistant prefix being continued mid-reasoning)."""
        in_reasoning = prompt.rfind(THINK_START) > prompt.rfind(THINK_END)
        return cls(ParserState.REASONING if in_reasoning else ParserState.CONTENT)

    # ----------------------------------------------------------------- streaming
    def feed(self, text: str) -> list[ParserEvent]:
        """Consume a chunk of generated text; return the deltas it completes."""
        if self._closed:
            raise ValueError("OutputParser.feed after finish()/close()")
        self._buf += text
        events: list[ParserEvent] = []
        while self._step(events):
            pass
        return events

    def close(self) -> list[ParserEvent]:
        """End of generation: flush held-back text and close an unfinished call."""
        if self._closed:
            return []
        self._closed = True
        events: list[ParserEvent] = []
        held, self._buf = self._buf, ""
        if self.state in (ParserState.REASONING, ParserState.CONTENT) and held:
            cut = held.find("<｜DSML")
            if cut != -1:
                self.warnings.append(f"dropped a truncated DSML marker at the end: {held[cut:]!r}")
                held = held[:cut].removesuffix("\n\n")
            self._emit_text(held, events)
        elif self.state is ParserState.TOOLS:
            if held.strip():
                self.errors.append(f"output ended inside a tool call block: {held[:80]!r}")
            self.call_cut = bool(self._calls) and not self._calls[-1].closed
            self._close_call(events, "output ended before the call was closed")
            if self._calls_open:
                self.warnings.append(f"output ended without {CALLS_CLOSE}")
        return events

    def finish(self) -> ParsedOutput:
        """Close (if needed) and return the complete parse."""
        self.close()
        return ParsedOutput(
            reasoning_content="".join(self._reasoning) if self._started_in_reasoning else None,
            content="".join(self._content),
            tool_calls=[{"name": c.name, "arguments": "".join(c.fragments)} for c in self._calls],
            errors=list(self.errors),
            warnings=list(self.warnings),
            finished=self._finished,
            state=self.state,
            call_cut=self.call_cut,
        )

    # ----------------------------------------------------------------- internals
    def _emit_text(self, text: str, events: list[ParserEvent]) -> None:
        if not text:
            return
        if self.state is ParserState.REASONING:
            self._reasoning.append(text)
            events.append(ParserEvent("reasoning", text))
        else:
            self._content.append(text)
            events.append(ParserEvent("content", text))

    def _step(self, events: list[ParserEvent]) -> bool:
        """Make one unit of progress on the buffer; False when more input is needed."""
        if not self._buf:
            return False
        if self.state in (ParserState.REASONING, ParserState.CONTENT):
            return self._step_text(events)
        if self.state is ParserState.TOOLS:
            return self._step_tools(events)
        if self.state is ParserState.END:
            return self._step_end()
        if self._buf.strip():
            self.warnings.append(f"ignored text after EOS: {self._buf[:80]!r}")
        self._buf = ""
        return False

    def _step_text(self, events: list[ParserEvent]) -> bool:
        reasoning = self.state is ParserState.REASONING
        markers = _REASONING_MARKERS if reasoning else _CONTENT_MARKERS
        pos, marker = _find_first(self._buf, markers)
        if marker is None:
            keep = _holdback(self._buf, markers)
            self._emit_text(self._buf[: len(self._buf) - keep], events)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._emit_text(self._buf[:pos], events)
        rest = self._buf[pos:].removeprefix("\n\n")
        if marker == EOS:
            if reasoning:
                self.warnings.append(f"EOS inside the reasoning (no {THINK_END})")
            self._buf = rest[len(EOS) :]
            self._finished = True
            self.state = ParserState.DONE
        elif marker == THINK_END:
            self._buf = rest[len(THINK_END) :]
            self.state = ParserState.CONTENT
        else:  # DSML: the tools state parses the tag itself
            if reasoning:
                self.warnings.append(f"tool calls started inside the reasoning (no {THINK_END})")
            self._buf = rest
            self.state = ParserState.TOOLS
        return True

    def _step_end(self) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(EOS):
            self._buf = stripped[len(EOS) :]
            self._finished = True
            self.state = ParserState.DONE
            return True
        if stripped.startswith(_DSML_OPEN):
            self.warnings.append("a second tool call block after the first one was closed")
            self._buf, self.state = stripped, ParserState.TOOLS
            return True
        if any(tag.startswith(stripped) for tag in (EOS, _DSML_OPEN)):
            self._buf = stripped
            return False
        cut = stripped.find("<", 1)
        junk, self._buf = (stripped, "") if cut == -1 else (stripped[:cut], stripped[cut:])
        self.warnings.append(f"ignored text after the tool call block: {junk[:80]!r}")
        return bool(self._buf)

    def _step_tools(self, events: list[ParserEvent]) -> bool:
        buf = self._buf.lstrip()
        self._buf = buf
        if not buf:
            return False
        for tag in (EOS, CALLS_OPEN, CALLS_CLOSE, INVOKE_CLOSE):
            if buf.startswith(tag):
                self._buf = buf[len(tag) :]
                self._on_simple_tag(tag, events)
                return True
        if buf.startswith(INVOKE_OPEN_PREFIX):
            end = buf.find(">")
            if end == -1:
                return False
            self._buf = buf[end + 1 :]
            self._on_invoke(buf[: end + 1], events)
            return True
        if buf.startswith(PARAM_OPEN_PREFIX):
            end = buf.find(PARAM_CLOSE)
            if end == -1:
                return False
            self._buf = buf[end + len(PARAM_CLOSE) :]
            self._on_parameter(buf[: end + len(PARAM_CLOSE)], events)
            return True
        if any(tag.startswith(buf) for tag in _TOOL_TAGS):
            return False  # could still become a tag
        cut = buf.find("<", 1)
        junk, self._buf = (buf, "") if cut == -1 else (buf[:cut], buf[cut:])
        self.warnings.append(f"ignored unexpected text in the tool call block: {junk[:80]!r}")
        return True

    def _on_simple_tag(self, tag: str, events: list[ParserEvent]) -> None:
        if tag == EOS:
            self._close_call(events, "EOS before the call was closed")
            if self._calls_open:
                self.warnings.append(f"EOS before {CALLS_CLOSE}")
            self._finished, self.state = True, ParserState.DONE
        elif tag == CALLS_OPEN:
            if self._calls_open:
                self.warnings.append(f"nested {CALLS_OPEN} ignored")
            self._calls_open = True
        elif tag == CALLS_CLOSE:
            self._close_call(events, f"{CALLS_CLOSE} before {INVOKE_CLOSE}", error=False)
            self._calls_open, self.state = False, ParserState.END
        elif self._calls and not self._calls[-1].closed:  # INVOKE_CLOSE
            self._close_call(events, "")
        else:
            self.warnings.append(f"{INVOKE_CLOSE} without an open call ignored")

    def _close_call(self, events: list[ParserEvent], problem: str, error: bool = True) -> None:
        if not self._calls or self._calls[-1].closed:
            return
        call, index = self._calls[-1], len(self._calls) - 1
        if problem:
            message = f"tool call {index} ({call.name!r}): {problem}"
            (self.errors if error else self.warnings).append(message)
        call.closed = True
        tail = "}" if call.fragments else "{}"
        call.fragments.append(tail)
        events.append(ParserEvent("tool_arguments", tail, index=index))

    def _on_invoke(self, tag: str, events: list[ParserEvent]) -> None:
        match = _INVOKE_RE.match(tag)
        if match is None:
            self.errors.append(f"malformed invoke tag ignored: {tag[:80]!r}")
            return
        if not self._calls_open:
            self.warnings.append(f"invoke without {CALLS_OPEN}")
            self._calls_open = True
        self._close_call(events, f"a new invoke began before {INVOKE_CLOSE}", error=False)
        self._calls.append(_Call(match.group(1)))
        events.append(ParserEvent("tool_call", index=len(self._calls) - 1, name=match.group(1)))

    def _on_parameter(self, tag: str, events: list[ParserEvent]) -> None:
        match = _PARAM_RE.match(tag)
        if not self._calls or self._calls[-1].closed:
            self.errors.append(f"parameter outside an invoke ignored: {tag[:80]!r}")
            return
        call, index = self._calls[-1], len(self._calls) - 1
        where = f"tool call {index} ({call.name!r})"
        if match is None:
            self.errors.append(f"{where}: malformed parameter tag ignored: {tag[:80]!r}")
            return
        key, is_string, value = match.groups()
        if key in call.keys:
            self.errors.append(f"{where}: duplicate parameter {key!r}; kept the first value")
            return
        if is_string == "true":
            value_json = to_json(value)
        else:
            if is_string != "false":
                attr = "no string attribute" if is_string is None else f'string="{is_string}"'
                self.warnings.append(f"{where}: parameter {key!r} has {attr}")
            try:
                json.loads(value, parse_constant=_reject_constant)
                value_json = value
            except ValueError:
                self.warnings.append(f"{where}: parameter {key!r} is not valid JSON; kept as text")
                value_json = to_json(value)
        call.keys.add(key)
        fragment = ("{" if not call.fragments else ", ") + to_json(key) + ": " + value_json
        call.fragments.append(fragment)
        events.append(ParserEvent("tool_arguments", fragment, index=index))


def parse_completion(text: str, *, reasoning: bool = True) -> ParsedOutput:
    """Parse a whole completion (``reasoning``: the prompt ended with ``<think>``)."""
    parser = OutputParser(ParserState.REASONING if reasoning else ParserState.CONTENT)
    parser.feed(text)
    return parser.finish()
