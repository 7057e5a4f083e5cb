"""`shoal serve` builds a structured-output grammar on a worker thread: the engine keeps
stepping other requests meanwhile (a large grammar takes a second to build), a request aborted
while its grammar builds ends aborted and holds nothing, and one left building when the loop
stops still gets its end."""

from __future__ import annotations

import re
import threading
import time

import pytest

from shoal.sampling import SamplingParams
from shoal.sampling.structured import StructuredOutputBackend, StructuredOutputSpec
from support.live_server import LiveServer, post, wait_idle


@pytest.fixture
def gate(monkeypatch):
    """Grammar builds wait for `gate.set()`; `gate.entered` is set once one has started."""
    gate, entered = threading.Event(), threading.Event()
    build = StructuredOutputBackend._build

    def held(self, grammar, kind):
        entered.set()
        assert gate.wait(60), "the test never opened the gate"
        return build(self, grammar, kind)

    monkeypatch.setattr(StructuredOutputBackend, "_build", held)
    gate.entered = entered
    yield gate
    gate.set()


def _last(updates: list, timeout: float = 30):
    deadline = time.time() + timeout
    while not (updates and (updates[-1].output is not None or not updates[-1].finish_reasons)):
        assert time.time() < deadline, f"no last update: {updates}"
        time.sleep(0.02)
    return updates[-1]


def test_other_requests_run_while_a_grammar_builds(live: LiveServer, gate) -> None:
    guided = {"model": "tiny", "prompt": [5, 6], "max_tokens": 8, "temperature": 0.0,
              "guided_regex": "[0-9]{4}z"}
    replies: list = []
    waiter = threading.Thread(target=lambda: replies.append(post(live, "/v1/completions",
                                                                 guided)))
    waiter.start()
    assert gate.entered.wait(30)
    code, reply = post(live, "/v1/completions", {"model": "tiny", "prompt": [7, 8],
                                                 "max_tokens": 3})
    assert code == 200 and reply["usage"]["completion_tokens"] == 3
    assert not replies  # the guided request is still waiting for its grammar
    gate.set()
    waiter.join(60)
    code, reply = replies[0]
    assert code == 200, reply
    assert re.fullmatch(r"[0-9]{0,4}|[0-9]{4}z", reply["choices"][0]["text"]), reply
    wait_idle(live)


def test_a_request_aborted_while_its_grammar_builds_ends_aborted(live: LiveServer,
                                                                 gate) -> None:
    loop, updates = live.engine_loop, []
    params = SamplingParams(max_tokens=4, structured=StructuredOutputSpec(regex="[a-c]{3}q"))
    handle = loop.submit(None, params, prompt_token_ids=[5, 6], sink=updates.append)
    assert gate.entered.wait(30)
    loop.abort(handle)
    time.sleep(0.1)  # the abort reaches the loop thread before the grammar is built
    gate.set()
    assert _last(updates).finish_reasons == ["abort"]
    wait_idle(live)


def test_a_request_whose_grammar_builds_when_the_loop_stops_gets_its_end(gate) -> None:
    from shoal import LLM
    from shoal.serve.engine_loop import EngineLoop

    loop, updates = EngineLoop(LLM("tiny", device="cpu").engine), []
    loop.start()
    params = SamplingParams(max_tokens=4, structured=StructuredOutputSpec(regex="[d-f]{3}q"))
    loop.submit(None, params, prompt_token_ids=[5, 6], sink=updates.append)
    assert gate.entered.wait(30)
    loop.stop(timeout=30)
    assert _last(updates) is not None and not updates[-1].finish_reasons
    assert len(updates) == 1
