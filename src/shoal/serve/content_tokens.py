"""Which generated tokens make a response's message text: its `output_text.logprobs` are
theirs. The reasoning (up to and including `</think>`), the DSML tool-call block (from its
`<｜DSML｜` marker on) and the end-of-sequence token are not the message's.

Tokens arrive as (token id, its position's logprobs) entries, a step at a time when streamed;
a token whose text may begin the tool-call marker is held back until the next tokens settle
it, so a stream confirms exactly the tokens the whole output has.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shoal.tokenizer.special import DSML, EOS, THINK_END

MARKER = f"<{DSML}"  # where a tool-call block starts (CALLS_OPEN's prefix)


class ContentTokens:
    def __init__(self, tokenizer, thinking: bool) -> None:
        self.text = tokenizer.token_text
        self.think_end, self.eos = tokenizer.token_to_id(THINK_END), tokenizer.token_to_id(EOS)
        self.state = "reasoning" if thinking else "content"
        self.held: list[tuple[int, Any]] = []  # content candidates whose text may open MARKER
        self.held_text = ""

    def feed(self, entries: Iterable[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """The entries these tokens confirm as the message's, in order."""
        out: list[tuple[int, Any]] = []
        for entry in entries:
            token = entry[0]
            if self.state == "reasoning":
                self.state = "content" if token == self.think_end else "reasoning"
            elif self.state == "content" and token != self.eos:
                self.held.append(entry)
                self.held_text += self.text(token)
                out += self._settle()
        return out

    def close(self) -> list[tuple[int, Any]]:
        """The entries still held when the output ends (text that never became a marker)."""
        out, self.held, self.held_text = self.held, [], ""
        return out

    def _settle(self) -> list[tuple[int, Any]]:
        at = self.held_text.find(MARKER)
        if at >= 0:  # the tokens that start before the marker are text; the rest is the calls
            self.state = "calls"
            keep, start = [], 0
            for entry in self.held:
                if start >= at:
                    break
                keep.append(entry)
                start += len(self.text(entry[0]))
            self.held, self.held_text = [], ""
            return keep
        # hold the fewest trailing tokens whose text covers a suffix that may open the marker
        tail = next((n for n in range(min(len(MARKER) - 1, len(self.held_text)), 0, -1)
                     if MARKER.startswith(self.held_text[-n:])), 0)
        keep_n, covered = len(self.held), 0
        while tail and covered < tail:
            keep_n -= 1
            covered += len(self.text(self.held[keep_n][0]))
        out = self.held[:keep_n]
        self.held = self.held[keep_n:]
        self.held_text = "".join(self.text(t) for t, _ in self.held)
        return out


def content_entries(token_ids, logprobs, tokenizer, thinking: bool) -> list[tuple[int, Any]]:
    """The message's (token, logprobs) entries of a whole output."""
    tokens = ContentTokens(tokenizer, thinking)
    return tokens.feed(zip(token_ids, logprobs, strict=False)) + tokens.close()
