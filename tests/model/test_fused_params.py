"""FP8 projections of one input stored as one matrix (model/params.py FUSED_PAIRS): the official
names are views of the stacked rows, and the model's logits are bit-identical with and without
the fusion (one GEMM per pair in steps whose q and kv rows coincide, two otherwise)."""

from __future__ import annotations

import torch

from shoal.checkpoint.writer import generate_weights
from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import FUSED_PAIRS, ModelParams
from shoal.model.presets import TINY
from shoal.model.state import KVCaches
from shoal.ops.registry import resolve_ops


def test_fused_pairs_are_views_of_one_matrix() -> None:
    named = dict(generate_weights(TINY, seed=4))
    params = ModelParams.load(TINY, named.items())
    prefixes = [f"layers.{i}." for i in range(TINY.num_layers)]
    for pre in prefixes:
        for first, second, name in FUSED_PAIRS:
            got = params.fused(pre + name)
            assert got is not None, pre + name
            w, sc, n = got
            wa, wb = params[pre + first + ".weight"], params[pre + second + ".weight"]
            assert n == wa.shape[0] and w.shape[0] == n + wb.shape[0]
            assert wa.data_ptr() == w.data_ptr()  # views, not copies
            assert wb.data_ptr() == w.data_ptr() + n * w.shape[1] * w.element_size()
            for part in (first, second):
                for kind in (".weight", ".scale"):
                    want = named[pre + part + kind]
                    assert torch.equal(params[pre + part + kind].view(torch.uint8),
                                       want.view(torch.uint8)), pre + part + kind
            assert torch.equal(sc[:params[pre + first + ".scale"].shape[0]],
                               params[pre + first + ".scale"])
    assert params.fused("layers.0.attn.no_such") is None


def test_logits_equal_with_and_without_fusion() -> None:
    named = list(generate_weights(TINY, seed=4))
    fused = ModelParams.load(TINY, named)
    apart = ModelParams.load(TINY, named)
    apart._fused.clear()  # every projection through its own GEMM
    logits, decode_gemms = [], []
    for params in (fused, apart):
        ops = resolve_ops("cpu")
        calls = []
        gemm = ops.fns["gemm_fp8"]
        ops.fns["gemm_fp8"] = lambda _g=gemm, _c=calls, **kw: (_c.append(1), _g(**kw))[1]
        model = DeepseekV41(TINY, params, ops, token_map_for(TINY))
        caches = KVCaches.allocate(TINY, num_blocks=4, num_slots=3, max_tokens=96,
                                   block_size=128)
        g = torch.Generator().manual_seed(9)
        seqs = [torch.randint(3, TINY.vocab_size, (n,), generator=g).tolist() for n in (37, 5)]
        out = []
        for mode in ("full", "bounded"):  # bounded: decoder layers on the tail rows only
            chunks = [RequestChunk.from_sequence(s, 0, len(s), slot, [slot], len(s))
                      for slot, s in enumerate(seqs)]
            out.append(model.forward(build_forward_batch(TINY, chunks, prefill_mode=mode),
                                     caches).logits)
        step = [RequestChunk.from_sequence(s + [7], len(s), 1, slot, [slot], len(s) + 1)
                for slot, s in enumerate(seqs)]
        calls.clear()
        out.append(model.forward(build_forward_batch(TINY, step, prefill_mode="full"),
                                 caches).logits)
        logits.append(out)
        decode_gemms.append(len(calls))
    for a, b in zip(*logits, strict=True):
        assert torch.equal(a, b)
    # a decode step: one GEMM instead of two for wq_a + wkv and for w1 + w3, in every layer
    assert decode_gemms[1] - decode_gemms[0] == 2 * TINY.num_layers, decode_gemms
