"""Async scheduling: the engine's step with one step in flight, over the same calls as the
synchronous step (schedule, submit / collect, the scheduler's update in its two halves
`advance` / `resolve`, the engine's report).

A call of `step()` schedules and submits step n+1, then collects step n (waiting only for n's
tokens while the device runs n+1) and reports it, then advances n+1:
`schedule(n+1) -> submit(n+1) -> collect(n), resolve(n), report(n) -> advance(n+1)`. Step n+1
was planned from `advance(n)`'s counts, with step n's tokens as placeholders; its decode rows
read their input ids from step n's sampled tensor on the device. Results of step n+1 for a
request that step n finished are dropped by the scheduler.

Before scheduling, the step in flight is collected first when a request sampled in it needs
that token's value on the host to be sampled again (penalties read the output ids, a
structured-output matcher must accept the token first, min_tokens counts the outputs under
speculative decoding).

Speculative decoding (with `spec_overlap`): step n+1 is planned as if every draft verified in
step n were accepted, and verifies the drafts step n proposed on the device; its inputs,
positions and checks come from step n's `Proposal` (`runner/draft_patch.py`), and
`resolve(n)` takes the rejected positions back (`Scheduler.advance`).

Outputs (tokens, text, finish reasons, logprobs) equal the synchronous loop's: samples depend
on (seed, position) and the forward is batch-invariant, so the plans may differ (a request
stopping at step n still occupies step n+1's batch and blocks) without changing any output;
only metrics such as preemption counts can differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.scheduler.step_plan import StepPlan

if TYPE_CHECKING:
    from shoal.engine.engine import Engine


class OverlappedSteps:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inflight: StepPlan | None = None  # submitted and advanced, not yet collected

    def step(self) -> list[str]:
        """One step; returns the user requests completed in the step collected here (normally
        the one submitted by the previous call)."""
        engine, scheduler, executor = self.engine, self.engine.scheduler, self.engine.executor
        newly: set[str] = set()
        previous, self.inflight = self.inflight, None
        if previous is not None and engine.needs_tokens_on_host(previous):
            engine.stats.resolved_first += 1
            newly |= self._collect(previous)
            previous = None
        plan = scheduler.schedule()
        executor.submit(plan, engine.grammar_masks(plan))
        if previous is not None:
            if plan.scheduled:
                engine.stats.overlapped_steps += 1
            newly |= self._collect(previous)
        if plan.scheduled:
            scheduler.advance(plan, engine.draft_len)
            self.inflight = plan
        else:  # nothing to overlap with: finish the empty plan now
            output = executor.collect()
            newly |= engine.report(plan, output, scheduler.update(plan, output))
        return engine.completed_groups(newly)

    def flush(self) -> list[str]:
        """Collect the step in flight, if any, without submitting another."""
        newly: set[str] = set()
        if self.inflight is not None:
            plan, self.inflight = self.inflight, None
            newly = self._collect(plan)
        return self.engine.completed_groups(newly)

    def _collect(self, plan: StepPlan) -> set[str]:
        output = self.engine.executor.collect()
        return self.engine.report(plan, output, self.engine.scheduler.resolve(plan, output))
