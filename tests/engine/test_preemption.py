"""Preemption by recompute end to end: a KV pool of 3 blocks of 128 tokens and 2 request slots,
two greedy requests of 127 prompt tokens + 3 outputs (each needs a 2nd block at its 3rd step).
One request must be preempted and recomputed (prompt + outputs so far); both must still return
exactly the tokens of the plain reference loop, i.e. of running alone.

Driven through the Engine API (add_request / step / output) with an EngineConfig of
block_size=128 (see test_bad_input.test_block_size_option_sizes_the_kv_cache).
"""

from __future__ import annotations

import dataclasses
import random

from engine.refloop import random_prompt, reference_greedy, session_seed, trusted_steps
from shoal import SamplingParams
from shoal.config import CacheConfig, EngineConfig
from shoal.engine.engine import Engine
from shoal.model.presets import TINY
from shoal.runner.cache_memory import CacheLayout

BLOCK = 128
PROMPT_LEN, MAX_TOKENS = BLOCK - 1, 3


def small_pool_config(num_blocks: int, num_slots: int) -> EngineConfig:
    layout = CacheLayout.from_model_config(TINY, block_size=BLOCK)
    budget = num_slots * layout.bytes_per_slot + (num_blocks + 0.5) * layout.bytes_per_block
    config = EngineConfig.create("tiny", device="cpu", prefill_mode="staircase",
                                 max_num_seqs=num_slots, block_size=BLOCK)
    return dataclasses.replace(config, cache=CacheConfig(block_size=BLOCK,
                                                         kv_cache_memory_gb=budget / 1e9))


def test_preempted_requests_finish_with_the_tokens_of_running_alone() -> None:
    rng = random.Random(session_seed() + 3)
    prompts = [random_prompt(rng, PROMPT_LEN) for _ in range(2)]
    engine = Engine(small_pool_config(num_blocks=3, num_slots=2))
    assert (engine.runner.memory.num_blocks, engine.runner.memory.num_slots) == (3, 2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    groups = [engine.add_request(p, params) for p in prompts]
    done = []
    for _ in range(20):
        done += engine.step()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    outs = [engine.output(g) for g in groups]
    for out, ref in zip(outs, reference_greedy(prompts, MAX_TOKENS), strict=True):
        assert out.error is None, out.error
        (c,) = out.outputs
        n = trusted_steps(ref, MAX_TOKENS)  # ignore_eos: compare the raw argmax tokens
        assert c.token_ids[:n] == list(ref.tokens[:n])
        assert len(c.token_ids) == MAX_TOKENS and c.finish_reason == "length"
    assert sum(o.metrics.num_preemptions for o in outs) >= 1
    assert engine.stats.preemptions == sum(o.metrics.num_preemptions for o in outs)
    # Engine.step() returns "the ids of user requests that completed in it": each once
    assert sorted(done) == sorted(groups)
