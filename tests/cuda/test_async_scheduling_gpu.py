"""Async scheduling on CUDA (GPU only; the CPU twin is tests/engine/test_async_scheduling.py).

- Outputs with async scheduling equal the synchronous loop's bit for bit (tokens and top-5
  logprobs) on `tiny` (CUDA graphs and eager) and `mini` (graphs): greedy and seeded sampled
  requests finishing at different steps, one with penalties (its steps are finished before the
  next is scheduled); most steps overlap.
- `ModelRunner.launch` of a decode step makes no synchronising CUDA call (sync debug mode
  "error"): a blocking copy or `.item()` there would make the host wait for the step in flight
  and hide nothing. (Event.synchronize, the intended wait for a staging buffer's previous
  upload, is not reported by that mode.)
"""

from __future__ import annotations

import gc

import pytest
import torch

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA sm_90")
pytestmark = pytest.mark.gpu  # tests/cuda: the engine and model on a CUDA device


# prompt lengths and context per model: mini's pass the 512 bound; tiny has 256 positions
LENGTHS = {"tiny": (5, 200, 33, 1, 90), "mini": (5, 700, 33, 1, 260)}
CONTEXT = {"tiny": 256, "mini": 1100}


def _llm(model: str, graphs: bool, overlap: bool, **options):
    from shoal import LLM

    return LLM(model, device="cuda", load_format="dummy", cuda_graphs=graphs,
               async_scheduling=overlap, kv_cache_memory_gb=2.0, max_num_seqs=6,
               max_model_len=CONTEXT[model], **options)


def _workload(llm) -> list[tuple]:
    from shoal import SamplingParams
    from shoal.bench import random_prompt

    g = torch.Generator().manual_seed(7)
    cfg = llm.config.model_config
    prompts = [random_prompt(cfg, n, g) for n in LENGTHS[cfg.name]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=9, ignore_eos=True,
                             logprobs=5),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True,
                             logprobs=5),
              SamplingParams(temperature=0.7, seed=5, max_tokens=6, ignore_eos=True,
                             repetition_penalty=1.2, logprobs=5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res = []
    for out in outs:
        (c,) = out.outputs
        res.append((list(c.token_ids), c.finish_reason,
                    [sorted((t, v.logprob) for t, v in e.items()) for e in c.logprobs]))
    return res


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("model,graphs", [("tiny", True), ("tiny", False), ("mini", True)])
def test_async_equals_sync_on_cuda(model: str, graphs: bool) -> None:
    results = []
    for overlap in (False, True):
        llm = _llm(model, graphs, overlap)
        results.append(_workload(llm))
        stats = llm.engine.stats
        if overlap:  # every step after the first overlaps, or resolves first while the
            # penalty request lives (H200, tiny: 5 overlapped + 6 resolved first of 12)
            assert stats.overlapped_steps > 0 and stats.resolved_first > 0, stats
            assert stats.overlapped_steps + stats.resolved_first >= stats.steps - 1, stats
        else:
            assert stats.overlapped_steps == 0
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    want, got = results
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a[0] == b[0], f"request {i}: tokens differ with async scheduling"
        assert a[1] == b[1], f"request {i}: finish reasons differ"
        assert a[2] == b[2], f"request {i}: logprobs differ with async scheduling"


def _strict_launches(engine) -> list[int]:
    """Make the runner's launches of decode and verify steps (every row past its prefill)
    issued while a step is in flight fail on any synchronising call (after 3 warm-up steps);
    returns the ids of the steps so checked, filled as they launch."""
    launch, checked = engine.runner.launch, []

    def strict_launch(plan, grammar_masks):
        ahead = engine.executor.num_in_flight and plan.scheduled and all(
            i.start_position >= i.prefill_len for i in plan.scheduled)
        if not ahead or engine.stats.steps < 3:
            return launch(plan, grammar_masks)
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = launch(plan, grammar_masks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(plan.step_id)
        return step

    engine.runner.launch = strict_launch
    return checked


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_decode_launch_makes_no_synchronising_call(graphs: bool) -> None:
    from shoal import SamplingParams

    llm = _llm("tiny", graphs, overlap=True)
    engine = llm.engine
    checked = _strict_launches(engine)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=1,
                             max_tokens=10, ignore_eos=True, logprobs=2)]
    outs = llm.generate([[5, 6, 7], [8, 9, 10, 11]], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
    assert len(checked) >= 5, checked
    assert engine.stats.overlapped_steps >= 8


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_speculative_steps_overlap_without_a_synchronising_launch(graphs: bool) -> None:
    """Speculative decoding under async scheduling on CUDA: a verify step launched while the
    previous one runs (its anchor, drafts and positions patched on the device) makes no call
    that synchronises with the device, and the outputs equal plain decoding's (tokens and
    logprobs; greedy and seeded sampling)."""
    from shoal import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=16,
                             ignore_eos=True, logprobs=2)]
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]

    def view(outs):
        return [(o.outputs[0].token_ids, [sorted((t, v.logprob) for t, v in e.items())
                                          for e in o.outputs[0].logprobs]) for o in outs]

    plain = _llm("tiny", graphs, overlap=False)
    want = view(plain.generate(prompts, params, use_tqdm=False))
    del plain
    llm = _llm("tiny", graphs, overlap=True, speculative=True, spec_overlap=True)
    engine = llm.engine
    checked = _strict_launches(engine)
    assert view(llm.generate(prompts, params, use_tqdm=False)) == want
    assert len(checked) >= 3, checked
    assert engine.stats.overlapped_steps >= 3 and engine.stats.drafts_proposed > 0
