"""Scheduler traces with exact chunks, block ids, slots, preemption, stops, aborts and errors."""

from __future__ import annotations

import pickle
import zlib

import pytest

from shoal.scheduler import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_KV_CAPACITY,
    FINISH_LENGTH,
    FINISH_STOP,
    Request,
    RequestStatus,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from shoal.scheduler.request import UNRESOLVED


def fake_token(request_id: str, position: int) -> int:
    """The token a fake model samples for `position`: a pure function, never eos (1)."""
    return 10 + zlib.crc32(f"{request_id}:{position}".encode()) % 90


def run_step(scheduler: Scheduler) -> tuple[StepPlan, list[Request]]:
    plan = scheduler.schedule()
    result = StepResult({item.request_id: [fake_token(item.request_id, item.end_position)]
                         for item in plan.scheduled if item.sample})
    finished = scheduler.update(plan, result).finished
    scheduler.check_invariants()
    return plan, finished


def chunks(plan: StepPlan) -> list[tuple[str, int, int, tuple[int, ...], bool]]:
    return [(r.request_id, r.start_position, r.num_new_tokens, r.block_ids, r.sample)
            for r in plan.scheduled]


def make(block_size: int = 4, num_blocks: int = 16, num_slots: int = 4, **kw: object) -> Scheduler:
    fields = {"max_num_batched_tokens": 64, "max_num_seqs": 4, "max_model_len": 64} | kw
    return Scheduler(SchedulerConfig(**fields), num_blocks=num_blocks, num_slots=num_slots,
                     block_size=block_size)


def test_single_request_exact_plans() -> None:
    s = make(max_num_batched_tokens=16, num_blocks=8)
    a = s.add_request(Request("a", list(range(10, 20)), max_tokens=3))
    plan, finished = run_step(s)
    t0 = fake_token("a", 10)
    assert plan.scheduled == (ScheduledRequest(
        request_id="a", slot=0, token_ids=tuple(range(10, 20)), start_position=0,
        num_new_tokens=10, block_ids=(0, 1, 2), prefill_len=10, num_prompt_tokens=10,
        sample=True, is_new_in_slot=True, history_token_ids=()),)
    assert plan.num_scheduled_tokens == 10 and finished == []
    assert plan.scheduled[0].is_prefill and plan.num_sampled_requests == 1
    plan, _ = run_step(s)
    assert not plan.scheduled[0].is_prefill
    assert plan.scheduled[0] == ScheduledRequest(
        request_id="a", slot=0, token_ids=(t0,), start_position=10, num_new_tokens=1,
        block_ids=(0, 1, 2), prefill_len=10, num_prompt_tokens=10, sample=True,
        is_new_in_slot=False, history_token_ids=(17, 18, 19))
    plan, finished = run_step(s)
    assert chunks(plan) == [("a", 11, 1, (0, 1, 2), True)]
    assert finished == [a]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.finish_reason == FINISH_LENGTH
    assert a.output_token_ids == [fake_token("a", p) for p in (10, 11, 12)]
    assert s.usage().num_free_blocks == 8 and s.kv.num_free_slots == 4
    assert not s.has_unfinished() and s.get_request("a") is None


def test_chunked_prefill_chunks_and_growth() -> None:
    s = make(max_num_batched_tokens=8)
    s.add_request(Request("a", list(range(20)), max_tokens=2))
    s.add_request(Request("b", list(range(5)), max_tokens=2))
    plans = [run_step(s) for _ in range(5)]
    assert [chunks(p) for p, _ in plans] == [
        [("a", 0, 8, (0, 1), False)],
        [("a", 8, 8, (0, 1, 2, 3), False)],
        [("a", 16, 4, (0, 1, 2, 3, 4), True), ("b", 0, 4, (5,), False)],
        [("a", 20, 1, (0, 1, 2, 3, 4, 6), True), ("b", 4, 1, (5, 7), True)],
        [("b", 5, 1, (5, 7), True)],
    ]
    assert [[r.request_id for r in f] for _, f in plans] == [[], [], [], ["a"], ["b"]]
    assert plans[2][0].scheduled[1].slot == 1 and plans[2][0].scheduled[1].is_new_in_slot
    assert plans[4][0].finished_ids == ("a",)
    assert all(p.num_scheduled_tokens <= 8 for p, _ in plans)
    assert s.usage().num_free_blocks == 16 and not s.has_unfinished()


def test_long_prefill_threshold_caps_each_chunk() -> None:
    s = make(max_num_batched_tokens=8, long_prefill_token_threshold=3)
    s.add_request(Request("a", list(range(7)), max_tokens=1))
    s.add_request(Request("b", list(range(2)), max_tokens=1))
    got = [chunks(run_step(s)[0]) for _ in range(3)]
    assert got == [
        [("a", 0, 3, (0,), False), ("b", 0, 2, (1,), True)],
        [("a", 3, 3, (0, 1), False)],  # b finished and returned block 1
        [("a", 6, 1, (0, 1), True)],
    ]


def test_max_num_seqs_and_fifo_admission() -> None:
    s = make(max_num_seqs=2)
    reqs = [s.add_request(Request(name, [5, 6, 7], max_tokens=2)) for name in "abcd"]
    seen = []
    while s.has_unfinished():
        plan, _ = run_step(s)
        assert len(s.running) <= 2
        seen.append([(r.request_id, r.slot) for r in plan.scheduled])
    assert seen == [[("a", 0), ("b", 1)], [("a", 0), ("b", 1)],
                    [("c", 0), ("d", 1)], [("c", 0), ("d", 1)]]
    assert [r.arrival_index for r in reqs] == [r.admission_index for r in reqs] == [0, 1, 2, 3]


def test_waiting_head_is_never_skipped() -> None:
    s = make(num_blocks=4)
    s.add_request(Request("a", list(range(12)), max_tokens=4))
    s.add_request(Request("b", list(range(8)), max_tokens=1))  # needs 2 blocks, 1 free
    s.add_request(Request("c", list(range(2)), max_tokens=1))  # would fit, but is behind b
    plan, _ = run_step(s)
    assert chunks(plan) == [("a", 0, 12, (0, 1, 2), True)]
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_preemption_recompute_and_resumption() -> None:
    s = make(num_blocks=4)
    a = s.add_request(Request("a", list(range(6)), max_tokens=6))
    b = s.add_request(Request("b", list(range(6)), max_tokens=6))
    trace = [run_step(s) for _ in range(9)]
    assert [chunks(p) for p, _ in trace] == [
        [("a", 0, 6, (0, 1), True), ("b", 0, 6, (2, 3), True)],
        [("a", 6, 1, (0, 1), True), ("b", 6, 1, (2, 3), True)],
        [("a", 7, 1, (0, 1), True), ("b", 7, 1, (2, 3), True)],
        [("a", 8, 1, (0, 1, 2), True)],  # b preempted to give a its third block
        [("a", 9, 1, (0, 1, 2), True)],  # b needs 3 blocks for 9 tokens; 1 free
        [("a", 10, 1, (0, 1, 2), True)],
        [("b", 0, 9, (0, 1, 2), True)],  # recompute prompt + 3 outputs
        [("b", 9, 1, (0, 1, 2), True)],
        [("b", 10, 1, (0, 1, 2), True)],
    ]
    assert trace[3][0].preempted_ids == ("b",)
    resumed = trace[6][0].scheduled[0]
    assert resumed.is_prefill and not trace[7][0].scheduled[0].is_prefill
    assert (resumed.slot, resumed.prefill_len, resumed.is_new_in_slot) == (0, 9, True)
    assert resumed.token_ids == tuple(range(6)) + tuple(fake_token("b", p) for p in (6, 7, 8))
    assert trace[6][0].finished_ids == ("a",)
    assert [r.request_id for _, f in trace for r in f] == ["a", "b"]
    for req in (a, b):
        assert req.output_token_ids == [fake_token(req.request_id, p) for p in range(6, 12)]
        assert req.finish_reason == FINISH_LENGTH
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert s.usage().num_free_blocks == 4 and not s.has_unfinished()


def test_preempted_requests_return_to_front_in_admission_order() -> None:
    s = make(num_blocks=3, max_num_batched_tokens=64)
    for name in "abc":
        s.add_request(Request(name, list(range(4)), max_tokens=8))
    s.add_request(Request("d", [1], max_tokens=1))
    plan, _ = run_step(s)  # a, b, c take one full block each; d cannot get a block
    assert chunks(plan) == [("a", 0, 4, (0,), True), ("b", 0, 4, (1,), True),
                            ("c", 0, 4, (2,), True)]
    plan, _ = run_step(s)  # a needs a 2nd block: c goes, then b goes
    assert chunks(plan) == [("a", 4, 1, (0, 2), True)]
    assert plan.preempted_ids == ("c", "b")
    assert [r.request_id for r in s.waiting] == ["b", "c", "d"]


def test_abort_waiting_running_and_in_flight() -> None:
    s = make(max_num_batched_tokens=8, max_num_seqs=2)
    for name in "abc":
        s.add_request(Request(name, list(range(6)), max_tokens=4))
    run_step(s)  # a: 6 tokens, b: first 2 tokens
    assert s.abort_request("c") and not s.abort_request("c") and not s.abort_request("zz")
    assert s.abort_request("a")
    assert s.usage().num_used_blocks == 1  # b's first block only
    plan = s.schedule()
    assert plan.finished_ids == ("c", "a")
    assert chunks(plan) == [("b", 2, 4, (2, 0), True)]
    assert s.abort_request("b")  # between schedule and update
    finished = s.update(plan, StepResult({"b": [42]})).finished
    assert [(r.request_id, r.finish_reason) for r in finished] == \
        [("c", FINISH_ABORT), ("a", FINISH_ABORT), ("b", FINISH_ABORT)]
    assert finished[2].output_token_ids == []  # the in-flight token is dropped
    assert s.usage().num_free_blocks == 16 and not s.has_unfinished()


def test_invalid_requests_finish_with_errors() -> None:
    s = make(num_blocks=4, max_model_len=32)
    bad = [
        s.add_request(Request("empty", [])),
        s.add_request(Request("long", list(range(30)), max_tokens=3)),
        s.add_request(Request("full", list(range(32)))),
        s.add_request(Request("zero", [1], max_tokens=0)),
        s.add_request(Request("minmax", [1], max_tokens=2, min_tokens=3)),
        s.add_request(Request("pool", list(range(17)), max_tokens=1)),
    ]
    assert [r.finish_reason for r in bad] == [FINISH_ERROR] * 5 + [FINISH_KV_CAPACITY]
    assert all(r.status is RequestStatus.FINISHED_ERROR and r.error for r in bad)
    assert "max_model_len=32" in bad[1].error and "max_tokens" in bad[1].error
    with pytest.raises(ValueError, match="already in the scheduler"):
        s.add_request(Request("empty", [1]))
    assert s.has_unfinished()
    plan, finished = run_step(s)
    assert plan.is_empty and plan.finished_ids == tuple(r.request_id for r in bad)
    assert finished == bad and not s.has_unfinished()


def test_request_larger_than_pool_finishes_with_kv_capacity() -> None:
    s = make(num_blocks=2)
    a = s.add_request(Request("a", list(range(6))))  # unbounded max_tokens; pool holds 8
    finished = []
    for _ in range(4):
        plan, finished = run_step(s)
    assert plan.is_empty and plan.finished_ids == ("a",) and finished == [a]
    assert a.finish_reason == FINISH_KV_CAPACITY and a.status is RequestStatus.FINISHED_ERROR
    assert a.output_token_ids == [fake_token("a", p) for p in (6, 7, 8)]
    assert s.usage().num_free_blocks == 2


def test_stop_checks() -> None:
    s = make(max_num_seqs=8, num_slots=8)
    s.add_request(Request("eos", [3], max_tokens=9, eos_token_id=1))
    s.add_request(Request("min", [3], max_tokens=9, eos_token_id=1, min_tokens=2))
    s.add_request(Request("ign", [3], max_tokens=2, eos_token_id=1, ignore_eos=True))
    s.add_request(Request("sid", [3], max_tokens=9, stop_token_ids=(7,)))
    s.add_request(Request("cap", [3], eos_token_id=1))  # stops at max_model_len
    plan = s.schedule()
    finished = s.update(plan, StepResult({"eos": [5, 1, 6], "min": [1], "ign": [1, 1, 1],
                                          "sid": [8, 7], "cap": list(range(20, 83))})).finished
    got = {r.request_id: (r.finish_reason, r.output_token_ids, r.stop_token_id)
           for r in finished}
    assert got == {"eos": (FINISH_STOP, [5, 1], 1), "ign": (FINISH_LENGTH, [1, 1], None),
                   "sid": (FINISH_STOP, [8, 7], 7),
                   "cap": (FINISH_LENGTH, list(range(20, 83)), None)}
    assert s.get_request("min").output_token_ids == [1]  # eos ignored below min_tokens
    assert s.finish_request("min", FINISH_STOP)  # e.g. a stop string seen by the engine
    plan = s.schedule()
    # finishing order: max_tokens / max_model_len at advance(), then eos / stop ids at resolve()
    assert plan.is_empty and plan.finished_ids == ("ign", "cap", "eos", "sid", "min")


def test_whole_prompt_mode_admits_only_whole_prompts() -> None:
    s = make(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    s.add_request(Request("a", list(range(10)), max_tokens=2))
    s.add_request(Request("b", list(range(10)), max_tokens=2))
    assert chunks(run_step(s)[0]) == [("a", 0, 10, (0, 1, 2), True)]
    assert chunks(run_step(s)[0]) == [("a", 10, 1, (0, 1, 2), True),
                                      ("b", 0, 10, (3, 4, 5), True)]
    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=16,
                        enable_chunked_prefill=False)


def test_protocol_errors_and_config_validation() -> None:
    s = make()
    s.add_request(Request("a", [1, 2]))
    plan = s.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        s.schedule()
    with pytest.raises(RuntimeError, match="no sampled token"):
        s.update(plan, StepResult({}))
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(), num_blocks=4, num_slots=1, block_size=0)


def test_plans_and_results_pickle() -> None:
    s = make()
    s.add_request(Request("a", [1, 2, 3], max_tokens=2))
    plan = s.schedule()
    result = StepResult({"a": [9]})
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert pickle.loads(pickle.dumps(result)) == result


def test_advance_then_resolve_pipelined() -> None:
    """Async protocol: step n+1 is scheduled between advance(n) and resolve(n). The in-flight
    token is a placeholder (the decode chunk's input), length finishes at advance, and a stop
    found at resolve wins over a finish that happened meanwhile."""
    s = make(max_num_seqs=8, num_slots=8)
    s.add_request(Request("len", [3, 4], max_tokens=2, eos_token_id=1))
    s.add_request(Request("eos", [3, 4], max_tokens=2, eos_token_id=1))
    s.add_request(Request("min", [3, 4], max_tokens=4, eos_token_id=1, min_tokens=2))
    s.add_request(Request("abort", [3, 4], max_tokens=4, eos_token_id=1))
    s.add_request(Request("bad", [3, 4], max_tokens=4))
    plan0 = s.schedule()
    s.advance(plan0)
    plan1 = s.schedule()  # every request decodes its unknown first output
    assert all(i.token_ids == (UNRESOLVED,) and i.history_token_ids == (3, 4)
               and i.start_position == 2 for i in plan1.scheduled)
    assert s.resolve(plan0, StepResult({"len": [7], "eos": [8], "min": [1], "abort": [9],
                                        "bad": [9]})).finished == []
    assert s.get_request("min").output_token_ids == [1]  # eos below min_tokens
    s.advance(plan1)  # len and eos reach max_tokens: finished now, reason still open
    assert [r.request_id for r in s.running] == ["min", "abort", "bad"]
    assert s.get_request("len").finish_reason == FINISH_LENGTH
    plan2 = s.schedule()
    assert [i.request_id for i in plan2.scheduled] == ["min", "abort", "bad"]
    assert s.abort_request("abort")  # while its token is in flight
    assert s.finish_request("bad", FINISH_ERROR)  # e.g. its row had no valid token
    finished = s.resolve(plan1, StepResult({"len": [5], "eos": [1], "min": [1],
                                            "abort": [1]})).finished
    got = {r.request_id: (r.finish_reason, r.output_token_ids, r.stop_token_id)
           for r in finished}
    assert got == {"len": (FINISH_LENGTH, [7, 5], None), "eos": (FINISH_STOP, [8, 1], 1),
                   "abort": (FINISH_STOP, [9, 1], 1), "bad": (FINISH_ERROR, [9], None),
                   "min": (FINISH_STOP, [1, 1], 1)}
    assert s.get_request("eos") is None and s.get_request("len") is None
    s.advance(plan2)  # everything in it finished at resolve(plan1): its results are dropped
    assert s.resolve(plan2, StepResult({"min": [4], "abort": [4], "bad": [4]})).finished == []
    assert not s.has_unfinished() and s.usage().num_free_blocks == 16
    s.check_invariants()


def test_pipelined_protocol_errors() -> None:
    s = make()
    s.add_request(Request("a", [1, 2], max_tokens=5))
    plan0 = s.schedule()
    with pytest.raises(RuntimeError, match="not the advanced"):
        s.resolve(plan0, StepResult({"a": [3]}))
    s.advance(plan0)
    assert s.has_unfinished()
    plan1 = s.schedule()
    with pytest.raises(RuntimeError, match="before resolve"):
        s.advance(plan1)  # at most one advanced plan is unresolved
    with pytest.raises(RuntimeError, match="no sampled token"):
        s.resolve(plan0, StepResult({}))


def test_pipelined_verification_counts_drafts_as_accepted_until_resolved() -> None:
    """Speculative decoding under async scheduling: a verify plan advances as if every draft
    were accepted (placeholders for the drafts proposed on the device), the next plan is built
    on that, and resolve takes the rejected positions back: the next plan's rows then lie
    `rejected` positions lower, which its own resolve accounts for."""
    s = make()
    s.add_request(Request("b", [1, 2], max_tokens=6))
    s.update(s.schedule(), StepResult({"b": [3]}))
    s.set_drafts("b", [4, 5])
    plan1 = s.schedule()
    assert plan1.scheduled[0].token_ids == (3, 4, 5)
    s.advance(plan1, drafts=2)
    b = s.get_request("b")
    assert b.num_computed_tokens == 5 and b.output_token_ids == [3] + [UNRESOLVED] * 3
    plan2 = s.schedule()  # room for one more draft only (max_tokens, counted optimistically)
    item = plan2.scheduled[0]
    assert (item.start_position, item.token_ids, item.num_spec_tokens) == \
        (5, (UNRESOLVED, UNRESOLVED), 1)
    outcome = s.resolve(plan1, StepResult({"b": [4, 9]}, spec_token_ids={"b": [7, 8]}))
    assert [d.new_token_ids for d in outcome.deltas] == [(4, 9)]
    assert b.num_computed_tokens == 4 and b.output_token_ids == [3, 4, 9]
    s.advance(plan2, drafts=2)  # its start was one position too high
    assert b.num_computed_tokens == 6 and b.output_token_ids == [3, 4, 9] + [UNRESOLVED] * 2
    outcome = s.resolve(plan2, StepResult({"b": [7, 6]}))
    assert [d.new_token_ids for d in outcome.deltas] == [(7, 6)] and not outcome.finished
    assert b.output_token_ids == [3, 4, 9, 7, 6] and b.num_computed_tokens == 6
    s.check_invariants()

    t = make()  # every draft accepted up to max_tokens: `length` at resolve, not at advance
    t.add_request(Request("c", [1, 2], max_tokens=4))
    t.update(t.schedule(), StepResult({"c": [3]}))
    t.set_drafts("c", [4, 5])
    plan = t.schedule()
    t.advance(plan, drafts=2)
    assert not t.get_request("c").is_finished
    outcome = t.resolve(plan, StepResult({"c": [4, 5, 6]}))
    assert [(r.finish_reason, r.output_token_ids) for r in outcome.finished] == \
        [(FINISH_LENGTH, [3, 4, 5, 6])]
    assert not t.has_unfinished()
    t.check_invariants()

