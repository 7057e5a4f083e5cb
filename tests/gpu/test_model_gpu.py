"""Model-level check on the GPU: the tiny model with the resolved CUDA op table (triton where
implemented) against the same model with reference ops on the same device: logits agree within
tolerance and greedy tokens are identical. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from shoal.checkpoint.writer import generate_weights
from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams
from shoal.model.presets import TINY
from shoal.model.state import KVCaches
from shoal.ops.registry import resolve_ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _greedy(model: DeepseekV41, prompt: list[int], steps: int, mode: str):
    caches = KVCaches.allocate(model.config, num_blocks=8, num_slots=2, max_tokens=256,
                               block_size=128, device="cuda")
    seq, logits_all = list(prompt), []
    for i in range(steps + 1):
        start = 0 if i == 0 else len(seq) - 1
        chunk = RequestChunk.from_sequence(seq, start, len(seq) - start, 1, (1, 2, 3),
                                           len(prompt))
        batch = build_forward_batch(model.config, [chunk], device="cuda", prefill_mode=mode)
        logits = model.forward(batch, caches).logits[-1].float().cpu()
        logits_all.append(logits)
        seq.append(int(logits.argmax()))
    return torch.stack(logits_all), seq[len(prompt):]


@pytest.mark.parametrize("mode", ["full", "staircase"])
def test_tiny_cuda_ops_match_reference(mode):
    params = ModelParams.load(TINY, generate_weights(TINY, seed=0, device="cuda"), "cuda")
    fast = DeepseekV41(TINY, params, resolve_ops("cuda"), token_map_for(TINY))
    ref = DeepseekV41(TINY, params, resolve_ops("cuda", ["reference"]), token_map_for(TINY))
    print(fast.ops.report())
    g = torch.Generator().manual_seed(5)
    for n in (7, 60):
        prompt = torch.randint(3, TINY.vocab_size, (n,), generator=g).tolist()
        lf, tf = _greedy(fast, prompt, 12, mode)
        lr, tr = _greedy(ref, prompt, 12, mode)
        scale = lr.abs().max()
        assert (lf - lr).abs().max() <= 0.03 * scale, (lf - lr).abs().max()
        assert tf == tr
