"""The token-budget scheduler: which requests compute how many tokens in the next step.

Owns: the waiting queue, the running list, admission, chunked prefill, preemption (recompute)
and the stop checks that need no detokenizer (eos, stop ids, max_tokens, max_model_len).

Policy (vLLM v1 style, no prefill/decode modes; every request's `num_computed_tokens` catches up
with `num_tokens`):
1. Running requests, in admission order, each take `min(remaining, long-prefill cap, budget)`
   tokens (a decode is 1). If its blocks cannot grow, the most recently admitted running request
   is preempted (blocks and slot freed, `num_computed_tokens = 0`, outputs kept, put at the FRONT
   of the waiting queue) until it can, possibly the request itself.
2. If nobody was preempted this step, waiting requests are admitted strictly FIFO (the head is
   never skipped) while budget, `max_num_seqs`, slots and blocks allow. Admission never preempts.

Invariants: every step's tokens <= max_num_batched_tokens; running <= min(max_num_seqs, slots);
a plan never schedules a request twice. A request that cannot fit in the whole pool finishes
with `kv_capacity` instead of spinning; invalid input finishes with `error` at `add_request`
(the engine reports it per request; nothing raises).

Applying a step is two halves: `advance(plan)` (progress, one `UNRESOLVED` placeholder per
sampled row, and the stops that need no token value: max_tokens, max_model_len) and
`resolve(plan, result)` (invalid rows finished with `error`, the placeholders replaced by the
sampled ids, then eos / stop ids, then the proposed drafts stored). Both answer with plain
`RequestDelta`s (new token ids, finish reason), the only way tokens leave the scheduler.
`update(plan, result)` is both at once (the synchronous loop). Async scheduling calls
`schedule()` for step n+1 between `advance(n)` and `resolve(n)`: every count the plan needs
(positions, lengths, blocks) is already right, and the only unknown is the input token of a
decode row, which the runner takes from step n's sampled tokens on the device. The order is
`schedule(n+1)`, `resolve(n)`, `advance(n+1)`: at most one advanced plan is unresolved when
`schedule` runs, so a plan's history ids (the tokens before its inputs) are always known.

A finish that happens while a plan's tokens are unresolved (max_tokens / max_model_len at
`advance`, an abort, `kv_capacity` in the next `schedule`) frees the request's blocks and slot
at once (the device writes of the steps already queued land before those of any later owner,
on the same stream), and `resolve` still records that plan's token: if it is eos or a stop id,
the reason becomes `stop`, as it would have been had the step been resolved first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from shoal.scheduler.config import SchedulerConfig
from shoal.scheduler.kv_cache_manager import KVCacheManager, KVCacheUsage
from shoal.scheduler.prefix_cache import PrefixCacheSpec, PrefixCacheStats
from shoal.scheduler.request import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_KV_CAPACITY,
    FINISH_LENGTH,
    FINISH_STOP,
    UNRESOLVED,
    Request,
    RequestStatus,
    status_for_reason,
)
from shoal.scheduler.step_plan import (
    NewRequest,
    ScheduledRequest,
    StepOutcome,
    StepPlan,
    StepResult,
)
from shoal.scheduler.validation import capacity_message, validate

INVALID_ROW_ERROR = "the model produced no valid token (NaN logits or every token masked)"


class Scheduler:
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
            self.waiting.append(request)
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
                victim = self.running.pop()
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

    def update(self, plan: StepPlan, result: StepResult) -> StepOutcome:
        """Apply the runner's result: `advance(plan)` then `resolve(plan, result)` in one go.

        A row verifying drafts advances by as many tokens as it produced (the anchor's sample
        and the accepted drafts). Returns what `resolve` returns.
        """
        self._finish_invalid(result)
        counts = {item.request_id: len(result.sampled_token_ids.get(item.request_id) or ())
                  for item in plan.scheduled if item.sample}
        self._advance(plan, counts)
        return self.resolve(plan, result)

    def advance(self, plan: StepPlan, drafts: int = 0) -> None:
        """Count the step as computed before its tokens are known (async scheduling).

        Every live scheduled request's `num_computed_tokens` moves on by its chunk; a sampled
        row appends one `UNRESOLVED` placeholder, and a request that has thereby reached
        max_tokens or max_model_len finishes with `length` now (blocks and slot freed; `resolve`
        turns it into `stop` when the token is eos / a stop id). Requests finished after
        `schedule()` (aborted, or stopped by the previous `resolve`) are skipped: their result
        in this step is dropped.

        Speculative decoding: a row verifying k drafts counts as if all were accepted (k + 1
        placeholders; its length limit is checked at `resolve`, which takes back the rejected
        positions), and `drafts` > 0 gives every sampled request that many placeholder drafts,
        which the runner proposes on the device and the next plan verifies.
        """
        if drafts and self.kv.prefix is not None:
            raise RuntimeError("advance() with drafts in flight and prefix caching: the cache "
                               "would hash positions whose tokens are not known")
        self._advance(plan, None, drafts)

    def _advance(self, plan: StepPlan, counts: dict[str, int] | None, drafts: int = 0) -> None:
        """counts: tokens per sampled row (update: from the result, 0 = none, which resolve
        reports; advance: None = every row's, as if all drafts were accepted)."""
        if plan is not self._outstanding:
            raise RuntimeError(f"update() / advance() for plan {plan.step_id}, which is not "
                               "the outstanding plan of the last schedule()")
        if self._unresolved is not None:
            raise RuntimeError(f"advance() of plan {plan.step_id} before resolve() of plan "
                               f"{self._unresolved.step_id}")
        self._outstanding = None
        self._unresolved = plan
        self._unresolved_shift, self._outstanding_shift = self._outstanding_shift, {}
        for item in plan.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.is_finished:
                continue  # aborted or finished from outside after schedule()
            shift = self._unresolved_shift.get(item.request_id, 0)
            assert request.num_computed_tokens == item.start_position - shift, item.request_id
            k = item.num_spec_tokens
            num_tokens = 0 if not item.sample else k + 1 if counts is None else \
                counts.get(item.request_id, 0)
            if k and counts is not None:
                if not 1 <= num_tokens <= k + 1:
                    raise RuntimeError(f"StepResult for {item.request_id!r} verifying "
                                       f"{k} drafts has {num_tokens} tokens")
                # the anchor and the accepted drafts are computed; rejected rows are not (their
                # cache rows are overwritten when those positions are computed again)
                request.num_computed_tokens += num_tokens
            else:
                request.num_computed_tokens += item.num_new_tokens
                if item.sample and counts is not None and not num_tokens:
                    raise RuntimeError(f"StepResult has no sampled token for "
                                       f"{item.request_id!r}, which was scheduled with "
                                       "sample=True")
            self.kv.register_computed(request)  # before a finish below frees the blocks
            for _ in range(num_tokens):
                request.output_token_ids.append(UNRESOLVED)
                if counts is None and k:
                    continue  # how many are accepted is known at resolve()
                if self._reached_length(request):
                    self._finish(request, FINISH_LENGTH)
                    break
            if drafts and item.sample and not request.is_finished:
                request.spec_token_ids = [UNRESOLVED] * drafts
        self.kv.bind_snapshots()

    def _reached_length(self, request: Request) -> bool:
        return ((request.max_tokens is not None
                 and request.num_output_tokens >= request.max_tokens)
                or request.num_tokens >= self.config.max_model_len)

    def resolve(self, plan: StepPlan, result: StepResult) -> StepOutcome:
        """Finish `result.invalid_ids` with `error`, replace the placeholders of the advanced
        `plan` by its sampled tokens, then check eos and stop ids (not below min_tokens; a stop
        ends the request at that token, and replaces any reason it finished with since
        `advance`), then store the proposed drafts of the requests still running.

        A request whose row has no tokens must have been finished meanwhile (an invalid row, an
        abort): its placeholders are dropped. Returns one delta per request that gained tokens
        (plan order) or finished since the previous update() / resolve() (stopped here, at
        advance, or aborted / rejected / out of KV capacity in between; finishing order), and
        the finished records; the scheduler forgets them afterwards.
        """
        if plan is not self._unresolved:
            raise RuntimeError(f"resolve() for plan {plan.step_id}, which is not the advanced, "
                               "unresolved plan")
        self._finish_invalid(result)
        self._unresolved = None
        shifts, self._unresolved_shift = self._unresolved_shift, {}
        later = {item.request_id for item in self._outstanding.scheduled} \
            if self._outstanding is not None else set()
        sampled_token_ids = result.sampled_token_ids
        appended: dict[str, list[int]] = {}
        for item in plan.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or not item.sample:
                continue
            out = request.output_token_ids
            k = item.num_spec_tokens
            first = (item.end_position - k - item.num_prompt_tokens
                     - shifts.get(item.request_id, 0))
            if first >= len(out) or out[first] != UNRESOLVED:
                continue  # not advanced in this plan: finished before advance()
            tokens = sampled_token_ids.get(item.request_id)
            if not tokens:
                if request.is_finished:  # e.g. no valid token: the engine ended it
                    del out[first:]
                    continue
                raise RuntimeError(f"StepResult has no sampled token for {item.request_id!r}, "
                                   "which was scheduled with sample=True")
            if len(tokens) < len(out) - first:
                if not k or len(out) - first != k + 1:
                    raise RuntimeError(f"StepResult for {item.request_id!r} has {len(tokens)} "
                                       f"tokens for {len(out) - first} advanced positions")
                # advanced as if all drafts were accepted: take the rejected ones back
                rejected = len(out) - first - len(tokens)
                del out[first + len(tokens):]
                if request.status is RequestStatus.RUNNING:
                    request.num_computed_tokens -= rejected
                    if item.request_id in later:  # planned before this was known
                        self._outstanding_shift[item.request_id] = rejected
            for index in range(first, len(out)):
                token = int(tokens[index - first])
                out[index] = token
                if request.is_stop_token(token, index + 1):
                    del out[index + 1:]
                    self._stop(request, token)
                    break
            if k and not request.is_finished and self._reached_length(request):
                self._finish(request, FINISH_LENGTH)
            appended[item.request_id] = out[first:]
            if UNRESOLVED in request.spec_token_ids:  # no drafts came (the request ended)
                request.spec_token_ids = []
        for request_id, drafts in result.spec_token_ids.items():
            self.set_drafts(request_id, drafts)
        finished, self._finished_for_update = self._finished_for_update, []
        ended = {request.request_id: request for request in finished}
        deltas = [self.requests[rid].delta(tokens, rid in ended)
                  for rid, tokens in appended.items()]
        deltas += [request.delta((), True) for request in finished
                   if request.request_id not in appended]
        for request in finished:
            self.requests.pop(request.request_id, None)
        return StepOutcome(deltas, finished)

    def settle(self) -> StepOutcome:
        """Close the plans scheduled or advanced but not applied, without results (after an
        exception between schedule() and update() / resolve()): every request in them is
        aborted, so the next schedule() starts from a consistent state."""
        plans = [p for p in (self._unresolved, self._outstanding) if p is not None]
        if plans and self.kv.prefix is not None:  # their copies and writes may never run
            self.kv.prefix.drop_all()
        for item in (item for plan in plans for item in plan.scheduled):
            self.abort_request(item.request_id)
        outcome = StepOutcome()
        if self._unresolved is not None:
            outcome = self.resolve(self._unresolved, StepResult())
        if self._outstanding is not None:
            later = self.update(self._outstanding, StepResult())
            outcome = StepOutcome(outcome.deltas + later.deltas,
                                  outcome.finished + later.finished)
        return outcome

    def set_drafts(self, request_id: str, drafts: Sequence[int]) -> None:
        """Drafts (speculative decoding) for the positions after a running request's last
        output; the next schedule() verifies them. Ignored for a finished or unknown request."""
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            request.spec_token_ids = [int(t) for t in drafts]

    def _finish_invalid(self, result: StepResult) -> None:
        for request_id in result.invalid_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, FINISH_ERROR, INVALID_ROW_ERROR)

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

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free everything, keep outputs, go to the front of the queue."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.restore_snapshot = -1
        request.replay = None
        request.num_preemptions += 1
        request.needs_slot_reset = False
        self.waiting.appendleft(request)

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
