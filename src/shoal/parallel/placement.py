"""Which replica runs which request: by estimated load, either all up front (`split_by_load`:
expert parallelism and torchrun, where every rank must agree without talking) or as replicas
make room (`Feeder`: data-parallel replicas of one front end; with prefix caching, by prefix
affinity within a slack of the least busy, prefix_affinity.py)."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from shoal.parallel.prefix_affinity import PrefixAffinity


def _load_estimate(item: dict) -> int:
    """A request's tokens, roughly: its prompt (tokens, or characters / 4 for text) plus the
    tokens it may generate (max_tokens per sequence, 256 when unbounded)."""
    if "prompt_token_ids" in item and isinstance(item["prompt_token_ids"], Sequence):
        prompt = len(item["prompt_token_ids"])
    else:
        text = item.get("prompt", item.get("messages", ""))
        if isinstance(text, Sequence) and not isinstance(text, str) and \
                all(isinstance(t, int) for t in text):
            prompt = len(text)
        else:
            prompt = max(1, len(str(text)) // 4)
    params = item.get("sampling_params")
    out = getattr(params, "max_tokens", None) or 256
    return prompt + out * getattr(params, "n", 1)


def split_by_load(items: Sequence[dict], size: int) -> list[list[int]]:
    """Each replica's request positions: every request goes to the replica with the fewest
    estimated tokens so far (`_load_estimate`; ties: the lowest rank). Deterministic, so ranks
    launched by torchrun agree on it without talking."""
    loads = [0] * size
    shares: list[list[int]] = [[] for _ in range(size)]
    for position, item in enumerate(items):
        rank = min(range(size), key=loads.__getitem__)
        loads[rank] += _load_estimate(item)
        shares[rank].append(position)
    return shares


class Feeder:
    """The front end's side of feeding one call (see the module docstring): which requests
    wait, what each replica holds, and which replica served each request (`served_by`)."""

    def __init__(self, items: Sequence[dict], base: int, size: int, window: int,
                 affinity: PrefixAffinity | None = None, slack: int = 0) -> None:
        self.items, self.base, self.window = items, base, window
        self.affinity, self.slack = affinity, slack
        self.estimate = [_load_estimate(item) for item in items]
        self.waiting = collections.deque(range(len(items)))
        self.held = [0] * size  # unfinished requests per replica
        self.tokens = [0] * size  # their estimated tokens
        self.started: set[int] = set()
        self.ended: set[int] = set()
        self.served_by: dict[int, int] = {}  # input position -> replica

    def dispatch(self, call: int, commands) -> set[int]:
        """Send waiting requests to open replicas (then "end" to every started replica once
        none waits); returns the replicas started so far."""
        batches: dict[int, list] = {}
        while self.waiting:
            open_ = [r for r in range(len(self.held)) if self.held[r] < self.window]
            if not open_:
                break
            rank = min(open_, key=lambda r: (self.tokens[r], r))
            position = self.waiting.popleft()
            if self.affinity is not None:  # prefix caching: where its prefix probably is
                rank = self.affinity.place(self.affinity.prompt_of(self.items[position]), rank,
                                           open_, self.held, self.slack)
            self.held[rank] += 1
            self.tokens[rank] += self.estimate[position]
            self.served_by[position] = rank
            batches.setdefault(rank, []).append(
                (position, {"request_index": self.base + position, **self.items[position]}))
        for rank, batch in batches.items():
            commands[rank].put(("feed", call, batch))
            self.started.add(rank)
        if not self.waiting:
            self.end(call, commands)
        return set(self.started)

    def end(self, call: int, commands) -> None:
        """No more requests: "end" to every started replica not yet told."""
        self.waiting.clear()
        for rank in sorted(self.started - self.ended):
            commands[rank].put(("end", call, None))
            self.ended.add(rank)

    def finished(self, rank: int, position: int) -> None:
        self.held[rank] -= 1
        self.tokens[rank] -= self.estimate[position]
