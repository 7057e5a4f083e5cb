"""Ctrl-C in a test: a KeyboardInterrupt raised in the main thread after a delay."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def interrupt_after(seconds: float) -> Iterator[None]:
    """Raise KeyboardInterrupt `seconds` into the block (SIGALRM); disarmed when it ends."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
