"""Applying a step's result to the scheduler's requests (`StepResults`, a part of `Scheduler`).

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
`schedule` runs, so a plan's history ids (the tokens before its inputs) are known, except
under speculative decoding, where a plan verifying drafts in flight is counted as if all were
accepted: its verify chunks, history included, are then all on the device, and `resolve`
takes the rejected positions back and shifts the plan built meanwhile.

A finish that happens while a plan's tokens are unresolved (max_tokens / max_model_len at
`advance`, an abort, `kv_capacity` in the next `schedule`) frees the request's blocks and slot
at once (the device writes of the steps already queued land before those of any later owner,
on the same stream), and `resolve` still records that plan's token: if it is eos or a stop id,
the reason becomes `stop`, as it would have been had the step been resolved first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shoal.scheduler.config import SchedulerConfig
from shoal.scheduler.kv_cache_manager import KVCacheManager
from shoal.scheduler.request import (
    FINISH_ERROR,
    FINISH_LENGTH,
    UNRESOLVED,
    Request,
    RequestStatus,
)
from shoal.scheduler.step_plan import StepOutcome, StepPlan, StepResult

INVALID_ROW_ERROR = "the model produced no valid token (NaN logits or every token masked)"


class StepResults:
    """`Scheduler`'s update / advance / resolve / settle over the state it owns."""

    config: SchedulerConfig
    kv: KVCacheManager
    requests: dict[str, Request]
    _outstanding: StepPlan | None
    _unresolved: StepPlan | None
    _outstanding_shift: dict[str, int]
    _unresolved_shift: dict[str, int]
    _finished_for_update: list[Request]

    if TYPE_CHECKING:  # (Scheduler's)
        def abort_request(self, request_id: str) -> bool: ...

        def _finish(self, request: Request, reason: str, error: str | None = None) -> None: ...

        def _stop(self, request: Request, token: int) -> None: ...

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
