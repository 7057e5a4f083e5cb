"""Stop-string detection on incrementally decoded text, with hold-back for streaming.

Owns: `check_stop` (pure) and `StopStringMatcher` (its per-request state: the held-back tail).

Invariant: text is emitted only when no stop string can begin inside it, so a stop string that
spans any number of token / chunk boundaries is found, and the emitted text plus the final result
does not depend on how the text was split into chunks. The held-back tail is the longest suffix of
the unemitted text that is a proper prefix of some stop string (empty when
`include_stop_str_in_output`: a stop string's text is then emitted either way).

When several stop strings complete in the same chunk, the one that ends first wins (ties: the one
that starts first), i.e. the one at which generation would have stopped had the text arrived one
character at a time. (vLLM takes the first match in list order instead.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    """Result of feeding new text.

    stopped: a stop string completed; the request should finish with reason "stop".
    stop_str: that stop string (None when not stopped).
    emit: text to append to the visible output now (truncated at the stop string, which is
        included iff include_stop_str_in_output).
    held: text withheld because it may begin a stop string; pass it to the next call.
    """

    stopped: bool
    stop_str: str | None
    emit: str
    held: str


def _longest_partial(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:length]):
                best = length
                break
    return best


def check_stop(
    held: str,
    new_text: str,
    stops: Sequence[str],
    include_stop_str_in_output: bool = False,
    final: bool = False,
) -> StopCheck:
    """Look for the first stop string in `held + new_text`.

    Args:
        held: the previous call's `held` ("" at the start); it was not emitted.
        new_text: newly decoded text (the detokenizer's delta).
        stops: the request's stop strings (non-empty strings).
        include_stop_str_in_output: keep the stop string at the end of the emitted text.
        final: the request ends now for another reason (EOS, max_tokens): emit everything.
    """
    window = held + new_text
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        # A match must end inside new_text: the held text alone cannot contain a whole stop string.
        start = window.find(stop, max(0, len(held) - len(stop) + 1))
        if start >= 0:
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    if best is not None:
        end, start, stop = best
        return StopCheck(True, stop, window[: end if include_stop_str_in_output else start], "")
    if final or include_stop_str_in_output:
        return StopCheck(False, None, window, "")
    keep = _longest_partial(window, stops)
    split = len(window) - keep
    return StopCheck(False, None, window[:split], window[split:])


class StopStringMatcher:
    """Per-request wrapper around `check_stop` that carries the held-back text."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = tuple(stops)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.held = ""
        self.stopped = False

    def feed(self, new_text: str, final: bool = False) -> StopCheck:
        """Feed the next decoded delta; see `check_stop`. No more text is accepted once stopped."""
        if self.stopped:
            raise RuntimeError("StopStringMatcher.feed called after a stop string matched")
        result = check_stop(self.held, new_text, self.stops, self.include_stop_str_in_output, final)
        self.held = result.held
        self.stopped = result.stopped
        return result

    def flush(self) -> str:
        """End of the request for another reason: return (and clear) the held-back text."""
        held, self.held = self.held, ""
        return held
