"""Prefix caching in the scheduler: cached blocks kept as evictable, the longest resumable prefix
(block hashes + ring snapshots), a shared prefix computed once, eviction and preemption of
shared blocks without a leak, and the snapshot rule against the tail-only prefill plan."""

from __future__ import annotations

import random
import zlib

import pytest

from shoal.model.presets import TINY
from shoal.model.tail_prefill import decoder_thresholds
from shoal.scheduler import BlockPool, Request, Scheduler, SchedulerConfig, StepResult
from shoal.scheduler.prefix_cache import PrefixCacheSpec
from shoal.scheduler.tail_rule import TailRule

EOS = 1


def fake_token(request_id: str, position: int) -> int:
    h = zlib.crc32(f"{request_id}:{position}".encode()) % 100
    return EOS if h < 3 else 10 + h


def make_scheduler(*, block_size: int = 16, num_blocks: int = 400, num_slots: int = 64,
                   budget: int = 2048, snapshots: int = 64, rule: TailRule | None = None,
                   max_model_len: int = 1024) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=num_slots,
                             max_model_len=max_model_len)
    spec = PrefixCacheSpec(snapshots, rule or TailRule("full", 8, 140, 4))
    return Scheduler(config, num_blocks=num_blocks, num_slots=num_slots,
                     block_size=block_size, prefix_cache=spec)


def run(scheduler: Scheduler, requests: list[Request], *, arrive_per_step: int | None = None,
        max_steps: int = 20000) -> tuple[dict[str, int], dict[str, Request], list]:
    """Drive the scheduler with fake tokens. Returns prefill rows computed per request, the
    finished requests and every scheduled item (in order)."""
    pending = list(requests)
    rows: dict[str, int] = {}
    done: dict[str, Request] = {}
    items = []
    steps = 0
    while pending or scheduler.has_unfinished():
        take = len(pending) if arrive_per_step is None else arrive_per_step
        for request in pending[:take]:
            scheduler.add_request(request)
        pending = pending[take:]
        plan = scheduler.schedule()
        result = StepResult({})
        for item in plan.scheduled:
            items.append(item)
            prefill_end = min(item.end_position, item.prefill_len)
            rows[item.request_id] = rows.get(item.request_id, 0) + max(
                0, prefill_end - item.start_position)
            if item.sample:
                result.sampled_token_ids[item.request_id] = [
                    fake_token(item.request_id, item.end_position)]
        for request in scheduler.update(plan, result).finished:
            done[request.request_id] = request
        scheduler.check_invariants()
        steps += 1
        assert steps < max_steps
    return rows, done, items


def test_pool_keeps_cached_blocks_until_evicted_least_recently_released_first() -> None:
    evicted = []
    pool = BlockPool(6, on_evict=evicted.append)
    a = pool.allocate(4)
    for block in a[:3]:
        pool.mark_cached(block)
    pool.free([a[1]])
    pool.free([a[0]])
    pool.free([a[2], a[3]])  # a[3] is not cached: truly free
    assert (pool.num_free, pool.num_evictable) == (6, 3)
    pool.take(a[0])  # a hit revives a cached block
    assert pool.ref_count(a[0]) == 1 and pool.num_evictable == 2
    got = pool.allocate(5)  # 3 never-cached blocks first, then the oldest released: 1, then 2
    assert got[:3] == [3, 4, 5] and got[3:] == [a[1], a[2]] and evicted == [a[1], a[2]]
    assert not pool.is_cached(a[1]) and pool.num_evictions == 2
    pool.check_invariants()


def test_a_shared_prefix_is_computed_once() -> None:
    """50 requests share a 300-token prefix and arrive together: the first computes its 320
    prompt rows; the others wait one step for its blocks and resume at the last block boundary
    of the shared prefix (288 with 16-token blocks), computing only their own 32 rows."""
    rng = random.Random(0)
    shared = [rng.randint(3, 500) for _ in range(300)]
    requests = [Request(f"r{i}", shared + [rng.randint(3, 500) for _ in range(20)],
                        max_tokens=4, eos_token_id=EOS) for i in range(50)]
    scheduler = make_scheduler()
    rows, done, items = run(scheduler, requests)
    assert sum(rows.values()) == 320 + 49 * (320 - 288)
    assert len(done) == 50
    firsts = {}
    for item in items:
        firsts.setdefault(item.request_id, item)
    assert firsts["r0"].restore_snapshot == -1 and firsts["r0"].start_position == 0
    for i in range(1, 50):
        assert firsts[f"r{i}"].start_position == 288 and firsts[f"r{i}"].restore_snapshot >= 0
    stats = scheduler.prefix_stats
    assert stats.hit_tokens == 49 * 288 and stats.queries == 50
    assert scheduler.usage().num_free_blocks == scheduler.kv.num_blocks  # evictable = free


@pytest.mark.parametrize("length, resume", [(40, 32), (64, 48), (65, 64), (150, 144)])
def test_resume_point_is_the_last_boundary_with_a_snapshot(length: int, resume: int) -> None:
    """A prefix ending inside a block, on a boundary, and past several blocks: the request
    resumes at the last block boundary below its length (one token is always computed)."""
    rng = random.Random(length)
    base = [rng.randint(3, 500) for _ in range(200)]
    scheduler = make_scheduler()
    run(scheduler, [Request("first", base, max_tokens=2, eos_token_id=EOS)])
    _, _, items = run(scheduler, [Request("second", base[:length], max_tokens=2,
                                          eos_token_id=EOS)])
    first = items[0]
    assert (first.start_position, first.restore_snapshot >= 0) == (resume, True)
    assert first.history_token_ids == tuple(base[resume - 3:resume])
    assert first.token_ids == tuple(base[resume:length])


def test_prompt_logprob_requests_and_other_prefixes_do_not_hit() -> None:
    rng = random.Random(1)
    base = [rng.randint(3, 500) for _ in range(100)]
    scheduler = make_scheduler()
    run(scheduler, [Request("a", base, max_tokens=2, eos_token_id=EOS)])
    opted_out = Request("b", base, max_tokens=2, eos_token_id=EOS, cache_prefix=False)
    other = Request("c", [base[0] + 1] + base[1:], max_tokens=2, eos_token_id=EOS)
    rows, _, _ = run(scheduler, [opted_out, other])
    assert rows == {"b": 100, "c": 100}


def test_snapshots_are_evicted_least_recently_used_and_never_leak() -> None:
    """Two snapshot ids for many boundaries, prefilled in chunks of 64: each chunk saves its
    latest boundaries, evicting the earlier chunks' snapshots; every id stays accounted."""
    rng = random.Random(2)
    base = [rng.randint(3, 500) for _ in range(200)]
    scheduler = make_scheduler(snapshots=2, budget=64)
    run(scheduler, [Request("a", base, max_tokens=2, eos_token_id=EOS)])
    assert scheduler.prefix_stats.snapshot_evictions > 0
    _, _, items = run(scheduler, [Request("b", base[:180], max_tokens=2, eos_token_id=EOS)])
    assert items[0].start_position == 176  # the newest boundary below 180 kept its snapshot
    _, _, items = run(scheduler, [Request("c", base[:40], max_tokens=2, eos_token_id=EOS)])
    assert items[0].start_position == 0  # its boundaries' snapshots were evicted


def shared_prefix_requests(rng: random.Random, count: int, *, num_prefixes: int, shortest: int,
                           cut: int, suffix: int, max_tokens: int) -> list[Request]:
    """`count` requests: a random cut (>= `cut` tokens) of one of `num_prefixes` prefixes of
    `shortest` to 60 tokens, up to `suffix` own tokens, 1 to `max_tokens` outputs."""
    prefixes = [[rng.randint(3, 500) for _ in range(rng.randint(shortest, 60))]
                for _ in range(num_prefixes)]
    requests = []
    for i in range(count):
        prompt = list(rng.choice(prefixes))[:rng.randint(cut, 60)]
        prompt += [rng.randint(3, 500) for _ in range(rng.randint(0, suffix))]
        requests.append(Request(f"r{i}", prompt, max_tokens=rng.randint(1, max_tokens),
                                eos_token_id=EOS))
    return requests


@pytest.mark.parametrize("seed", range(3))
def test_mixed_requests_under_a_small_pool_evict_preempt_and_leak_nothing(seed: int) -> None:
    """1,000 requests over a few shared prefixes and a pool too small for them: blocks are
    evicted, requests holding shared blocks are preempted, outputs equal the fake model's,
    and every block and snapshot comes back."""
    requests = shared_prefix_requests(random.Random(seed), 1000, num_prefixes=6,
                                      shortest=10, cut=5, suffix=12, max_tokens=12)
    scheduler = make_scheduler(block_size=4, num_blocks=48, num_slots=8, budget=64,
                               snapshots=12)
    _, done, _ = run(scheduler, requests, arrive_per_step=3)
    assert len(done) == 1000
    assert scheduler.kv.pool.num_evictions > 0
    assert sum(r.num_preemptions for r in done.values()) > 0
    assert scheduler.prefix_stats.hit_tokens > 0
    for request in done.values():  # the fake model: tokens depend on (id, position) only
        expect = []
        for position in range(request.num_prompt_tokens, request.num_tokens):
            expect.append(fake_token(request.request_id, position))
        assert request.output_token_ids == expect
    usage = scheduler.usage()
    assert usage.num_free_blocks == scheduler.kv.num_blocks
    assert usage.num_free_slots == scheduler.kv.num_slots
    scheduler.kv.check_invariants()


@pytest.mark.parametrize("mode", ["full", "staircase", "bounded"])
def test_tail_rule_matches_the_tail_prefill_plan(mode: str) -> None:
    """TailRule restates model/tail_prefill's thresholds: check it against them directly."""
    config = TINY
    w, m = config.sliding_window, config.num_layers - config.decoder_start
    replay = 20
    rule = TailRule(mode, w, replay, m)
    for n in range(1, 80):
        layers, floor = decoder_thresholds(config, n, mode, replay)
        for boundary in range(1, n):
            # a decoder key below the boundary is read by a full row at or above it
            reads = any(max(floor, max(boundary, full) - w + 1) < boundary
                        for full, _ in layers if max(boundary, full) < n)
            assert rule.needs_decoder_rings(boundary, n) == reads, (n, boundary)
        for boundary in range(1, n + 1):
            exact = floor == 0 and all(kv <= max(0, boundary - w + 1) for _, kv in layers)
            assert rule.decoder_rings_exact(boundary, n) == exact, (n, boundary)


class ShadowMemory:
    """What each device block / snapshot and host slot holds, by content key: the transfers
    move keys, computed blocks and saved snapshots write them. A resumed request must find
    its own prefix's keys in every block below its start and in the snapshot it restores."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.prefix = scheduler.kv.prefix
        self.block_size = scheduler.block_size
        self.device: dict[int, bytes] = {}
        self.device_snap: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.host_snap: dict[int, bytes] = {}
        self.resumed = 0

    def keys(self, request: Request, count: int) -> list[bytes]:
        return self.prefix.hashes(request.all_token_ids(), [], count)

    def step(self, scheduler: Scheduler, plan) -> None:
        for t in plan.transfers:
            if t.kind == "block_out":
                self.host[t.host] = self.device[t.device]
            elif t.kind == "block_in":
                self.device[t.device] = self.host[t.host]
            elif t.kind == "snapshot_out":
                self.host_snap[t.host] = self.device_snap[t.device]
            else:
                self.device_snap[t.device] = self.host_snap[t.host]
        bs = self.block_size
        for item in plan.scheduled:
            request = scheduler.requests[item.request_id]
            first = item.start_position // bs
            keys = self.keys(request, item.end_position // bs)
            if item.restore_snapshot >= 0:
                self.resumed += 1
                assert self.device_snap[item.restore_snapshot] == keys[first - 1]
                for i in range(first):
                    assert self.device[item.block_ids[i]] == keys[i], (item.request_id, i)
            for i in range(first, len(keys)):  # blocks this chunk completes
                self.device[item.block_ids[i]] = keys[i]
            for boundary, sid in item.save_snapshots:
                if boundary // bs <= len(keys):
                    self.device_snap[sid] = keys[boundary // bs - 1]


@pytest.mark.parametrize("seed", range(3))
def test_the_host_tier_moves_the_right_contents(seed: int) -> None:
    """Many requests over a few long shared prefixes, a device pool and snapshot pool too small
    for them and a host tier: every resumed request finds its prefix's contents in its blocks
    and snapshot, whether they stayed on the device or came back from the host."""
    requests = shared_prefix_requests(random.Random(seed), 400, num_prefixes=5,
                                      shortest=20, cut=9, suffix=8, max_tokens=6)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
    spec = PrefixCacheSpec(6, TailRule("full", 8, 140, 4), host_blocks=24, host_snapshots=8)
    scheduler = Scheduler(config, num_blocks=28, num_slots=4, block_size=4, prefix_cache=spec)
    shadow = ShadowMemory(scheduler)
    pending = list(requests)
    while pending or scheduler.has_unfinished():
        for request in pending[:2]:
            scheduler.add_request(request)
        pending = pending[2:]
        plan = scheduler.schedule()
        shadow.step(scheduler, plan)
        result = StepResult({item.request_id: [fake_token(item.request_id, item.end_position)]
                             for item in plan.scheduled if item.sample})
        scheduler.update(plan, result)
        scheduler.check_invariants()
    stats = scheduler.prefix_stats
    assert stats.host_hit_tokens > 0 and shadow.resumed > 50
    assert shadow.host_snap  # snapshots went to the host too
    assert scheduler.usage().num_free_blocks == scheduler.kv.num_blocks


def test_bounded_resume_plans_a_replay_and_saves_no_snapshot() -> None:
    """replay_window 20: a hit at 96 starts its chunk at 76 with replay (76, 96); a chunk
    split by the budget keeps the replay until it passes the boundary; no snapshot is saved."""
    rng = random.Random(5)
    base = [rng.randint(3, 500) for _ in range(120)]
    config = SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=256)
    spec = PrefixCacheSpec(4, TailRule("full", 8, 140, 4), replay_window=20)
    scheduler = Scheduler(config, num_blocks=64, num_slots=4, block_size=16, prefix_cache=spec)
    _, _, first = run(scheduler, [Request("a", base, max_tokens=2, eos_token_id=EOS)])
    assert not any(item.save_snapshots for item in first)
    _, _, items = run(scheduler, [Request("b", base[:100], max_tokens=2, eos_token_id=EOS)])
    spans = [(i.start_position, i.end_position, i.replay) for i in items]
    assert spans[:3] == [(76, 88, (76, 96)), (88, 100, (76, 96)),
                         (100, 101, None)]
    assert items[0].restore_snapshot == -1 and scheduler.prefix_stats.hit_tokens == 96


def test_settling_an_interrupted_plan_drops_the_cache_and_leaks_nothing() -> None:
    """An exception between schedule() and update() (settle): the plan's copies and writes
    may never run, so the cache forgets everything; every block and snapshot id comes back and
    the next requests run from scratch."""
    rng = random.Random(6)
    base = [rng.randint(3, 500) for _ in range(100)]
    spec = PrefixCacheSpec(4, TailRule("full", 8, 140, 4), host_blocks=8, host_snapshots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                          max_model_len=256),
                          num_blocks=24, num_slots=4, block_size=16, prefix_cache=spec)
    run(scheduler, [Request("a", base, max_tokens=2, eos_token_id=EOS)])
    scheduler.add_request(Request("b", base[:90], max_tokens=2, eos_token_id=EOS))
    plan = scheduler.schedule()
    assert plan.scheduled[0].start_position == 80  # resumed from the cache
    scheduler.settle()
    scheduler.check_invariants()
    assert scheduler.usage().num_free_blocks == 24 and not scheduler.kv.pool.num_evictable
    rows, _, _ = run(scheduler, [Request("c", base[:90], max_tokens=2, eos_token_id=EOS)])
    assert rows == {"c": 90}
