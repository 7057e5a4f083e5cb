"""Self-consistency of the tiny reference model: whole-prompt forward = chunked prefill =
prefill + one-token decode; batch 1 = batch N; exact tail-only prefill modes = full."""

from __future__ import annotations

import random

import torch

from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.presets import TINY
from support.tiny import new_caches, random_chunks, run_steps

TOL = 1e-4  # fp32 noise (different GEMM shapes); logits are O(1)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY.vocab_size, (n,), generator=g).tolist()


def test_logits_are_finite_and_informative(tiny_model, seed):
    ids = _prompt(seed, 30)
    logits = run_steps(tiny_model, ids, [(0, 30)])
    assert logits.shape == (30, TINY.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 1e-3  # not collapsed to a constant


def test_chunked_prefill_equals_whole_prompt(tiny_model, seed):
    # 70 tokens: longer than the window (8), the ring (16), the r=1 candidate pool (10 rows),
    # with chunks that split ratio-2 groups and 2-row candidate blocks.
    rng = random.Random(seed)
    ids = _prompt(seed, 70)
    whole = run_steps(tiny_model, ids, [(0, 70)])
    for _ in range(2):
        steps = random_chunks(rng, 70)
        chunked = run_steps(tiny_model, ids, steps)
        torch.testing.assert_close(chunked, whole, atol=TOL, rtol=0, msg=f"chunks {steps}")


def test_prefill_then_decode_equals_whole_prompt(tiny_model, seed):
    rng = random.Random(seed)
    ids = _prompt(seed, 48)
    k = rng.randint(1, 20)
    whole = run_steps(tiny_model, ids, [(0, 48)])
    incremental = run_steps(tiny_model, ids, [(0, k)] + [(p, 1) for p in range(k, 48)])
    torch.testing.assert_close(incremental, whole, atol=TOL, rtol=0, msg=f"prefill {k}")


def test_batch_of_requests_equals_each_alone(tiny_model, seed):
    rng = random.Random(seed)
    prompts = [_prompt(seed + i, rng.randint(5, 40)) for i in range(4)]
    alone = [run_steps(tiny_model, p, [(0, len(p))], slot=1, blocks=(5,))[-1] for p in prompts]
    caches = new_caches()
    chunks = [RequestChunk(p, 0, slot=i, block_ids=(2 * i, 2 * i + 1), prefill_len=len(p))
              for i, p in enumerate(prompts)]
    batch = build_forward_batch(TINY, chunks)
    together = tiny_model.forward(batch, caches).logits
    torch.testing.assert_close(together, torch.stack(alone), atol=TOL, rtol=0)


def test_staircase_prefill_is_exact_and_decode_continues(tiny_model, seed):
    ids = _prompt(seed, 60)
    n = 50
    full = run_steps(tiny_model, ids, [(0, n)] + [(p, 1) for p in range(n, 60)],
                     mode="full", prefill_len=n, logits="last")
    for steps in ([(0, n)], [(0, 23), (23, 27)]):
        stair = run_steps(tiny_model, ids, steps + [(p, 1) for p in range(n, 60)],
                          mode="staircase", prefill_len=n, logits="last")
        # the last prefill row and every decode row match; earlier chunk ends are not sampled
        torch.testing.assert_close(stair[-11:], full[-11:], atol=TOL, rtol=0,
                                   msg=f"steps {steps}")


def test_staircase_skips_decoder_rows():
    n = 60
    batch = build_forward_batch(TINY, [RequestChunk(list(range(3, 3 + n)), 0, 0, (0,), n)],
                                prefill_mode="staircase")
    w, m = TINY.sliding_window, TINY.num_layers - TINY.decoder_start
    for k, layer in enumerate(range(TINY.decoder_start, TINY.num_layers)):
        full = batch.rows(layer).full
        expected = min(n, w + (m - 2 - k) * (w - 1))
        assert full is not None and full.numel() == expected, (layer, full)
        assert int(batch.rows(layer).kv.numel()) == min(n, expected + w - 1)


def test_bounded_prefill_uses_window_floor(tiny_model, seed):
    ids = _prompt(seed, 60)
    full = run_steps(tiny_model, ids, [(0, 60)], logits="last")
    wide = run_steps(tiny_model, ids, [(0, 60)], mode="bounded", replay_window=60,
                     logits="last")
    torch.testing.assert_close(wide, full, atol=TOL, rtol=0)  # W >= N: nothing is skipped
    narrow = run_steps(tiny_model, ids, [(0, 60)], mode="bounded", replay_window=10,
                       logits="last")
    assert torch.isfinite(narrow).all()
    assert (narrow - full).abs().max() > 0  # approximate: the drift is real, see benchmarks
