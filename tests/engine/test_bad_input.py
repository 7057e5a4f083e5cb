"""Bad input end to end: each bad prompt or bad per-request parameter gets its own error output
at its own position while the good requests of the same call complete (with the reference
loop's tokens); start-up errors raise ShoalError (a ValueError) naming the culprit; engine
options reach the config that owns them.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.refloop import assert_greedy, main_prompts, shared_llm
from shoal import LLM, SamplingParams
from shoal.config import CacheConfig, EngineConfig, RunnerConfig, ShoalError
from shoal.engine.engine import Engine
from shoal.model.presets import TINY
from shoal.sampling.structured import StructuredOutputSpec
from shoal.scheduler.config import SchedulerConfig

MAX_TOKENS = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def test_bad_requests_fail_alone_and_in_place() -> None:
    ps = main_prompts()
    refs = ps.refs()
    text0, ids3 = ps.engine_prompts()[0], list(ps.ids[3])
    limit = shared_llm().config.scheduler.max_model_len
    cases = [  # (prompt, params, None for a good request / words the error must contain)
        (text0, GREEDY, None),
        ("", GREEDY, "empty"),  # not [BOS]: an empty text is no prompt
        ([], GREEDY, "empty"),
        (list(range(3, 3 + limit)), GREEDY, "max_model_len"),
        ([5, TINY.vocab_size], GREEDY, "vocabulary"),
        ([5, -1], GREEDY, "vocabulary"),
        ([1.5, 2], GREEDY, "prompt"),
        (ids3, GREEDY.replace(stop_token_ids=[TINY.vocab_size + 7]), "stop_token_ids"),
        (ids3, GREEDY.replace(logprobs=TINY.vocab_size + 1), "logprobs"),
        (ids3, GREEDY.replace(structured=StructuredOutputSpec(json_schema={"type": "nonsense"})),
         "json_schema"),
        (ids3, GREEDY, None),
        (list(range(3, limit - 3)), GREEDY.replace(max_tokens=16), "max_model_len"),
        ({"prompt_token_ids": [TINY.vocab_size]}, GREEDY, "vocabulary"),
        ({"prompt": text0}, GREEDY, None),
    ]
    expected_ref = {0: refs[0], 10: refs[3], 13: refs[0]}
    outs = shared_llm().generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    assert len(outs) == len(cases)
    for i, ((_, _, error), out) in enumerate(zip(cases, outs, strict=True)):
        assert out.finished, i
        if error is None:
            assert out.error is None, (i, out.error)
            ref = expected_ref[i]
            assert tuple(out.prompt_token_ids) == ref.prompt, i
            (c,) = out.outputs
            assert_greedy(c.token_ids, c.finish_reason, ref, MAX_TOKENS)
        else:
            assert out.error is not None, f"case {i} ({cases[i][0]!r:.40}) did not fail"
            assert error in out.error, (i, out.error)
            assert all(c.finish_reason == "error" for c in out.outputs), i
            assert all(not c.token_ids for c in out.outputs), i
    ids = [o.request_id for o in outs]
    assert len(set(ids)) == len(ids)


def test_generate_iter_yields_errors_and_results_once() -> None:
    ps = main_prompts()
    prompts = [[], ps.engine_prompts()[0], [TINY.vocab_size], ps.engine_prompts()[1]]
    outs = list(shared_llm().generate_iter(prompts, GREEDY.replace(max_tokens=1)))
    assert len(outs) == 4 and len({o.request_id for o in outs}) == 4
    by_prompt = {tuple(o.prompt_token_ids): o for o in outs}
    for ids in (ps.ids[0], ps.ids[1]):
        assert by_prompt[ids].error is None
        assert len(by_prompt[ids].outputs[0].token_ids) == 1
    assert sum(o.error is not None for o in outs) == 2


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("n", 0), ("max_tokens", 0), ("min_tokens", -1), ("stop", [""]),
    ("stop_token_ids", [-3]), ("logprobs", -1), ("seed", 1.5), ("presence_penalty", 3.0),
])
def test_invalid_sampling_values_raise_at_construction(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_model_and_options_raise_shoal_error() -> None:
    assert issubclass(ShoalError, ValueError)
    with pytest.raises(ShoalError, match="no/such/path"):
        LLM("no/such/path", device="cpu")
    with pytest.raises(ShoalError, match="bogus_option"):
        LLM("tiny", device="cpu", bogus_option=1)
    with pytest.raises(ShoalError, match="cuda_graph_batch_sizes"):
        EngineConfig.create("tiny", device="cpu", cuda_graph_batch_sizes=(4, 0))
    with pytest.raises(ShoalError, match="prefill_mode"):
        LLM("tiny", device="cpu", prefill_mode="sideways")
    with pytest.raises(ShoalError, match="spec_verify_budget"):
        EngineConfig.create("tiny", device="cpu", spec_verify_budget=-1)
    with pytest.raises(ShoalError, match="collective_timeout_s"):
        EngineConfig.create("tiny", device="cpu", collective_timeout_s=0)
    with pytest.raises(ShoalError, match="max_num_seqs"):
        LLM("tiny", device="cpu", max_num_seqs=0)
    with pytest.raises(ValueError, match="sampling_params"):
        shared_llm().generate(["a", "b"], [GREEDY] * 3, use_tqdm=False)


def test_empty_text_prompt_is_an_error() -> None:
    (out,) = shared_llm().generate([""], GREEDY, use_tqdm=False)
    assert out.error is not None and "empty" in out.error


def test_block_size_option_sizes_the_kv_cache() -> None:
    """block_size is CacheConfig's; the runner's cache layout pages the caches with it and
    hands it to the scheduler, which gives out block ids of that size."""
    config = EngineConfig.create("tiny", device="cpu", block_size=128,
                                 kv_cache_memory_gb=0.05)
    engine = Engine(config)
    assert config.cache.block_size == engine.scheduler.block_size == 128
    assert engine.runner.layout.block_size == engine.runner.caches.block_size == 128
    with pytest.raises(ShoalError, match="block_size"):
        EngineConfig.create("tiny", device="cpu", block_size=100)


OPTION_VALUES = {  # a valid non-default value for every engine option
    "block_size": 128, "kv_cache_memory_gb": 0.25, "gpu_memory_utilization": 0.5,
    "max_num_batched_tokens": 96, "max_num_seqs": 5, "max_model_len": 200,
    "enable_chunked_prefill": True, "long_prefill_token_threshold": 17, "num_history_tokens": 2,
    "device": "cpu", "backends": ("reference",), "prefill_mode": "staircase",
    "replay_window": 99, "load_format": "dummy", "seed": 7, "speculative": True,
    "spec_confidence": 0.4, "spec_verify": "rejection", "spec_verify_budget": 12,
    "cuda_graphs": False, "cuda_graph_batch_sizes": (1, 8), "async_scheduling": False,
    "expert_parallel": True, "engram_placement": "host", "expert_placement": "/nonexistent.json",
    "record_expert_loads": True, "batch_invariant": True, "collective_timeout_s": 30.0,
    "enable_prefix_caching": True, "num_prefix_snapshots": 5, "kv_host_memory_gb": 0.01,
    "prefix_resume": "exact",  # (its only value)
    "scheduling_policy": "priority", "spec_overlap": True,
    "kv_store_path": "/nonexistent/shoal-kv", "kv_store_ttl_days": 7.0, "kv_store_max_gb": 2.5,
}


def test_every_engine_option_reaches_its_configs() -> None:
    owners = (CacheConfig, SchedulerConfig, RunnerConfig)
    fields = {f.name for c in owners for f in dataclasses.fields(c)}
    assert fields == set(OPTION_VALUES), "update OPTION_VALUES for new engine options"
    config = EngineConfig.create("tiny", **OPTION_VALUES)
    parts = (config.cache, config.scheduler, config.runner)
    for name, value in OPTION_VALUES.items():
        for owner, part in zip(owners, parts, strict=True):
            if name in {f.name for f in dataclasses.fields(owner)}:
                assert getattr(part, name) == value, f"{name} did not reach {owner.__name__}"


def test_truncate_prompt_tokens_keeps_the_prompts_tail() -> None:
    """truncate_prompt_tokens=N runs the prompt's last N tokens (what the output reports as its
    prompt ids), so a prompt longer than max_model_len can still run."""
    llm = shared_llm()
    limit = llm.config.scheduler.max_model_len
    long = [5 + i % 200 for i in range(limit + 10)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cut, tail, refused = llm.generate(
        [{"prompt_token_ids": long}, {"prompt_token_ids": long[-7:]},
         {"prompt_token_ids": long}],
        [greedy.replace(truncate_prompt_tokens=7), greedy, greedy], use_tqdm=False)
    assert cut.prompt_token_ids == long[-7:] and cut.error is None
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    assert refused.error is not None and "max_model_len" in refused.error
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
