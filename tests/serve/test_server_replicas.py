"""`shoal serve` over data-parallel replicas (CPU, tiny, loopback): two replica processes, as
copies and with the routed experts sharded over them (gloo): the same completions as one
engine, streaming equal to non-streaming, n = 2, requests spread over both replicas, a client
that disconnects frees its replica's blocks, and a bounded load test without a leaked block."""

from __future__ import annotations

import threading
import time
import urllib.request

import openai
import pytest

from shoal import LLM, SamplingParams
from support.live_server import LiveServer, wait_running


def _swallow(call) -> None:
    """A request the test expects to fail (its replica dies)."""
    try:
        call()
    except openai.APIError:
        pass

OPTS = {"max_num_seqs": 4, "max_model_len": 128}
PROMPTS = [[5 + i, 17, 42, 7 * i % 300 + 3] for i in range(6)]


def _idle(live: LiveServer, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        snap = live.engine_loop.snapshot
        if snap.get("kv_blocks_total") and not (snap["running"] or snap["waiting"]
                                                 or snap["kv_blocks_used"]):
            return snap
        time.sleep(0.05)
    raise AssertionError(f"the replicas did not go idle: {live.engine_loop.snapshot}")


@pytest.fixture(scope="module")
def greedy() -> list[str]:
    outs = LLM("tiny", device="cpu", **OPTS).generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["copies", "expert-parallel"])
def test_replicas_serve_like_one_engine(greedy, expert_parallel: bool) -> None:
    live = LiveServer(data_parallel_size=2, **OPTS, **(
        {"expert_parallel": True} if expert_parallel else {}))
    try:
        client = live.client(timeout=120)
        before = _idle(live)
        got: list = [None] * len(PROMPTS)

        def one(i: int) -> None:  # concurrent: both replicas get requests
            got[i] = client.completions.create(
                model="tiny", prompt=PROMPTS[i], max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].text

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == greedy
        args = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 8,
                "temperature": 0.9, "seed": 3, "n": 2}
        whole = client.completions.create(**args)
        parts = list(client.completions.create(**args, stream=True))
        for i in range(2):
            assert "".join(c.choices[0].text for c in parts if c.choices and
                           c.choices[0].index == i) == whole.choices[i].text
        after = _idle(live)
        assert after["requests"] - before.get("requests", 0) == len(PROMPTS) + 2
        assert after["kv_blocks_used"] == 0
        assert all(s["requests"] > 0 for s in live.engine_loop.replica_snapshots)
    finally:
        live.stop()
        live.llm.close()


def test_replicas_free_a_disconnected_stream_and_survive_a_load() -> None:
    live = LiveServer(data_parallel_size=2, **OPTS)
    try:
        _idle(live)
        stream = live.client().completions.create(
            model="tiny", prompt="a long story", max_tokens=100, stream=True,
            extra_body={"ignore_eos": True})
        for n, _ in enumerate(stream):
            if n == 3:
                break
        stream.close()
        snap = _idle(live)
        assert snap["output_tokens"] < 100  # aborted, not run to its end
        errors: list[BaseException] = []
        counts: list[int] = []

        def worker(i: int) -> None:
            client = live.client(timeout=120)
            try:
                for j in range(3):
                    r = client.completions.create(model="tiny", prompt=[5 + i, 6 + j],
                                                  max_tokens=3, extra_body={"ignore_eos": True})
                    counts.append(r.usage.completion_tokens)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors[:3]
        assert counts == [3] * 48
        assert _idle(live)["kv_blocks_used"] == 0
    finally:
        live.stop()
        live.llm.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_replica_ends_the_service_with_503() -> None:
    """Killed while requests run: they end, later requests get 503 naming the rank, and the
    metrics' live gauges fall to 0 (the dead replica's last report is not kept)."""
    live = LiveServer(data_parallel_size=2, **OPTS)
    try:
        _idle(live)
        client = live.client()
        running = [threading.Thread(target=lambda: _swallow(lambda: client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=100, extra_body={"ignore_eos": True})))
            for _ in range(4)]
        for t in running:
            t.start()
        wait_running(live)
        live.llm.replicas.processes[1].kill()
        deadline = time.time() + 30
        while live.engine_loop.alive:  # the loop sees the exit within its next turns
            assert time.time() < deadline, "the dead replica went unnoticed"
            time.sleep(0.05)
        for t in running:
            t.join(60)
        snap = live.engine_loop.snapshot
        assert (snap["running"], snap["kv_blocks_used"]) == (0, 0), snap
        with pytest.raises(openai.InternalServerError) as err:
            live.client().completions.create(model="tiny", prompt="x", max_tokens=2)
        assert err.value.status_code == 503 and "rank 1" in str(err.value)
    finally:
        live.stop()
        live.llm.close()


def test_requests_go_to_the_replica_that_has_their_prefix() -> None:
    """With prefix caching, a request goes to the replica that was sent its prefix: A and B
    first land on replicas 0 and 1; then B' and A' (B' first, which load alone would give
    replica 0) each resume from their family's cached block; /metrics counts the placements."""
    import random

    rng = random.Random(5)
    families = [[rng.randint(3, 500) for _ in range(200)] for _ in range(2)]
    live = LiveServer(data_parallel_size=2, max_num_seqs=4, max_model_len=256, block_size=128,
                      enable_prefix_caching=True, prefill_mode="full")
    try:
        client = live.client(timeout=120)

        def ask(family: int, tail: int) -> int:
            return client.completions.create(
                model="tiny", prompt=families[family] + [tail] * 10, max_tokens=2,
                temperature=0).usage.prompt_tokens_details.cached_tokens

        def together(*asks) -> list[int]:
            got = [None] * len(asks)
            threads = [threading.Thread(target=lambda i=i, a=a: got.__setitem__(i, ask(*a)))
                       for i, a in enumerate(asks)]
            for t in threads:
                t.start()
                time.sleep(0.3)  # (submitted in this order)
            for t in threads:
                t.join(120)
            return got

        assert together((0, 7), (1, 7)) == [0, 0]
        assert together((1, 8), (0, 8)) == [128, 128]
        metrics = urllib.request.urlopen(live.base + "/metrics", timeout=10).read().decode()
        for outcome, count in (("matched", 2), ("busy", 0), ("unmatched", 2)):
            assert f"shoal_affinity_{outcome}_total {count}.0" in metrics
    finally:
        live.stop()
