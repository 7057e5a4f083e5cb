"""Speculative decoding on CUDA (GPU only; the CPU twins are tests/engine/test_speculative.py and
tests/sampling/test_speculative_sampling.py), `tiny` with dummy weights and the Triton ops.

- `spec_verify="exact"`: tokens and top-5 logprobs equal plain decoding's (CUDA graphs on) for
  greedy and seeded sampled requests; drafts are proposed and some are accepted (greedy).
- `spec_verify="rejection"`: two runs with the same seeds give the same tokens, and drafts are
  accepted at temperature 1.
"""

from __future__ import annotations

import gc

import pytest
import torch

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_GPU, reason="needs CUDA sm_90")]


def _llm(**kw):
    from shoal import LLM

    return LLM("tiny", device="cuda", load_format="dummy", kv_cache_memory_gb=1.0,
               max_num_seqs=6, max_model_len=256, **kw)


def _run(llm, params) -> list[tuple]:
    from shoal.bench import random_prompt

    g = torch.Generator().manual_seed(11)
    cfg = llm.config.model_config
    prompts = [random_prompt(cfg, n, g) for n in (7, 200, 1, 45)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [sorted((t, v.logprob) for t, v in e.items()) for e in o.outputs[0].logprobs or []])
            for o in outs]


def _params(temperature: float, logprobs: int | None = 5):
    from shoal import SamplingParams

    return [SamplingParams(temperature=temperature, seed=s, max_tokens=24, ignore_eos=True,
                           logprobs=logprobs) for s in range(4)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_exact_verification_equals_plain_decoding(temperature: float) -> None:
    plain = _llm()
    expected = _run(plain, _params(temperature))
    del plain
    gc.collect()
    spec = _llm(speculative=True, spec_verify="exact")
    got = _run(spec, _params(temperature))
    stats = spec.engine.stats
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert got == expected
    assert stats.drafts_proposed > 0
    if temperature == 0.0:
        assert stats.drafts_accepted > 0


def test_rejection_verification_is_reproducible_and_accepts() -> None:
    spec = _llm(speculative=True, spec_verify="rejection")
    first = _run(spec, _params(1.0, logprobs=None))
    again = _run(spec, _params(1.0, logprobs=None))
    assert first == again
    assert spec.engine.stats.drafts_accepted > 0
