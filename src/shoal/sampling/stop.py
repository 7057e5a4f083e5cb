"""Stop-string detection on incrementally decoded text, with hold-back for streaming.

Owns: `check_stop` (pure) and `StopStringMatcher` (its per-request state: the held-back tail
and a lookback of emitted text, where a stop string may begin when it is emitted eagerly).

Invariant: text is emitted only when no stop string can begin inside it (or, with
include_stop_str_in_output, when emitting it is right either way), so a stop string that
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
    lookback: the last (longest stop - 1) characters already emitted; pass it to the next call
        (a stop string may begin there when include_stop_str_in_output emits eagerly).
    """

    stopped: bool
    stop_str: str | None
    emit: str
    held: str
    lookback: str


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
    lookback: str = "",
) -> StopCheck:
    """Look for the first stop string that ends inside `new_text`.

    Args:
        held: the previous call's `held` ("" at the start); it was not emitted.
        new_text: newly decoded text (the detokenizer's delta).
        stops: the request's stop strings (non-empty strings).
        include_stop_str_in_output: keep the stop string at the end of the emitted text.
        final: the request ends now for another reason (EOS, max_tokens): emit everything.
        lookback: the previous call's `lookback` ("" at the start).
    """
    window = lookback + held + new_text
    first_new = len(lookback) + len(held)
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        # Only matches that end inside new_text are new: earlier ones would have stopped already.
        start = window.find(stop, max(0, first_new - len(stop) + 1))
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    if best is not None:
        end, start, stop = best
        cut = end if include_stop_str_in_output else max(start, len(lookback))
        return StopCheck(True, stop, window[len(lookback) : cut], "", "")
    keep = 0 if final or include_stop_str_in_output else _longest_partial(window, stops)
    split = len(window) - keep
    context = max((len(s) for s in stops), default=1) - 1
    return StopCheck(
        stopped=False,
        stop_str=None,
        emit=window[len(lookback) : split],
        held=window[split:],
        lookback=window[max(0, split - context) : split] if context else "",
    )


class StopStringMatcher:
    """Per-request wrapper around `check_stop` that carries the held-back text and lookback."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = tuple(stops)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.held = ""
        self.lookback = ""
        self.stopped = False

    def feed(self, new_text: str, final: bool = False) -> StopCheck:
        """Feed the next decoded delta; see `check_stop`. No more text is accepted once stopped."""
        if self.stopped:
            raise RuntimeError("StopStringMatcher.feed called after a stop string matched")
        result = check_stop(
            self.held,
            new_text,
            self.stops,
            self.include_stop_str_in_output,
            final,
            self.lookback,
        )
        self.held = result.held
        self.lookback = result.lookback
        self.stopped = result.stopped
        return result

    def flush(self) -> str:
        """End of the request for another reason: return (and clear) the held-back text."""
        held, self.held = self.held, ""
        return held
