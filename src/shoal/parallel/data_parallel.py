"""Data parallelism: N engine replicas, each in its own process with its own scheduler and KV
pool (one GPU each, or a share of the CPU threads), and a front end that feeds each call's
requests to them as they make room and yields outputs as they finish.

Feeding: a replica holds at most `window` unfinished requests (twice its max_num_seqs, so its
scheduler always has a queue to fill freed slots from); each time one finishes, the front end
sends the next request in input order to the open replica with the fewest estimated tokens
outstanding (`placement.Feeder`): a replica whose requests end early takes more, none idles.

With `expert_parallel`, the replicas form one torch.distributed group (NCCL on GPUs, gloo on
the CPU) and shard the routed experts (`parallel/expert_parallel.py`): every call goes to every
replica (one with no requests still serves its experts), and an interrupt is a cancel event the
replicas see at the same step instead of a signal (a signal would stop them mid-collective).

Invariant: every request carries a global request index, assigned in input order, so its
sampling seed (and its id) is what a single engine would give it: outputs do not depend on
the number of replicas. An interrupt in the front end interrupts the replicas' current call;
they abort its requests and stay usable, like a single engine. A replica that dies ends the
call with an error naming it."""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.multiprocessing as mp

from shoal.config import CacheConfig, RunnerConfig, ShoalError
from shoal.engine.outputs import RequestOutput
from shoal.engine.stats import summed
from shoal.parallel.placement import Feeder, split_by_load
from shoal.parallel.prefix_affinity import PrefixAffinity
from shoal.scheduler.config import SchedulerConfig

READY_TIMEOUT_S = 1800.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Results:
    """A replica's own results pipe (`put` from any of its threads; see `receive`)."""

    def __init__(self, writer) -> None:
        self.writer, self.lock = writer, threading.Lock()

    def put(self, message: tuple) -> None:
        with self.lock:
            self.writer.send(message)


def _replica(rank: int, model: str, options: dict, threads: int, commands, writer,
             group: tuple[int, int, str] | None, cancel) -> None:
    """A replica's process: an LLM of its own, running the calls it is sent. `group`: (world
    size, port, backend) of the expert-parallel process group to join."""
    results = _Results(writer)
    running = [False]
    last_call = [-1]  # the last fed call served (calls are numbered in order)

    def interrupt(signum, frame):
        if running[0]:
            raise KeyboardInterrupt

    # expert parallelism: a terminal's Ctrl-C reaches every process; the front end cancels
    signal.signal(signal.SIGINT, interrupt if group is None else signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        if group is not None:
            import torch.distributed as dist

            world, port, backend = group
            if backend == "nccl":
                torch.cuda.set_device(rank)
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world,
                                    timeout=timedelta(seconds=options.get(
                                        "collective_timeout_s",
                                        RunnerConfig.collective_timeout_s)))
        from shoal.llm import LLM

        llm = LLM(model, **options)
        llm.engine.cancel_asked = cancel.is_set
    except BaseException as exc:  # reported by the front end
        results.put(("failed", None, rank, f"{type(exc).__name__}: {exc}"))
        return
    results.put(("ready", None, rank, None))
    while True:
        command = commands.get()
        if command[0] == "stop":
            return
        if command[0] in ("feed", "end"):
            if command[1] > last_call[0]:  # else left over from a finished (interrupted) call
                _serve_fed(llm, rank, command, commands, results, running)
                last_call[0] = command[1]
            continue
        if command[0] == "serve":  # `shoal serve`: this replica's engine loop until it ends
            from shoal.serve.replica_loop import serve_replica

            if serve_replica(llm.engine, rank, commands, results):
                return
            continue
        if _answer(llm, rank, command, results):
            continue
        _, call, items = command
        running[0] = True
        try:
            for position, out in llm.run([item for _, item in items], use_tqdm=False):
                results.put(("out", call, rank, (items[position][0], out)))
            running[0] = False
            llm.engine.serve_until_idle()
            results.put(("done", call, rank, None))
        except KeyboardInterrupt:
            running[0] = False
            llm.engine.serve_until_idle()
            results.put(("cancelled", call, rank, None))
        except BaseException as exc:  # noqa: BLE001 - the front end raises it
            running[0] = False
            results.put(("failed", call, rank, f"{type(exc).__name__}: {exc}"))


def _answer(llm, rank: int, command: tuple, results) -> bool:
    """Answer a query of the front end ("loads", "stats"; also in the middle of a call);
    whether `command` was one."""
    if command[0] == "loads":
        try:
            results.put(("loads", None, rank, llm.expert_loads()))
        except ValueError as exc:
            results.put(("failed", None, rank, str(exc)))
    elif command[0] == "stats":
        results.put(("stats", None, rank, (llm.engine.stats, llm.engine.scheduler.prefix_stats)))
    else:
        return False
    return True


def _serve_fed(llm, rank: int, first: tuple, commands, results, running: list) -> None:
    """One call of a replica fed while it runs: `first` and the later ("feed", call, items)
    commands add requests, ("end", call) says no more come; commands of an older (interrupted)
    call are dropped."""
    call = first[1]

    def feed(wait: bool) -> list | None:
        nonlocal first
        while True:
            if first is not None:
                command, first = first, None
            else:
                try:
                    command = commands.get(block=wait)
                except queue.Empty:
                    return []
            if command[0] == "stop":  # the LLM closed mid-call: stop after this call
                commands.put(command)
                return None
            if _answer(llm, rank, command, results) or command[1] != call:
                continue
            return None if command[0] == "end" else command[2]

    running[0] = True
    try:
        for position, out in llm.run_fed(feed):
            results.put(("out", call, rank, (position, out)))
        running[0] = False
        results.put(("done", call, rank, None))
    except KeyboardInterrupt:
        running[0] = False
        results.put(("cancelled", call, rank, None))
    except BaseException as exc:  # noqa: BLE001 - the front end raises it
        running[0] = False
        results.put(("failed", call, rank, f"{type(exc).__name__}: {exc}"))


class DataParallel:
    def __init__(self, model: str, size: int, options: dict[str, Any]) -> None:
        if size < 1:
            raise ShoalError(f"data_parallel_size: got {size}, expected >= 1")
        device = options.get("device", "auto")
        use_cuda = device in ("auto", "cuda") and torch.cuda.is_available()
        if use_cuda and torch.cuda.device_count() < size:
            raise ShoalError(f"data_parallel_size={size} needs {size} GPUs; "
                             f"{torch.cuda.device_count()} visible")
        if device.startswith("cuda:"):
            raise ShoalError("data_parallel_size > 1 places one replica per GPU: use device "
                             "'auto' or 'cuda', not a single device")
        threads = max(1, len(os.sched_getaffinity(0)) // size)
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=False) for _ in range(size)]
        self._readers = [reader for reader, _ in pipes]  # of the replicas not yet gone
        self._inbox: collections.deque = collections.deque()  # received, not yet taken
        self.commands = [ctx.Queue() for _ in range(size)]
        self.cancel = ctx.Event()
        self.expert_parallel = bool(options.get("expert_parallel"))
        self.broken = ""  # expert parallelism: the error that stopped the group
        group = (size, _free_port(), "nccl" if use_cuda else "gloo") \
            if self.expert_parallel else None
        self.processes = []
        for rank in range(size):
            opts = dict(options, device=f"cuda:{rank}" if use_cuda else "cpu")
            proc = ctx.Process(target=_replica, daemon=True, name=f"shoal-dp{rank}",
                               args=(rank, model, opts, threads, self.commands[rank],
                                     pipes[rank][1], group, self.cancel))
            proc.start()
            pipes[rank][1].close()  # the replica's copy only: its exit reads as an end here
            self.processes.append(proc)
        self.size = size
        seqs = options.get("max_num_seqs", SchedulerConfig.max_num_seqs)
        self.window = 2 * seqs
        # prefix caching: a request goes where its prefix was sent, within `affinity_slack`
        # requests of the least busy replica (32 at the default 64 seqs, as SGLang's router)
        self.affinity = PrefixAffinity(options.get("block_size", CacheConfig.block_size)) \
            if options.get("enable_prefix_caching") and size > 1 else None
        self.affinity_slack = max(1, seqs // 2)
        self.served_by: dict[int, int] = {}  # the last call's input position -> replica
        self._calls = itertools.count()
        self._next_index = 0  # global request index of the next call's first request
        for _ in range(size):  # each replica answers "ready" or "failed" once
            try:
                kind, _, rank, message = self._get(READY_TIMEOUT_S)
            except ShoalError as exc:  # exited before it could say why: most often a script
                self.close()  # without the main guard, which each spawned replica re-runs
                hint = " before being ready; a script that creates LLM(data_parallel_size=N) " \
                    "must do so under `if __name__ == '__main__':` (each replica is a spawned " \
                    "process that imports the script)" if "exited" in str(exc) else ""
                raise ShoalError(f"{exc}{hint}") from None
            if kind == "failed":
                self.close()
                raise ShoalError(f"data-parallel replica {rank} failed to start: {message}")

    def exited(self) -> str:
        """'; replica(s) exited: rank r (exit code c), ...' or '' when all are alive."""
        dead = [(r, p.exitcode) for r, p in enumerate(self.processes) if not p.is_alive()]
        return "; replica(s) exited: " + ", ".join(
            f"rank {r} (exit code {code})" for r, code in dead) if dead else ""

    def receive(self, timeout: float) -> tuple | None:
        """The next message of any replica, waiting up to `timeout` s (None: none came). One
        pipe per replica (one stopped mid-write blocks no other), one read per ready replica
        per round (none starves the others)."""
        if not self._inbox:
            for reader in wait(self._readers, timeout):
                try:
                    self._inbox.append(reader.recv())
                except EOFError:  # the replica is gone (`exited` names it)
                    self._readers.remove(reader)
        return self._inbox.popleft() if self._inbox else None

    def _get(self, timeout: float):
        """The next message; a replica that exits meanwhile is an error that names it."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.receive(min(1.0, max(0.0, deadline - time.monotonic())))
            if message is not None:
                return message
            if exited := self.exited():
                raise ShoalError("data-parallel " + exited.removeprefix("; "))
            if time.monotonic() >= deadline:
                raise ShoalError("data-parallel replicas did not answer")

    def run(self, items: Sequence[dict], use_tqdm: bool = False
            ) -> Iterator[tuple[int, RequestOutput]]:
        """Feed `items` to the replicas (`Feeder`; under expert parallelism each replica's
        `split_by_load` share up front) and yield (input index, output) as requests finish."""
        if self.broken:
            raise ShoalError(f"the expert-parallel group stopped after an error ({self.broken});"
                             " create a new LLM")
        call = next(self._calls)
        base, self._next_index = self._next_index, self._next_index + len(items)
        if self.expert_parallel:  # lockstep: each replica's share up front, every rank joins
            for rank, positions in enumerate(split_by_load(items, self.size)):
                share = [(p, {"request_index": base + p, **items[p]}) for p in positions]
                self.commands[rank].put(("run", call, share))
            busy, feeder = set(range(self.size)), None
        else:
            feeder = Feeder(items, base, self.size, self.window, self.affinity,
                            self.affinity_slack)
            busy = feeder.dispatch(call, self.commands)
        answered: set[int] = set()
        self.served_by = feeder.served_by if feeder is not None else {}
        try:
            while busy:
                kind, got_call, who, payload = self._get(READY_TIMEOUT_S)
                if got_call != call:
                    continue  # left over from an interrupted call
                if kind == "out":
                    position, out = payload
                    if feeder is not None:
                        feeder.finished(who, position)
                        busy |= feeder.dispatch(call, self.commands) - answered
                    yield position, out
                elif kind == "failed":
                    raise ShoalError(f"data-parallel replica {who}: {payload}{self.exited()}")
                else:
                    busy.discard(who)
                    answered.add(who)
        except BaseException as exc:
            if self.expert_parallel and isinstance(exc, ShoalError):
                self.broken = str(exc)  # a replica failed or died: the others wait inside a
                self.close(timeout=0.0)  # collective; stop them all
                raise
            if self.expert_parallel:  # seen by every replica at the same step
                self.cancel.set()
            else:
                feeder.end(call, self.commands)  # a replica not yet fed then ends by itself
                for rank in list(busy):  # interrupt their call; they abort its requests and
                    if not self.processes[rank].is_alive():  # answer (a dead one cannot)
                        busy.discard(rank)
                        continue
                    with contextlib.suppress(ProcessLookupError):  # (it died just now)
                        os.kill(self.processes[rank].pid, signal.SIGINT)
            try:
                while busy:
                    kind, got_call, who, _ = self._get(60.0)
                    if got_call == call and kind in ("done", "cancelled", "failed"):
                        busy.discard(who)
            except ShoalError:
                pass  # a replica died or went silent meanwhile: the first error is reported
            finally:
                self.cancel.clear()
            raise

    def expert_loads(self) -> dict[str, list[int]]:
        """The replicas' expert loads, summed."""
        for rank in range(self.size):
            self.commands[rank].put(("loads", None, None))
        total: dict[str, list[int]] = {}
        for _ in range(self.size):
            kind, _, rank, payload = self._get(60.0)
            if kind == "failed":
                raise ValueError(payload)
            for prefix, counts in payload.items():
                total[prefix] = [a + b for a, b in zip(total.get(prefix, [0] * len(counts)),
                                                       counts, strict=True)]
        return dict(sorted(total.items()))

    def stats(self) -> tuple:
        """The replicas' engine counters and prefix-cache counters (None when caching is
        off), summed."""
        for rank in range(self.size):
            self.commands[rank].put(("stats", None, None))
        got = []
        while len(got) < self.size:  # (an interrupted call's leftovers are skipped)
            kind, got_call, rank, payload = self._get(60.0)
            if kind == "failed" and got_call is None:
                raise ShoalError(f"data-parallel replica {rank}: {payload}")
            if kind == "stats":
                got.append(payload)
        prefix = [p for _, p in got if p is not None]
        return summed([s for s, _ in got]), summed(prefix) if prefix else None

    def close(self, timeout: float = 30.0) -> None:
        for rank, proc in enumerate(self.processes):
            if proc.is_alive():
                self.commands[rank].put(("stop", None, None))
        for proc in self.processes:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
