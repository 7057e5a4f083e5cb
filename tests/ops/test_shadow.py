"""Shadow checking (ops/shadow.py): each fast op call is compared in situ with the reference."""

from __future__ import annotations

import torch

from shoal.checkpoint.writer import generate_weights
from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams
from shoal.model.presets import TINY
from shoal.model.state import KVCaches
from shoal.ops.registry import REFERENCE, REGISTRY, OpRegistry, OpTable, Tolerance, resolve_ops
from shoal.ops.shadow import ShadowLog, shadow_table


def _toy() -> OpRegistry:
    reg = OpRegistry()

    @reg.define("scale", tolerances={torch.float32: Tolerance(1e-3, 0.0)})
    def scale(*, x: torch.Tensor, s: float) -> torch.Tensor:
        return x * s

    @reg.define("fill", inplace=("out",))
    def fill(*, out: torch.Tensor, v: int) -> None:
        out.fill_(v)

    return reg


def test_mismatches_are_logged_and_the_fast_result_is_kept() -> None:
    reg = _toy()
    def fill(*, out: torch.Tensor, v: int) -> None:
        out.fill_(v + (v == 3))  # wrong for v == 3

    fast = OpTable({"scale": lambda *, x, s: x * s + 5e-4, "fill": fill},  # within atol 1e-3
                   {"scale": "fake", "fill": "fake"}, "fake")
    log = ShadowLog()
    table = shadow_table(fast, log, reg)
    x = torch.ones(4)
    assert torch.equal(table.scale(x=x, s=2.0), x * 2 + 5e-4)
    buf = torch.zeros(3, dtype=torch.int32)
    table.fill(out=buf, v=1)
    assert buf.tolist() == [1, 1, 1] and log.mismatches == []
    table.fill(out=buf, v=3)
    assert buf.tolist() == [4, 4, 4]  # the run goes on with the fast op's writes
    assert log.calls == {"scale": 1, "fill": 2}
    assert log.failed_ops() == ["fill"] and "call 1: out: 3 elements differ" in log.mismatches[0]
    fast_off = OpTable({"scale": lambda *, x, s: x * s + 2e-3}, {"scale": "fake"}, "fake")
    log = ShadowLog()
    shadow_table(fast_off, log, reg).scale(x=x, s=1.0)
    assert log.failed_ops() == ["scale"] and "over tolerance" in log.mismatches[0]


def test_tiny_model_under_shadow_of_an_exact_backend() -> None:
    """The reference functions labelled as a backend: shadowing runs every op the model calls
    twice (in-place caches cloned for the reference) and finds no mismatch; logits unchanged."""
    ref = resolve_ops("cpu", [REFERENCE])
    relabelled = OpTable(dict(ref.fns), {n: "copy" for n in ref.origin}, "copy")
    log = ShadowLog()
    params = ModelParams.load(TINY, generate_weights(TINY, seed=0, device="cpu"), "cpu")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, TINY.vocab_size, (40,), generator=g).tolist()
    outs = []
    for table in (ref, shadow_table(relabelled, log)):
        model = DeepseekV41(TINY, params, table, token_map_for(TINY))
        caches = KVCaches.allocate(TINY, num_blocks=4, num_slots=1, max_tokens=64,
                                   block_size=128, device="cpu")
        seq = prompt + [7, 9]
        logits = []
        for start, n in ((0, 40), (40, 1), (41, 1)):
            chunk = RequestChunk.from_sequence(seq, start, n, 0, (0, 1), 40)
            batch = build_forward_batch(TINY, [chunk], device="cpu")
            logits.append(model.forward(batch, caches).logits[-1])
        outs.append(torch.stack(logits))
    assert torch.equal(outs[0], outs[1])
    assert log.mismatches == []
    # every op of the plain forward was checked; the rest serve speculative drafting or are
    # fused into other ops on this path
    assert set(REGISTRY.ops) - set(log.calls) == {"act_quant_fp8", "confidence", "hc_collapse",
                                                  "markov_bias", "stream_mean"}
