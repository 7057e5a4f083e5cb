"""The scheduler's priority policy (vLLM's scheduling_policy='priority')."""

from __future__ import annotations

import pytest

from scheduler.test_scheduler import chunks, make, run_step
from shoal.scheduler import Request, Scheduler, SchedulerConfig


def test_priority_policy_orders_admission_and_preemption() -> None:
    """scheduling_policy='priority': waiting requests are admitted by (priority, arrival), and
    the request preempted for blocks is the one with the largest (priority, arrival), even
    when it was already scheduled in the step (it gives its chunk back); fcfs preempts the most
    recent admission."""
    def scenario(policy: str) -> tuple[Scheduler, list]:
        s = make(num_blocks=3, max_num_batched_tokens=64, max_num_seqs=2,
                 scheduling_policy=policy)
        s.add_request(Request("low", list(range(4)), max_tokens=8, priority=9))
        plans = [run_step(s)[0]]  # low alone: one block
        s.add_request(Request("high", [1, 2, 3], max_tokens=8, priority=0))
        plans += [run_step(s)[0] for _ in range(3)]  # high admitted; the 3 blocks in use
        return s, plans

    s, plans = scenario("priority")
    assert [c[0] for c in chunks(plans[1])] == ["low", "high"]
    # step 4: low (first in the running list) takes its decode, then high needs a 2nd block:
    # low, the lower priority, is preempted and its chunk given back
    assert chunks(plans[3]) == [("high", 4, 1, (2, 0), True)]
    assert plans[3].preempted_ids == ("low",) and plans[3].num_scheduled_tokens == 1
    s.add_request(Request("late-top", [1, 2, 3], max_tokens=2, priority=-1))
    s.add_request(Request("late-mid", [1, 2, 3], max_tokens=2, priority=5))
    s.add_request(Request("later-top", [1, 2, 3], max_tokens=2, priority=-1))
    assert [r.request_id for r in s.waiting] == ["late-top", "later-top", "late-mid", "low"]
    s.check_invariants()
    while s.has_unfinished():
        run_step(s)
        s.check_invariants()

    f, plans = scenario("fcfs")
    assert plans[3].preempted_ids == ("high",)
    assert [c[0] for c in chunks(plans[3])] == ["low"]
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")
