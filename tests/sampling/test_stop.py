"""Stop strings: matches across chunk boundaries, hold-back while streaming, chunking invariance
against a character-at-a-time reference."""

from __future__ import annotations

import random

import pytest

from shoal.sampling.stop import StopStringMatcher, check_stop


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Scan one character at a time: stop at the first end index where any stop string ends
    (the longest of those ending there); return (visible text, stop string)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def stream(chunks: list[str], stops: list[str], include: bool) -> tuple[str, str | None, list[str]]:
    matcher = StopStringMatcher(stops, include)
    emitted: list[str] = []
    for i, chunk in enumerate(chunks):
        result = matcher.feed(chunk, final=(i == len(chunks) - 1))
        emitted.append(result.emit)
        if result.stopped:
            return "".join(emitted), result.stop_str, emitted
    return "".join(emitted), None, emitted


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, min(6, len(text) - 1) + 1)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_spanning_chunks(include: bool) -> None:
    chunks = ["Hello ", "ST", "O", "P wor", "ld"]
    text, stop, emitted = stream(chunks, ["STOP"], include)
    assert stop == "STOP"
    assert text == ("Hello STOP" if include else "Hello ")
    if not include:
        # "ST" and "O" were held back: nothing of the stop string ever became visible.
        assert emitted == ["Hello ", "", "", ""]


def test_hold_back_then_release() -> None:
    first = check_stop("", "abc</", ["</s>"])
    assert (first.stopped, first.emit, first.held) == (False, "abc", "</")
    second = check_stop(first.held, "b>x", ["</s>"])
    assert (second.stopped, second.emit, second.held) == (False, "</b>x", "")
    final = check_stop("", "tail<", ["<|end|>"], final=True)
    assert (final.emit, final.held) == ("tail<", "")
    matcher = StopStringMatcher(["<|end|>"])
    assert matcher.feed("ok <|en").emit == "ok "
    assert matcher.flush() == "<|en"


def test_first_ending_stop_wins_and_text_after_is_dropped() -> None:
    result = check_stop("", "hello world and more", ["world", "lo w"])
    assert (result.stop_str, result.emit) == ("lo w", "hel")
    result = check_stop("", "xabcx", ["bc", "abc"], include_stop_str_in_output=True)
    assert (result.stop_str, result.emit) == ("abc", "xabc")


def test_no_stops_emits_everything() -> None:
    assert check_stop("", "anything", []).emit == "anything"


def test_chunking_invariance_against_reference() -> None:
    rng = random.Random(1234)
    for _ in range(400):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(2)]
        stops = [s for s in stops if s]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(2, 14)))
        include = rng.random() < 0.5
        want_text, want_stop = reference_stop(text, stops, include)
        got_text, got_stop, _ = stream(random_chunks(text, rng), stops, include)
        assert (got_text, got_stop) == (want_text, want_stop), (text, stops, include)


def test_feed_after_stop_is_an_error() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax").stopped
    with pytest.raises(RuntimeError):
        matcher.feed("more")
