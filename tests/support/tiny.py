"""Tiny-model helpers: caches, multi-chunk runs and random chunkings."""

from __future__ import annotations

import random

import torch

from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.presets import TINY
from shoal.model.state import KVCaches


def new_caches(num_slots: int = 4, max_tokens: int = 256) -> KVCaches:
    return KVCaches.allocate(TINY, num_blocks=16, num_slots=num_slots, max_tokens=max_tokens,
                             block_size=128)


def run_steps(model: DeepseekV41, ids: list[int], steps: list[tuple[int, int]], *,
              mode: str = "full", prefill_len: int | None = None, slot: int = 0,
              blocks: tuple[int, ...] = (3, 7), caches: KVCaches | None = None,
              replay_window: int = 140, logits: str = "all") -> torch.Tensor:
    """Run one request through consecutive (start, num_new) chunks; return the logits rows."""
    caches = caches or new_caches()
    out = []
    for start, n in steps:
        batch = build_forward_batch(
            TINY, [RequestChunk.from_sequence(ids, start, n, slot, blocks, prefill_len or len(ids),
                                       logits)],
            prefill_mode=mode, replay_window=replay_window)
        out.append(model.forward(batch, caches).logits)
    return torch.cat(out)


def random_chunks(rng: random.Random, total: int, max_chunk: int = 17) -> list[tuple[int, int]]:
    steps, pos = [], 0
    while pos < total:
        n = min(rng.randint(1, max_chunk), total - pos)
        steps.append((pos, n))
        pos += n
    return steps
