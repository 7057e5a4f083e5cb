"""The server's engine loop: one thread owns the `Engine` and steps it while requests are live;
the web side submits and aborts through a command queue and receives, per request, one
`Update` per step that changed it (new text, tokens, logprobs; the output when it is done).

Invariant: only the loop thread touches the engine. A request joins the running batch at the
next step after its submission (one whose structured-output grammar is not built yet, once a
worker thread has built it); an abort frees its KV blocks in the next loop turn. Admission
is bounded: past `max_queued_requests` requests (or `max_queued_prompt_tokens` prompt tokens)
that have not produced a token yet, `submit` raises `QueueFull` instead of queueing; a prompt
larger than the token bound alone raises `ValueError` (it would never fit). Once the loop thread
has ended (stopped, or the engine raised), `submit` raises `EngineStopped`, and every request
submitted before that gets an aborted last update: no request waits for a thread that is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.engine.engine import Engine
from shoal.engine.outputs import Logprob, RequestOutput
from shoal.sampling import SamplingParams

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """Too many requests are waiting for their first token (HTTP 429)."""


class EngineStopped(RuntimeError):
    """The engine loop has ended: shutting down, or the engine failed (HTTP 503)."""


@dataclass
class Update:
    """What changed for one request in one step; per choice (n > 1), in choice order."""

    text: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[tuple[int, dict[int, Logprob]]]]
    finish_reasons: list[str | None]
    output: RequestOutput | None = None  # set once the request is done (then it is the last)
    prompt_logprobs: list | None = None  # on a request's first update, when it asked for them


@dataclass
class Handle:
    """One submitted request as the web side sees it; its updates go to `sink` (for a web
    handler: its asyncio queue, `on_event_loop`)."""

    prompt_tokens: int
    sink: Callable[[Update], None]
    updates: asyncio.Queue | None = None
    group: str | None = None  # set by the loop thread
    submitted: float = field(default_factory=time.perf_counter)
    started: bool = False  # produced a token (or finished): no longer queued
    last_token_time: float | None = None  # (metrics: inter-token latency)
    generated: int = 0  # tokens its choices produced so far (the web side counts them)
    sent: list[list[int]] = field(default_factory=list)  # per choice: text, tokens, logprobs
    watcher: asyncio.Task | None = None  # the web side's disconnect watch

    @classmethod
    def on_event_loop(cls, prompt_tokens: int, mailbox: Mailbox) -> Handle:
        """A handle whose updates arrive in `updates` on `mailbox`'s event loop."""
        updates: asyncio.Queue = asyncio.Queue()
        return cls(prompt_tokens, lambda u: mailbox.post(updates, u), updates)

    def push(self, update: Update) -> None:
        self.sink(update)


class Mailbox:
    """Updates from the loop thread to queues on one asyncio event loop, delivered in batches:
    the first post after a delivery schedules the next one, so a step that updates every
    running request wakes the event loop once (a `call_soon_threadsafe` per update writes to
    the loop's self-pipe and takes the interpreter lock once per request)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: list[tuple[asyncio.Queue, Update]] = []
        self._lock = threading.Lock()

    def post(self, updates: asyncio.Queue, update: Update) -> None:
        with self._lock:
            self._pending.append((updates, update))
            first = len(self._pending) == 1
        if first:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for updates, update in pending:
            updates.put_nowait(update)


@dataclass(frozen=True)
class Limits:
    max_queued_requests: int = 256
    max_queued_prompt_tokens: int = 1 << 20


class EngineLoop:
    def __init__(self, engine: Engine | None, limits: Limits | None = None,
                 tokenizer=None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.limits = limits or Limits()
        self._commands: queue.Queue = queue.Queue()
        self._mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}  # (submitting side)
        self._live: dict[str, Handle] = {}  # group -> handle (loop thread only)
        self._lock = threading.Lock()
        self._queued = [0, 0]  # requests, prompt tokens not yet started (under _lock)
        self._closed = False  # the loop thread takes no more commands (under _lock)
        self._compiling: dict[int, Handle] = {}  # id -> handle whose grammar builds (_lock)
        self._aborted_compiling: set[int] = set()  # (loop thread only)
        self._grammars: concurrent.futures.ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self.snapshot: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="shoal-engine", daemon=True)
        self.error: BaseException | None = None

    # ---- the web side -----------------------------------------------------------------------
    def start(self) -> None:
        self._snapshot()
        self._thread.start()

    def submit(self, prompt: str | None, params: SamplingParams,
               prompt_token_ids: Sequence[int] | None = None, priority: int = 0,
               sink: Callable[[Update], None] | None = None) -> Handle:
        """Queue a request; QueueFull past the limits. Its updates go to `sink`, by default
        to the returned handle's queue on the calling event loop."""
        tokens = len(prompt_token_ids) if prompt_token_ids is not None else \
            len(self.tokenizer.encode(prompt or "", add_special_tokens=True))
        if tokens > self.limits.max_queued_prompt_tokens:
            raise ValueError(f"the prompt has {tokens} tokens, more than this server queues "
                             f"at once (max_queued_prompt_tokens = "
                             f"{self.limits.max_queued_prompt_tokens})")
        if sink is None:
            loop = asyncio.get_running_loop()
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = Mailbox(loop)
            handle = Handle.on_event_loop(tokens, mailbox)
        else:
            handle = Handle(tokens, sink)
        with self._lock:
            if self._closed:
                raise EngineStopped(self.stopped_reason())
            if self._queued[0] >= self.limits.max_queued_requests:
                raise QueueFull(f"{self._queued[0]} requests are already waiting (limit "
                                f"{self.limits.max_queued_requests}); retry later")
            if self._queued[1] + tokens > self.limits.max_queued_prompt_tokens:
                raise QueueFull(f"{self._queued[1]} prompt tokens are already waiting (limit "
                                f"{self.limits.max_queued_prompt_tokens}); retry later")
            self._queued[0] += 1
            self._queued[1] += tokens
            self._commands.put(("add", handle, (prompt, params, prompt_token_ids, priority)))
        return handle

    def abort(self, handle: Handle) -> None:
        self._commands.put(("abort", handle, None))

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is live and end the thread."""
        self._stop.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout)

    def stopped_reason(self) -> str:
        """Why requests end unanswered once the loop winds down."""
        if self.error is not None:
            return f"the engine stopped: {self.error!r}"
        return "the server is shutting down"

    @property
    def alive(self) -> bool:
        """Started and taking requests (false from the moment the loop starts to wind down)."""
        with self._lock:
            return self._thread.is_alive() and not self._closed

    # ---- the loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the server reports it on /health
            self.error = exc
            raise
        finally:  # wake every waiter with an aborted end; settle the engine
            with self._lock:
                self._closed = True
                compiling = list(self._compiling.values())
                self._compiling.clear()
            if self._grammars is not None:
                self._grammars.shutdown(wait=False, cancel_futures=True)
            for handle in compiling:  # no choices, an aborted end
                handle.push(Update([], [], [], []))
            for handle in self._live.values():
                handle.push(Update([""] * len(handle.sent), [[] for _ in handle.sent],
                                   [[] for _ in handle.sent], ["abort"] * len(handle.sent)))
            self._settle(list(self._live))
            self._live.clear()
            while True:  # submitted but never added: no choices, an aborted end
                try:
                    kind, handle, _ = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    handle.push(Update([], [], [], []))
            # nothing runs or waits any more (a dead replica's last report would say otherwise)
            self.snapshot = {**self.snapshot, "running": 0, "waiting": 0, "queued_requests": 0,
                             "queued_prompt_tokens": 0, "kv_blocks_used": 0}

    def _loop(self) -> None:
        engine = self.engine
        if engine.ep is not None:  # expert parallelism: step while any rank has work, and
            while True:  # stop when any rank stops (the ranks' collectives stay matched)
                if self._drain(block=False):
                    self._publish()  # requests rejected at add time are complete already
                stepped, stopping = engine.step_or_serve(self._stop.is_set())
                if stopping:
                    return
                if stepped:
                    self._publish()
                else:
                    time.sleep(0.002)
                self._snapshot()
        while not self._stop.is_set():
            if self._drain(block=not engine.has_unfinished()):
                self._publish()  # requests rejected at add time are complete already
            if engine.has_unfinished():
                engine.step()
                self._publish()
            self._snapshot()

    def _settle(self, groups: list[str]) -> None:
        """The loop has ended: abort what is live (their handles got their aborted end)."""
        self.engine.cancel(groups)

    def _drain(self, block: bool) -> bool:
        """Take the web side's commands; whether there were any."""
        try:
            command = self._commands.get(timeout=0.05) if block else \
                self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            kind, handle, args = command
            if kind == "add" and not self._compile_first(handle, args):
                self._add(handle, *args)
            elif kind == "compiled":
                with self._lock:
                    self._compiling.pop(id(handle), None)
                self._add(handle, *args)
                if id(handle) in self._aborted_compiling:
                    self._aborted_compiling.discard(id(handle))
                    self._abort(handle)
            elif kind == "abort" and handle.group in self._live:
                self._abort(handle)
            elif kind == "abort":
                with self._lock:
                    if id(handle) in self._compiling:
                        self._aborted_compiling.add(id(handle))
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _compile_first(self, handle: Handle, args: tuple) -> bool:
        """Whether the request's structured-output grammar is not built yet: it then builds on
        a worker thread while the engine steps (building one can take a second), and the
        request comes back as a "compiled" command; a cached grammar is added at once."""
        spec = getattr(args[1], "structured", None)
        if spec is None or self.engine is None:
            return False
        try:
            backend = self.engine.structured_backend()
            if backend.is_compiled(spec):
                return False
        except Exception:  # the request's own checks report it
            return False
        if self._grammars is None:
            self._grammars = concurrent.futures.ThreadPoolExecutor(
                max_workers=2, thread_name_prefix="shoal-grammar")
        with self._lock:
            self._compiling[id(handle)] = handle

        def build() -> None:
            try:
                backend.prepare(spec)
            finally:  # the request always comes back (its own checks report a failure)
                with self._lock:
                    if not self._closed:
                        self._commands.put(("compiled", handle, args))

        self._grammars.submit(build)
        return True

    def _add(self, handle: Handle, prompt, params: SamplingParams, ids, priority: int) -> None:
        try:
            handle.group = self.engine.add_request(prompt, params, prompt_token_ids=ids,
                                                   priority=priority)
        except Exception as exc:  # one request's failure ends that request, not the loop
            logger.exception("adding a request failed")
            handle.group = self.engine.add_request(None, params, error=f"{type(exc).__name__}: "
                                                   f"{(str(exc).strip().splitlines() or [''])[0]}")
        self._live[handle.group] = handle
        handle.sent = [[0, 0, 0] for _ in self.engine.groups[handle.group]]

    def _abort(self, handle: Handle) -> None:
        """Free the request's blocks now; its final update comes with the next step."""
        self.engine.abort(handle.group)

    def _started(self, handle: Handle) -> None:
        """The request produced its first token (or finished): no longer queued."""
        if not handle.started:
            handle.started = True
            with self._lock:
                self._queued[0] -= 1
                self._queued[1] -= handle.prompt_tokens

    def _publish(self) -> None:
        engine = self.engine
        for group, handle in list(self._live.items()):
            children = [engine.requests[r] for r in engine.groups[group]]
            text, tokens, logprobs, reasons = [], [], [], []
            changed = False
            for child, sent in zip(children, handle.sent, strict=True):
                text.append(child.text[sent[0]:])
                tokens.append(child.output_token_ids[sent[1]:])
                lps = child.logprobs or []
                logprobs.append(list(zip(child.output_token_ids[sent[2]:], lps[sent[2]:],
                                         strict=False)))
                reasons.append(child.finish_reason)
                changed = changed or bool(text[-1] or tokens[-1])
                sent[:] = [len(child.text), len(child.output_token_ids), len(lps)]
            done = all(c.finished for c in children)
            if not (changed or done):
                continue
            first = not handle.started
            self._started(handle)
            output = None
            if done:
                output = engine.output(group)
                engine.release(group)
                del self._live[group]
            handle.push(Update(text, tokens, logprobs, reasons, output,
                               children[0].prompt_logprobs if first else None))

    def _snapshot(self) -> None:
        s, scheduler = self.engine.stats, self.engine.scheduler
        usage = scheduler.usage()
        with self._lock:
            queued = tuple(self._queued)
        self.snapshot = {
            "running": len(scheduler.running), "waiting": len(scheduler.waiting),
            "queued_requests": queued[0], "queued_prompt_tokens": queued[1],
            "kv_blocks_used": usage.num_used_blocks, "kv_blocks_total": usage.num_blocks,
            "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens,
            "preemptions": s.preemptions, "requests": s.num_requests, "errors": s.num_errors,
            "drafts_proposed": s.drafts_proposed, "drafts_accepted": s.drafts_accepted,
            "drafts_proposed_at": list(s.drafts_proposed_at),
            "drafts_accepted_at": list(s.drafts_accepted_at), "spec_verify_rows": s.verify_rows,
            "steps": s.steps,
        }
        prefix = scheduler.prefix_stats
        if prefix is not None:
            self.snapshot.update(
                prefix_query_tokens=prefix.query_tokens, prefix_hit_tokens=prefix.hit_tokens,
                prefix_host_hit_tokens=prefix.host_hit_tokens,
                prefix_store_hit_tokens=prefix.store_hit_tokens,
                prefix_snapshots_saved=prefix.snapshots_saved,
                prefix_snapshot_evictions=prefix.snapshot_evictions,
                kv_block_evictions=scheduler.kv.pool.num_evictions,
                kv_blocks_cached_idle=scheduler.kv.pool.num_evictable)
            store = scheduler.kv.prefix.store
            if store is not None:
                st = store.stats()
                self.snapshot.update({f"kv_store_{name}": getattr(st, name) for name in (
                    "puts", "dropped_puts", "hits", "misses", "lost_reads", "evicted")})
