"""`batch_invariant=True` on the H200 (GPU only): target requests alone and mixed into batches
of 7, 64 and 256 with random other requests (other prompt lengths, sampled and greedy, some
with logprobs) get bitwise the same tokens and top-5 log-probs, on `mini` (dummy weights, the
Triton ops), eager and with CUDA graphs, and the two engines agree with each other."""

from __future__ import annotations

import gc
import random

import pytest
import torch

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs CUDA sm_90")]

TARGETS = 3


def _targets_in_batches(cuda_graphs: bool) -> list:
    from shoal import LLM, SamplingParams
    from shoal.bench import random_prompt

    llm = LLM("mini", device="cuda", load_format="dummy", max_num_seqs=256, max_model_len=512,
              batch_invariant=True, cuda_graphs=cuda_graphs)
    cfg = llm.config.model_config
    g = torch.Generator().manual_seed(11)
    targets = [random_prompt(cfg, n, g) for n in (37, 150, 301)]
    want = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    rng = random.Random(3)
    runs = []
    for size in (TARGETS, 7, 64, 256):
        others = [{"prompt_token_ids": random_prompt(cfg, rng.randint(5, 400), g),
                   "sampling_params": SamplingParams(
                       temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 24),
                       ignore_eos=True, logprobs=rng.choice([None, 2]))}
                  for _ in range(size - TARGETS)]
        items = others + [{"prompt_token_ids": t, "sampling_params": want} for t in targets]
        rng.shuffle(items)
        outs = llm.generate(items, use_tqdm=False)
        runs.append([(list(o.outputs[0].token_ids),
                      [sorted((t, v.logprob) for t, v in e.items()) for e in o.outputs[0].logprobs])
                     for item, o in zip(items, outs, strict=True)
                     if item["prompt_token_ids"] in targets and item["sampling_params"] is want])
        runs[-1].sort(key=lambda r: r[0])  # order-free: compare as a set of target results
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return runs


def test_targets_get_the_same_bits_in_any_batch_eager_and_graphs() -> None:
    eager = _targets_in_batches(cuda_graphs=False)
    graphs = _targets_in_batches(cuda_graphs=True)
    for runs in (eager, graphs):
        assert all(r == runs[0] for r in runs[1:])
    assert graphs[0] == eager[0]
