"""StepContext's deferred SWA commits: `flush_swa` over the stacked planes (one copy per run of
consecutive layers with the same rows) writes exactly what one copy per layer writes into
separate planes, only the kept positions land in the rings, and nothing else changes."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from shoal.model.context import StepContext
from shoal.model.presets import TINY
from shoal.model.state import KVCaches


def _context(caches: KVCaches, positions: list[int], req: list[int], slots: list[int]):
    batch = SimpleNamespace(positions=torch.tensor(positions), num_tokens=len(positions),
                            req_index=torch.tensor(req), num_requests=len(slots))
    token_slot = torch.tensor(slots)[batch.req_index]
    return StepContext(TINY, None, caches, None, batch, None, None, token_slot)


def test_stacked_flush_equals_per_layer_copies() -> None:
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    stacked = KVCaches.allocate(TINY, num_blocks=2, num_slots=3, max_tokens=40)
    assert stacked.swa_stack is not None and stacked.swa[1].data_ptr() == \
        stacked.swa_stack[1].data_ptr()
    stacked.swa_stack.copy_(torch.randint(0, 256, stacked.swa_stack.shape, generator=g,
                                          dtype=torch.uint8))
    before = stacked.swa_stack.clone()
    separate = KVCaches([p.clone() for p in stacked.swa], stacked.compressed, stacked.index_k,
                        stacked.comp_state, stacked.ratios, stacked.num_slots,
                        stacked.ring_size, stacked.block_size, stacked.max_tokens)
    # request 0 (slot 2): a chunk longer than the ring, request 1 (slot 0): one decode token
    ring = stacked.ring_size
    positions = list(range(5, 5 + ring + 7)) + [300]
    req = [0] * (ring + 7) + [1]
    tail = torch.tensor([ring + 3, ring + 6, ring + 7])  # a row subset (e.g. decoder rows)
    layers_all = [0, 1, 2, 4]  # runs [0..2] and [4]
    layers_tail = [3, 5]
    ctxs = [_context(c, positions, req, [2, 0]) for c in (stacked, separate)]
    for ctx in ctxs:
        for lay in layers_all:
            ctx.commit_swa(lay, None)
        for lay in layers_tail:
            ctx.commit_swa(lay, tail)
        ctx.flush_swa()
        assert not ctx._commits
    for lay in range(len(stacked.swa)):
        assert torch.equal(stacked.swa[lay], separate.swa[lay]), f"layer {lay} (seed {seed})"
    base = stacked.scratch_base
    for lay in range(len(stacked.swa)):
        plane, old = stacked.swa[lay], before[lay]
        rows = (range(len(positions)) if lay in layers_all else tail.tolist()
                if lay in layers_tail else [])
        expect = old.clone()
        for r in rows:
            p, slot = positions[r], [2, 0][req[r]]
            last = max(positions[i] for i in rows if req[i] == req[r])
            if p > last - ring:  # only the newest ring_size positions of a request
                expect[slot * ring + p % ring] = old[base + r]
        assert torch.equal(plane, expect), f"layer {lay} (seed {seed})"
