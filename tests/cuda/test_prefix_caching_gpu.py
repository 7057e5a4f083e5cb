"""Prefix caching on CUDA (GPU only; the CPU twins are tests/engine/test_prefix_caching.py):
`tiny` with dummy weights, the Triton ops, CUDA graphs and async scheduling. Requests that
resume after a cached prefix give the tokens and top-5 logprobs of a run without the cache:
a shared prompt prefix (snapshot saved inside a prefill forward), a multi-turn follow-up
(snapshot saved after a graph-replayed decode step crossed the block boundary), and the same
with a host tier and a store (pinned copies, persists behind an event).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_GPU, reason="needs CUDA sm_90")]


def _llm(**kw):
    from shoal import LLM

    return LLM("tiny", device="cuda", load_format="dummy", kv_cache_memory_gb=1.0,
               max_num_seqs=4, max_model_len=256, block_size=128, prefill_mode="full", **kw)


def _run(llm) -> tuple[list, int]:
    from shoal import SamplingParams
    from shoal.bench import random_prompt

    g = torch.Generator().manual_seed(5)
    cfg = llm.config.model_config
    shared = random_prompt(cfg, 150, g)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    got = []
    first = None
    for prompt in (shared + random_prompt(cfg, 9, g), shared + random_prompt(cfg, 30, g),
                   random_prompt(cfg, 100, g), None):
        if prompt is None:  # multi-turn: the previous prompt + its reply + a new message
            prompt = first + random_prompt(cfg, 5, g)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        tokens = list(out.outputs[0].token_ids)
        if first is None and len(prompt) == 100:
            first = prompt + tokens
        got.append((tokens, [sorted((t, v.logprob) for t, v in e.items())
                             for e in out.outputs[0].logprobs]))
    stats = llm.engine.scheduler.prefix_stats
    return got, 0 if stats is None else stats.hit_tokens


@pytest.mark.parametrize("invariant", [
    pytest.param(False, marks=pytest.mark.xfail(
        reason="a resume is a chunk boundary, and the default Triton moe_mxfp4 gives other "
        "bits across its tile families (benchmarks/results/session21_h200_2026-12-03.txt)",
        strict=False)),
    True], ids=["default", "batch_invariant"])
def test_resumed_requests_equal_a_run_without_the_cache(tmp_path: Path, invariant: bool) -> None:
    plain = _llm(batch_invariant=invariant)
    expected, _ = _run(plain)
    del plain
    gc.collect()
    for tiers in ({}, {"kv_host_memory_gb": 0.01, "kv_store_path": str(tmp_path / "kv")}):
        cached = _llm(enable_prefix_caching=True, batch_invariant=invariant, **tiers)
        got, hits = _run(cached)
        assert got == expected, tiers
        assert hits == 2 * 128, tiers  # the second prompt and the multi-turn follow-up
        cached.engine.scheduler.check_invariants()
        del cached
        gc.collect()
