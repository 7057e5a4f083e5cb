"""The token-budget scheduler: which requests compute how many tokens in the next step.

Owns: the waiting queue, the running list, admission, chunked prefill, preemption (recompute)
and the stop checks that need no detokenizer (eos, stop ids, max_tokens, max_model_len).

Policy (vLLM v1 style, no prefill/decode modes; every request's `num_computed_tokens` catches up
with `num_tokens`):
1. Running requests, in admission order, each take `min(remaining, long-prefill cap, budget)`
   tokens (a decode is 1). If its blocks cannot grow, the most recently admitted running request
   is preempted (blocks and slot freed, `num_computed_tokens = 0`, outputs kept, put at the FRONT
   of the waiting queue) until it can, possibly the request itself.
2. If nobody was preempted this step, waiting requests are admitted strictly in queue order
   (the head is never skipped) while budget, `max_num_seqs`, slots and blocks allow. Admission
   never preempts.
`scheduling_policy="priority"` (vLLM's) keeps the waiting queue in (priority, arrival) order and
preempts the running request with the largest (priority, arrival) instead (one already
scheduled in the step gives its tokens back).

Invariants: every step's tokens <= max_num_batched_tokens; running <= min(max_num_seqs, slots);
a plan never schedules a request twice. A request that cannot fit in the whole pool finishes
with `kv_capacity` instead of spinning; invalid input finishes with `error` at `add_request`
(the engine reports it per request; nothing raises).

Applying a step's result (`update`, or `advance` and `resolve` under async scheduling) is
`scheduler/step_results.py`.
"""

from __future__ import annotations

import bisect
from collections import deque

from shoal.scheduler.config import SchedulerConfig
from shoal.scheduler.kv_cache_manager import KVCacheManager, KVCacheUsage
from shoal.scheduler.prefix_cache import PrefixCacheSpec, PrefixCacheStats
from shoal.scheduler.request import (
    FINISH_ABORT,
    FINISH_KV_CAPACITY,
    FINISH_STOP,
    UNRESOLVED,
    Request,
    RequestStatus,
    status_for_reason,
)
from shoal.scheduler.step_plan import (
    NewRequest,
    ScheduledRequest,
    StepPlan,
)
from shoal.scheduler.step_results import StepResults
from shoal.scheduler.validation import capacity_message, validate


class Scheduler(StepResults):
    """Plans steps over a fixed pool of `num_blocks` KV blocks of `block_size` tokens (the
    cache layout's page size) and `num_slots` request slots."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, num_slots: int,
                 block_size: int, prefix_cache: PrefixCacheSpec | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.kv = KVCacheManager(num_blocks, block_size, num_slots, prefix_cache)
        self.max_running = min(config.max_num_seqs, num_slots)
        self.requests: dict[str, Request] = {}  # every request not yet returned by update()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self._finished_for_plan: list[str] = []  # ids for the next plan's finished_ids
        self._finished_for_update: list[Request] = []  # returned by the next update()
        self._new: list[NewRequest] = []  # the plan being built: requests new to the runner
        self._outstanding: StepPlan | None = None  # scheduled, not yet advanced
        self._unresolved: StepPlan | None = None  # advanced, its tokens not yet resolved
        # speculative decoding under async scheduling: per request, how far the true positions
        # lie below those of the outstanding / unresolved plan (drafts rejected in the plan
        # before it, which was planned as if all were accepted)
        self._outstanding_shift: dict[str, int] = {}
        self._unresolved_shift: dict[str, int] = {}
        self._next_arrival = 0
        self._next_admission = 0
        self._next_step = 0

    # ---- requests in and out ----------------------------------------------------------------
    def add_request(self, request: Request) -> Request:
        """Queue `request` (FIFO). Invalid input finishes it at once with `error` / `kv_capacity`
        (status FINISHED_ERROR, message in `request.error`); it is returned by the next update().
        A duplicate live request_id raises ValueError (an engine bug, not user input)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} must be new (status WAITING, "
                             "nothing computed)")
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        self.requests[request.request_id] = request
        error, reason = validate(request, self.config.max_model_len, self.kv)
        if error is not None:
            self._finish(request, reason, error)
        else:
            self._enqueue(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; False if unknown or already finished."""
        return self.finish_request(request_id, FINISH_ABORT)

    def finish_request(self, request_id: str, reason: str = FINISH_STOP) -> bool:
        """Finish a live request from outside (stop strings, aborts); frees its resources now.
        Returns False if the request is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, reason)
        return True

    def has_unfinished(self) -> bool:
        """True while a request waits, runs, or finished without being returned by update() /
        resolve(), or while an advanced plan awaits resolve()."""
        return bool(self.waiting or self.running or self._finished_for_update
                    or self._unresolved is not None)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def usage(self) -> KVCacheUsage:
        return self.kv.usage()

    @property
    def prefix_stats(self) -> PrefixCacheStats | None:
        return None if self.kv.prefix is None else self.kv.prefix.stats

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan the next step (see the module docstring for the policy)."""
        if self._outstanding is not None:
            raise RuntimeError("schedule() called again before update() / advance() of the "
                               "previous plan")
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._new = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_tokens_to_schedule(request, budget)
            if self.kv.blocks_for_tokens(request.num_computed_tokens + num_new) > \
                    self.kv.num_blocks:
                self._finish(request, FINISH_KV_CAPACITY, capacity_message(request, self.kv))
                continue  # _finish removed it from running; the same index is the next one
            while not self.kv.can_allocate(request, num_new):
                victim = self._victim()
                at = self.running.index(victim)
                del self.running[at]
                if at < index:  # (priority policy) scheduled already in this step: undone
                    item = next(s for s in scheduled if s.request_id == victim.request_id)
                    scheduled.remove(item)
                    budget += item.num_new_tokens
                    index -= 1
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break  # it preempted itself: it was the last running request
            self.kv.allocate(request, num_new)
            scheduled.append(self._make_scheduled(request, num_new))
            budget -= num_new
            index += 1

        if not preempted:
            self._admit_waiting(budget, scheduled)

        if not scheduled and not self.running and self.waiting:
            # Defensive: nothing runs and the head cannot start; never spin on it.
            head = self.waiting[0]
            self._finish(head, FINISH_KV_CAPACITY, capacity_message(head, self.kv))

        plan = StepPlan(
            step_id=self._next_step, scheduled=tuple(scheduled),
            preempted_ids=tuple(preempted), finished_ids=tuple(self._finished_for_plan),
            num_scheduled_tokens=sum(s.num_new_tokens for s in scheduled),
            new_requests=tuple(self._new),
            transfers=self.kv.drain_transfers(),
        )
        self._finished_for_plan = []
        self._next_step += 1
        self._outstanding = plan
        return plan

    # ---- internals -------------------------------------------------------------------------
    def _num_tokens_to_schedule(self, request: Request, budget: int,
                                start: int | None = None) -> int:
        """start: the position the chunk starts at (default: num_computed_tokens)."""
        num_new = request.num_tokens - (request.num_computed_tokens if start is None else start)
        if num_new == 1 and request.spec_token_ids:  # a decode step verifying drafts
            room = self.config.max_model_len - request.num_tokens
            if request.max_tokens is not None:
                room = min(room, request.max_tokens - request.num_output_tokens)
            num_new += max(0, min(len(request.spec_token_ids), room - 1, budget - 1))
        cap = self.config.long_prefill_token_threshold
        if self.config.enable_chunked_prefill and cap and num_new > cap:
            num_new = cap
        return min(num_new, budget)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            hit = self.kv.find_prefix(request)
            if self.kv.waits_for_prefix(request, hit):
                break  # a running request is computing its next block: resume after it
            boundary = start = len(hit.block_ids) * self.block_size if hit else 0
            if hit is not None and hit.replay:  # rebuild the rings from the rows before it
                start = max(0, boundary - self.kv.prefix.replay_window)
            num_new = self._num_tokens_to_schedule(request, budget, start)
            remaining = request.num_tokens - start
            if not self.config.enable_chunked_prefill and num_new < remaining:
                break  # whole-prompt mode: wait for a step with enough budget (strict FIFO)
            if not self.kv.can_allocate(request, max(0, start + num_new - boundary), hit=hit):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.admission_index = self._next_admission
            self._next_admission += 1
            request.prefill_len = request.num_tokens
            request.needs_slot_reset = True
            if hit is not None and hit.block_ids:
                request.num_computed_tokens = start  # (allocate sets the snapshot to restore)
                request.replay = (start, boundary) if hit.replay else None
            if request.num_preemptions == 0:  # the prompt's first admission
                request.num_cached_tokens = start
            self.kv.allocate(request, num_new, hit=hit)
            self.kv.admitted(request, hit)
            self.running.append(request)
            scheduled.append(self._make_scheduled(request, num_new))
            budget -= num_new

    def _make_scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        num_spec = max(0, end - request.num_tokens)  # drafts beyond the known tokens
        history_start = max(0, start - self.config.num_history_tokens)
        assert request.slot is not None
        known = request.token_ids(start, end - num_spec)
        # the token of the step in flight is only ever the input of a decode chunk (with, under
        # speculative decoding, its drafts and the rows before it: all on the device)
        history = tuple(request.token_ids(history_start, start))
        assert UNRESOLVED not in known[:-1] and (len(known) == 1 or UNRESOLVED not in known), \
            request.request_id
        assert UNRESOLVED not in history or known == [UNRESOLVED], request.request_id
        item = ScheduledRequest(
            request_id=request.request_id, slot=request.slot,
            token_ids=tuple(known + request.spec_token_ids[:num_spec]),
            start_position=start, num_new_tokens=num_new, block_ids=tuple(request.block_ids),
            prefill_len=request.prefill_len, num_prompt_tokens=request.num_prompt_tokens,
            sample=end - num_spec == request.num_tokens, is_new_in_slot=request.needs_slot_reset,
            history_token_ids=history,
            num_spec_tokens=num_spec,
            restore_snapshot=request.restore_snapshot,
            replay=request.replay if request.replay and start < request.replay[1] else None,
            save_snapshots=self.kv.snapshot_saves(request, start, end),
        )
        request.restore_snapshot = -1
        if not request.sent_to_runner:
            request.sent_to_runner = True
            self._new.append(NewRequest(request.request_id, tuple(request.prompt_token_ids),
                                        request.sampling, request.seed))
        request.needs_slot_reset = False
        request.spec_token_ids = []
        return item

    def _victim(self) -> Request:
        """The running request to preempt: the most recently admitted (fcfs), or the one with
        the largest (priority, arrival) (priority policy)."""
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_index))
        return self.running[-1]

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: at the back, or the `front` (a preempted request), under
        fcfs; in (priority, arrival) order under the priority policy."""
        if self.config.scheduling_policy == "priority":
            key = (request.priority, request.arrival_index)
            at = bisect.bisect_right(self.waiting, key,
                                     key=lambda r: (r.priority, r.arrival_index))
            self.waiting.insert(at, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free everything, keep outputs, go back to the waiting queue
        (its front under fcfs)."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.restore_snapshot = -1
        request.replay = None
        request.num_preemptions += 1
        request.needs_slot_reset = False
        self._enqueue(request, front=True)

    def _stop(self, request: Request, token: int) -> None:
        """Finish with `stop` at `token`; a request that finished since its token was advanced
        (length, abort, kv_capacity) would have stopped first had it been resolved first."""
        request.stop_token_id = token
        if not request.is_finished:
            self._finish(request, FINISH_STOP)
            return
        request.status = status_for_reason(FINISH_STOP)
        request.finish_reason = FINISH_STOP
        request.error = None

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        status = status_for_reason(reason)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        request.finish_reason = reason
        request.error = error
        request.needs_slot_reset = False
        self._finished_for_plan.append(request.request_id)
        self._finished_for_update.append(request)

    def check_invariants(self) -> None:
        """Consistency of queues, statuses and the KV manager (tests)."""
        self.kv.check_invariants()
        assert len(self.running) <= self.max_running
        for request in self.running:
            assert request.status is RequestStatus.RUNNING and request.slot is not None
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.slot is None and not request.block_ids
            assert request.num_computed_tokens == 0
        admissions = [r.admission_index for r in self.running]
        assert admissions == sorted(admissions), "running list out of admission order"
        if self.config.scheduling_policy == "priority":
            keys = [(r.priority, r.arrival_index) for r in self.waiting]
            assert keys == sorted(keys), "waiting queue out of (priority, arrival) order"
