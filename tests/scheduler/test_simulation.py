"""Randomized simulation: many requests against a fake model, invariants checked every step.

The fake model's token for a position is a pure function of (request_id, position), so a request
must end with exactly the tokens an independent sequential generation gives, however often it
was chunked or preempted.
"""

from __future__ import annotations

import random
import zlib

import pytest

from shoal.scheduler import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_KV_CAPACITY,
    FINISH_LENGTH,
    FINISH_STOP,
    Request,
    Scheduler,
    SchedulerConfig,
    StepResult,
)
from shoal.scheduler.request import UNRESOLVED

EOS = 1


def fake_token(request_id: str, position: int) -> int:
    h = zlib.crc32(f"{request_id}:{position}".encode()) % 100
    return EOS if h < 4 else 10 + h


def expected_outcome(req: Request, num_blocks: int, block_size: int,
                     max_model_len: int) -> tuple[str, list[int]]:
    """Sequential generation with the same stop rules, computed independently."""
    total = len(req.prompt_token_ids)
    if total < 1 or total + (req.max_tokens or 1) > max_model_len:
        return FINISH_ERROR, []
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        return FINISH_ERROR, []
    outputs: list[int] = []
    while True:
        if -(-total // block_size) > num_blocks:  # positions 0..total-1 must fit
            return FINISH_KV_CAPACITY, outputs
        token = fake_token(req.request_id, total)
        outputs.append(token)
        total += 1
        if token == EOS and len(outputs) >= req.min_tokens:
            return FINISH_STOP, outputs
        if req.max_tokens is not None and len(outputs) >= req.max_tokens:
            return FINISH_LENGTH, outputs
        if total >= max_model_len:
            return FINISH_LENGTH, outputs


def random_setup(rng: random.Random) -> tuple[SchedulerConfig, int, int]:
    max_num_seqs = rng.randint(1, 6)
    max_model_len = rng.randint(8, 96)
    chunked = rng.random() < 0.8
    budget = rng.randint(max_num_seqs, 48)
    if not chunked:
        budget = max(budget, max_model_len)
    block_size = rng.choice([1, 2, 4, 8, 16])
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=rng.choice([0, 0, rng.randint(1, 16)]),
    )
    return config, block_size, rng.randint(1, 40), rng.randint(1, 6)


def random_request(rng: random.Random, index: int, max_model_len: int) -> Request:
    prompt_len = rng.randint(1, max_model_len) if rng.random() < 0.15 else rng.randint(1, 24)
    if rng.random() < 0.03:
        prompt_len = 0
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=[rng.randint(3, 500) for _ in range(prompt_len)],
        max_tokens=rng.choice([None, rng.randint(1, 30)]),
        min_tokens=rng.choice([0, 0, 2]) if rng.random() < 0.9 else 0,
        eos_token_id=EOS,
    )


def simulation_setup(seed: int) -> tuple[random.Random, SchedulerConfig, Scheduler,
                                         list[Request]]:
    """The seeded random configuration, its scheduler and 30 requests still to arrive."""
    rng = random.Random(seed)
    config, block_size, num_blocks, num_slots = random_setup(rng)
    scheduler = Scheduler(config, num_blocks=num_blocks, num_slots=num_slots,
                          block_size=block_size)
    return rng, config, scheduler, [random_request(rng, i, config.max_model_len)
                                    for i in range(30)]


def admit_some(rng: random.Random, pending: list[Request], scheduler: Scheduler,
               shadow: dict[str, list[int]], computed: dict[str, int]) -> None:
    """0, 1 or 3 of the pending requests arrive (and enter the shadow bookkeeping)."""
    for _ in range(rng.choice([0, 0, 1, 3])):
        if pending:
            request = pending.pop(0)
            shadow[request.request_id] = list(request.prompt_token_ids)
            computed[request.request_id] = 0
            scheduler.add_request(request)


def check_plan(scheduler: Scheduler, plan, shadow: dict[str, list[int]],
               computed: dict[str, int], in_flight: frozenset[str] = frozenset()) -> None:
    """in_flight: requests whose last token is a placeholder (async): a one-token chunk of
    theirs holds UNRESOLVED where the shadow knows the value."""
    config = scheduler.config
    assert plan.num_scheduled_tokens == sum(r.num_new_tokens for r in plan.scheduled)
    assert plan.num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(plan.scheduled) <= min(config.max_num_seqs, scheduler.kv.num_slots)
    assert len({r.request_id for r in plan.scheduled}) == len(plan.scheduled)
    assert len({r.slot for r in plan.scheduled}) == len(plan.scheduled)
    assert set(plan.preempted_ids).isdisjoint(r.request_id for r in plan.scheduled)
    for rid in plan.preempted_ids:
        computed[rid] = 0
    seen_blocks: set[int] = set()
    for item in plan.scheduled:
        tokens = shadow[item.request_id]
        assert item.num_new_tokens >= 1
        assert item.start_position == computed[item.request_id]
        expected = tuple(tokens[item.start_position:item.end_position])
        if item.token_ids != expected:
            assert item.request_id in in_flight and item.num_new_tokens == 1, item
            assert item.token_ids == (UNRESOLVED,)
            assert item.end_position == len(tokens)  # the newest token, never history
        assert item.history_token_ids == \
            tuple(tokens[max(0, item.start_position - 3):item.start_position])
        assert item.sample == (item.end_position == len(tokens))
        assert item.is_new_in_slot == (item.start_position == 0)
        assert len(item.block_ids) == -(-item.end_position // scheduler.block_size)
        assert seen_blocks.isdisjoint(item.block_ids)
        seen_blocks.update(item.block_ids)
        if not config.enable_chunked_prefill:
            assert item.sample  # whole prompts only
        elif config.long_prefill_token_threshold:
            assert item.num_new_tokens <= config.long_prefill_token_threshold


@pytest.mark.parametrize("seed", range(40))
def test_random_simulation(seed: int) -> None:
    rng, config, scheduler, pending = simulation_setup(seed)
    num_blocks, num_slots = scheduler.kv.num_blocks, scheduler.kv.num_slots
    shadow: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    done: dict[str, Request] = {}
    externally_finished: set[str] = set()
    steps = 0
    while pending or scheduler.has_unfinished():
        admit_some(rng, pending, scheduler, shadow, computed)
        plan = scheduler.schedule()
        check_plan(scheduler, plan, shadow, computed)
        if rng.random() < 0.02 and scheduler.running:  # abort between schedule and update
            victim = rng.choice(scheduler.running).request_id
            assert scheduler.abort_request(victim)
            externally_finished.add(victim)
        result = StepResult({})
        for item in plan.scheduled:
            computed[item.request_id] = item.end_position
            if item.sample:
                token = fake_token(item.request_id, item.end_position)
                result.sampled_token_ids[item.request_id] = [token]
                if item.request_id not in externally_finished:
                    shadow[item.request_id].append(token)
        finished = scheduler.update(plan, result).finished
        scheduler.check_invariants()
        if plan.is_empty and not plan.finished_ids and not finished:
            assert not scheduler.has_unfinished(), "a step made no progress"
        for request in finished:
            assert request.slot is None and not request.block_ids
            assert request.request_id not in done
            done[request.request_id] = request
        if rng.random() < 0.02 and scheduler.waiting:  # abort a waiting request
            victim = scheduler.waiting[-1].request_id
            scheduler.abort_request(victim)
            externally_finished.add(victim)
        steps += 1
        assert steps < 5000

    usage = scheduler.usage()
    assert usage.num_free_blocks == num_blocks and usage.num_free_slots == num_slots
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert len(done) == 30
    for rid, request in done.items():
        if rid in externally_finished:
            assert request.finish_reason == FINISH_ABORT
            continue
        reason, outputs = expected_outcome(request, num_blocks, scheduler.block_size,
                                           config.max_model_len)
        assert (request.finish_reason, request.output_token_ids) == (reason, outputs), rid
        assert request.output_token_ids == shadow[rid][request.num_prompt_tokens:]


@pytest.mark.parametrize("seed", range(40))
def test_random_simulation_async(seed: int) -> None:
    """The pipelined protocol: schedule(n+1) -> resolve(n) -> advance(n+1), with aborts between
    steps (after advance, before resolve: the token in flight still counts). Every request ends
    exactly as sequential generation (stops at the in-flight token win over max_tokens,
    max_model_len and kv_capacity found meanwhile); an aborted one with a prefix of it."""
    rng, config, scheduler, pending = simulation_setup(seed)
    num_blocks, num_slots = scheduler.kv.num_blocks, scheduler.kv.num_slots
    shadow: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    done: dict[str, Request] = {}
    aborted: set[str] = set()
    previous = None  # the advanced, unresolved plan
    steps = 0
    while pending or scheduler.has_unfinished():
        admit_some(rng, pending, scheduler, shadow, computed)
        plan = scheduler.schedule()
        in_flight = frozenset(i.request_id for i in previous.scheduled if i.sample) \
            if previous is not None else frozenset()
        check_plan(scheduler, plan, shadow, computed, in_flight)
        for item in plan.scheduled:
            computed[item.request_id] = item.end_position
        finished = []
        if previous is not None:
            finished = scheduler.resolve(previous, StepResult({
                i.request_id: [fake_token(i.request_id, i.end_position)]
                for i in previous.scheduled if i.sample})).finished
        if plan.is_empty:  # nothing to launch: applied at once (as the engine does)
            finished += scheduler.update(plan, StepResult({})).finished
        else:
            scheduler.advance(plan)
        for item in plan.scheduled:  # what advance() appended is what the model will sample
            request = scheduler.get_request(item.request_id)
            index = item.end_position - item.num_prompt_tokens
            if item.sample and request is not None and len(request.output_token_ids) > index \
                    and request.output_token_ids[index] == UNRESOLVED:
                shadow[item.request_id].append(fake_token(item.request_id, item.end_position))
        previous = None if plan.is_empty else plan
        scheduler.check_invariants()
        for request in finished:
            assert request.slot is None and not request.block_ids
            assert UNRESOLVED not in request.output_token_ids
            assert request.request_id not in done
            done[request.request_id] = request
        if rng.random() < 0.03 and (scheduler.running or scheduler.waiting):
            victim = rng.choice(list(scheduler.running) + list(scheduler.waiting)).request_id
            assert scheduler.abort_request(victim)
            aborted.add(victim)
        steps += 1
        assert steps < 5000
    assert previous is None
    usage = scheduler.usage()
    assert usage.num_free_blocks == num_blocks and usage.num_free_slots == num_slots
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert len(done) == 30
    for rid, request in done.items():
        reason, outputs = expected_outcome(request, num_blocks, scheduler.block_size,
                                           config.max_model_len)
        assert request.output_token_ids == shadow[rid][request.num_prompt_tokens:], rid
        if rid in aborted and request.finish_reason == FINISH_ABORT:
            assert request.output_token_ids == outputs[:len(request.output_token_ids)], rid
            continue
        assert (request.finish_reason, request.output_token_ids) == (reason, outputs), rid
