"""`shoal serve` over data-parallel replicas (`--dp N`, with or without expert parallelism).

The front end's loop thread (`ReplicaLoop`) sends each request to a replica process and hands
that replica's per-step updates to the request's handle; each replica runs an `EngineLoop` of
its own over its engine (`serve_replica`), so a request joins its replica's running batch at
the next step, and under expert parallelism every replica keeps stepping while any has work.

Placement: a new request goes to the replica with the fewest live requests (ties: the lowest
rank); with prefix caching, to the replica sent the longest prefix of its prompt if that one
holds at most `affinity_slack` more live requests (parallel/prefix_affinity.py). /metrics sums
the replicas' latest snapshots, which each sends every SNAPSHOT_S.
Invariant, as EngineLoop's: every submitted request gets its last update exactly once, also
when a replica fails or dies (every live request then ends aborted and the server answers 503).
"""

from __future__ import annotations

import functools
import itertools
import queue
from itertools import zip_longest

from shoal.config import ShoalError
from shoal.engine.engine import Engine
from shoal.sampling import SamplingParams
from shoal.serve.engine_loop import EngineLoop, EngineStopped, Handle, Limits, Update

SNAPSHOT_S = 0.25


def _last(update: Update) -> bool:
    """The request's last update: its output, or its aborted end."""
    return update.output is not None or all(r == "abort" for r in update.finish_reasons)


class ReplicaLoop(EngineLoop):
    """EngineLoop's web side (limits, handles, the end of every request) over replicas."""

    def __init__(self, replicas, tokenizer, limits: Limits | None = None) -> None:
        super().__init__(None, limits, tokenizer)
        self.replicas = replicas
        self._keys = itertools.count()
        self._rank: dict[str, int] = {}  # live request -> its replica
        self._load = [0] * replicas.size  # live requests per replica
        self._snapshots: list[dict] = [{} for _ in range(replicas.size)]

    @property
    def replica_snapshots(self) -> list[dict]:
        """Each replica's latest snapshot (the sum is `snapshot`)."""
        return list(self._snapshots)

    def _loop(self) -> None:
        for commands in self.replicas.commands:
            commands.put(("serve", None, None))
        while not self._stop.is_set():
            self._drain(block=False)
            self._receive(timeout=0.005)
            self._snapshot()

    def _add(self, handle: Handle, prompt, params: SamplingParams, ids, priority: int) -> None:
        key = str(next(self._keys))
        ranks = range(self.replicas.size)
        rank = min(ranks, key=lambda r: (self._load[r], r))
        affinity = self.replicas.affinity
        if affinity is not None:  # prefix caching: where its prefix probably is
            rank = affinity.place(ids if ids is not None else prompt or "", rank, ranks,
                                  self._load, self.replicas.affinity_slack)
        handle.group = key
        handle.sent = [[0, 0, 0] for _ in range(params.n)]  # one per choice (aborted ends)
        self._live[key], self._rank[key] = handle, rank
        self._load[rank] += 1
        self.replicas.commands[rank].put(("add", key, (prompt, params, ids, priority)))

    def _abort(self, handle: Handle) -> None:
        self.replicas.commands[self._rank[handle.group]].put(("abort", handle.group, None))

    def _receive(self, timeout: float) -> None:
        """Hand out what the replicas sent (waiting up to `timeout` for the first message)."""
        message = self.replicas.receive(timeout)
        if message is None:
            if exited := self.replicas.exited():
                raise ShoalError("data-parallel " + exited.removeprefix("; "))
            return
        while message is not None:
            kind, key, rank, payload = message
            if kind == "update" and key in self._live:
                handle = self._live[key]
                self._started(handle)
                if _last(payload):
                    del self._live[key]
                    self._load[self._rank.pop(key)] -= 1
                handle.push(payload)
            elif kind == "snapshot":
                self._snapshots[rank] = payload
            elif kind == "failed":
                raise ShoalError(f"data-parallel replica {rank}: {payload}")
            message = self.replicas.receive(0)

    def _settle(self, groups: list[str]) -> None:
        for key in groups:
            self.replicas.commands[self._rank.pop(key)].put(("abort", key, None))
        for commands in self.replicas.commands:
            commands.put(("stop-serving", None, None))

    def _snapshot(self) -> None:
        total: dict = {}
        for snap in self._snapshots:
            for name, value in snap.items():
                total[name] = [a + b for a, b in zip_longest(total.get(name, []), value,
                                                             fillvalue=0)] \
                    if isinstance(value, list) else total.get(name, 0) + value
        with self._lock:
            total["queued_requests"], total["queued_prompt_tokens"] = self._queued
        if self.replicas.affinity is not None:
            for outcome, count in self.replicas.affinity.placed.items():
                total[f"affinity_{outcome}"] = count
        self.snapshot = total


def serve_replica(engine: Engine, rank: int, commands, results) -> bool:
    """A replica's side of `shoal serve`: an EngineLoop of its own over `engine`, fed by the
    front end's ("add", key, (prompt, params, ids, priority)) and ("abort", key) commands; its
    updates and snapshots go back on `results`. Ends at ("stop-serving") or ("stop"); returns True for
    "stop" (the LLM is closing: the replica process ends)."""
    loop = EngineLoop(engine, Limits(1 << 62, 1 << 62))  # the front end applies the limits
    handles: dict[str, Handle] = {}

    def sink(key: str, update: Update) -> None:
        if _last(update):
            handles.pop(key, None)
        results.put(("update", key, rank, update))

    loop.start()
    closing = False
    try:
        while loop.alive:
            try:
                kind, key, args = commands.get(timeout=SNAPSHOT_S)
            except queue.Empty:
                kind = None
            if kind in ("stop", "stop-serving"):
                closing = kind == "stop"
                break
            if kind == "add":
                try:
                    handles[key] = loop.submit(*args, sink=functools.partial(sink, key))
                except EngineStopped:
                    break
            elif kind == "abort" and key in handles:
                loop.abort(handles[key])
            results.put(("snapshot", None, rank, dict(loop.snapshot)))
    finally:
        loop.stop(timeout=60)
        if loop.error is not None:
            results.put(("failed", None, rank, f"{type(loop.error).__name__}: {loop.error}"))
    return closing
