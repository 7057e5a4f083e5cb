"""DSpark draft on the tiny model: the draft block against an independent naive computation, the
context rings under chunked / tail-only prefill, batch independence, and read-only caches."""

from __future__ import annotations

import os
import random

import pytest
import torch

from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.dspark import (
    dspark_context,
    dspark_context_rows,
    dspark_draft,
    greedy,
)
from shoal.model.presets import TINY
from shoal.model.state import KVCaches
from shoal.ops.reference.gemm import gemm_fp8, gemm_grouped_w8a16
from shoal.ops.reference.hyper_connections import hc_coeffs, hc_post
from shoal.ops.reference.moe import moe_mxfp4, router, swiglu_clamp
from shoal.ops.reference.norm import rmsnorm
from shoal.quant.fp8 import qdq_fp8_act
from support.tiny import new_caches

W = TINY.sliding_window
K = TINY.dspark_draft_len
SLOTS = (0, 2)
LENGTHS = (19, 6)  # one longer than the ring (16: its keys wrap), one shorter than the window


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY.vocab_size, (n,), generator=g).tolist()


def _prefill(model, prompts, slots, caches, mode="full"):
    """One batched prefill with context for the last window positions; returns the anchors."""
    chunks = [RequestChunk(p, 0, slot=s, block_ids=(2 * s, 2 * s + 1), prefill_len=len(p))
              for p, s in zip(prompts, slots, strict=True)]
    batch = build_forward_batch(TINY, chunks, prefill_mode=mode)
    out = model.forward(batch, caches, capture=True)
    keep = torch.tensor([len(p) - W for p in prompts])
    dspark_context(model, batch, caches, out.captures, dspark_context_rows(batch, keep))
    return out, batch


@pytest.fixture(scope="module")
def prefilled(tiny_model):
    """Two requests prefilled together; (caches, prompts, anchors, p, slots, captures by req)."""
    seed = int(os.environ.get("SHOAL_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed={seed}")
    prompts = [_prompt(seed + i, n) for i, n in enumerate(LENGTHS)]
    caches = new_caches()
    out, batch = _prefill(tiny_model, prompts, SLOTS, caches)
    anchors = out.logits.argmax(dim=-1)
    positions = torch.tensor([len(p) - 1 for p in prompts])
    caps = [out.captures[batch.req_index == r] for r in range(len(prompts))]
    return caches, prompts, anchors, positions, torch.tensor(SLOTS), caps


def _clone(c: KVCaches) -> KVCaches:
    return KVCaches([t.clone() for t in c.swa], {k: v.clone() for k, v in c.compressed.items()},
                    {k: v.clone() for k, v in c.index_k.items()},
                    {k: (a.clone(), b.clone()) for k, (a, b) in c.comp_state.items()},
                    dict(c.ratios), c.num_slots, c.ring_size, c.block_size, c.max_tokens)


# ---- an independent naive draft step ---------------------------------------------------------

def _rope(x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE of the last rd dims, theta 10000, no YaRN (ratio-0 layers)."""
    rd = TINY.rope_head_dim
    f = 1.0 / (TINY.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    ang = pos.to(torch.float32).unsqueeze(-1) * f
    rot = torch.polar(torch.ones_like(ang), ang)
    if inverse:
        rot = rot.conj()
    if x.dim() == 3:
        rot = rot.unsqueeze(1)
    tail = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
    out = torch.view_as_real(tail * rot).flatten(-2)
    return torch.cat([x[..., :-rd], out.to(x.dtype)], dim=-1)


def _collapse(stream: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """As `hc_collapse` defines it: exact products summed in fp64, then fp32, then bf16 (an fp32
    sum differs in its last bits, and about one run in a few hundred a bf16 rounding then flips
    and the drafts drift apart: seed 816288166)."""
    return (pre.double().unsqueeze(-1) * stream.double()).sum(dim=1).float().to(torch.bfloat16)


def _lin(p, x, name):
    return gemm_fp8(x=x, weight=p[name + ".weight"], weight_scale=p[name + ".scale"])


def _kv(p, pre, x, pos):
    kv = rmsnorm(x=_lin(p, x, pre + "attn.wkv"), weight=p[pre + "attn.kv_norm.weight"],
                 eps=TINY.norm_eps)
    return qdq_fp8_act(_rope(kv, pos)).float()


def _attention(p, pre, x, main_x, ctx_pos, blk_pos):
    """Every block query attends to all context keys and all block keys (non-causal)."""
    h, hd = TINY.num_heads, TINY.head_dim
    keys = torch.cat([_kv(p, pre, main_x, ctx_pos), _kv(p, pre, x, blk_pos)])  # [W' + k, hd]
    qr = rmsnorm(x=_lin(p, x, pre + "attn.wq_a"), weight=p[pre + "attn.q_norm.weight"],
                 eps=TINY.norm_eps)
    q = _rope(_lin(p, qr, pre + "attn.wq_b").view(-1, h, hd), blk_pos).float()
    s = torch.einsum("qhd,kd->qhk", q.double(), keys.double()).float() * hd ** -0.5
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - m)
    sink = p[pre + "attn.attn_sink"].float().view(1, h, 1)
    den = e.sum(-1, keepdim=True) + torch.exp(sink - m)
    num = torch.einsum("qhk,kd->qhd", e.to(torch.bfloat16).double(), keys.double()).float()
    o = _rope((num / den).to(torch.bfloat16), blk_pos, inverse=True)
    z = gemm_grouped_w8a16(o=o.view(-1, TINY.o_groups, h // TINY.o_groups * hd),
                           weight=p[pre + "attn.wo_a.weight"],
                           weight_scale=p[pre + "attn.wo_a.scale"])
    return _lin(p, z, pre + "attn.wo_b")


def _moe(p, pre, x):
    f = pre + "ffn."
    ids, w = router(x=x, weight=p[f + "gate.weight"], bias=p[f + "gate.bias"],
                    k=TINY.dspark_num_experts_per_tok, route_scale=TINY.routed_scaling_factor)
    assert int(ids.max()) < TINY.dspark_n_routed_experts
    routed = moe_mxfp4(x=x, ids=ids, weights=w, limit=TINY.swiglu_limit, **p.experts(pre))
    se = f + "shared_experts."
    hmid = swiglu_clamp(gate=_lin(p, x, se + "w1").float(), up=_lin(p, x, se + "w3").float(),
                        weight=None, limit=TINY.swiglu_limit)
    return (routed + _lin(p, hmid, se + "w2").float()).to(torch.bfloat16)


def _coeffs(p, name, stream):
    return hc_coeffs(stream=stream, fn=p[name + "_fn"], scale=p[name + "_scale"],
                     base=p[name + "_base"], norm_eps=TINY.norm_eps, hc_eps=TINY.hc_eps,
                     iters=TINY.hc_sinkhorn_iters)


def _naive_draft(model, capture: torch.Tensor, anchor: int, p_last: int):
    """One request: capture [n, C] of its prompt rows (row = position)."""
    p = model.params
    eps = TINY.norm_eps
    ctx_pos = torch.arange(max(0, p_last - W + 1), p_last + 1)
    main_x = rmsnorm(x=_lin(p, capture[ctx_pos], "mtp.0.main_proj"),
                     weight=p["mtp.0.main_norm.weight"], eps=eps)
    blk_pos = torch.arange(p_last + 1, p_last + 1 + K)
    ids = torch.tensor([anchor] + [TINY.dspark_noise_token_id] * (K - 1))
    stream = p["embed.weight"][ids].unsqueeze(1).repeat(1, TINY.hc_mult, 1)
    pre_prev = torch.zeros(K, TINY.hc_mult)
    pre_prev[:, 0] = 1
    for s in range(TINY.num_draft_layers):
        pre = f"mtp.{s}."
        pre_a, post_a, comb_a = _coeffs(p, pre + "hc_attn", stream)
        x = rmsnorm(x=_collapse(stream, pre_prev), weight=p[pre + "attn_norm.weight"], eps=eps)
        y = _attention(p, pre, x, main_x, ctx_pos, blk_pos)
        stream = hc_post(y=y, stream=stream, post=post_a, comb=comb_a)
        pre_f, post_f, comb_f = _coeffs(p, pre + "hc_ffn", stream)
        x = rmsnorm(x=_collapse(stream, pre_a), weight=p[pre + "ffn_norm.weight"], eps=eps)
        stream = hc_post(y=_moe(p, pre, x), stream=stream, post=post_f, comb=comb_f)
        pre_prev = pre_f
    last = f"mtp.{TINY.num_draft_layers - 1}."
    hid = _collapse(stream, pre_prev)
    hn = rmsnorm(x=hid, weight=p[last + "norm.weight"], eps=eps)
    base = hn.double() @ p["head.weight"].double().t()
    m_emb, m_head = p[last + "markov_head.embed.weight"], p[last + "markov_head.head.weight"]
    proj = p[last + "confidence_head.proj.weight"].double().flatten()
    prev, drafts, logits, conf = anchor, [], [], []
    for i in range(K):
        e = m_emb[prev]
        row = base[i] + e.double() @ m_head.double().t()
        conf.append(float(torch.cat([hid[i].double(), e.double()]) @ proj))
        prev = int(row.argmax())
        drafts.append(prev)
        logits.append(row.float())
    return drafts, torch.stack(logits), torch.tensor(conf)


def test_draft_matches_naive_computation(tiny_model, prefilled):
    caches, prompts, anchors, positions, slots, caps = prefilled
    caches = _clone(caches)
    seen = []

    def sampler(logits, pos):
        seen.append(pos.clone())
        return greedy(logits, pos)

    out = dspark_draft(tiny_model, caches, anchors, positions, slots, sampler)
    assert out.draft_ids.shape == (2, K) and out.logits.shape == (2, K, TINY.vocab_size)
    assert out.confidence.shape == (2, K)
    # one sample per block token; d_i is for position p + 1 + i
    assert torch.equal(torch.stack(seen, 1), positions.unsqueeze(1) + 2 + torch.arange(K))
    for r in range(2):
        ids, logits, conf = _naive_draft(tiny_model, caps[r], int(anchors[r]),
                                         int(positions[r]))
        assert out.draft_ids[r].tolist() == ids, f"request {r}"
        torch.testing.assert_close(out.logits[r], logits, atol=2e-3, rtol=0)
        torch.testing.assert_close(out.confidence[r], conf.float(), atol=2e-3, rtol=0)
    assert out.logits.std(dim=-1).min() > 1e-2  # informative, not collapsed


def _ring(caches: KVCaches, layer: int, slot: int, pos: range) -> torch.Tensor:
    rows = torch.tensor([slot * caches.ring_size + q % caches.ring_size for q in pos])
    return caches.swa[layer][rows]


def test_context_chunked_equals_whole_prefill(tiny_model, prefilled, seed):
    # One request three ways, batched to save forwards: slot 1 whole prompt in "full" mode
    # (logits="all" forces it), slot 3 whole prompt under the exact "staircase" tail-only plan,
    # slot 0 chunked prefill of the first N tokens (staircase, split at a random point) then
    # one-token decode steps. The draft rings must agree on the last window positions.
    _, prompts, *_ = prefilled
    ids = prompts[0] + [5]  # 19-token prompt (> ring), then a decode step
    n, big_n = len(ids), len(prompts[0])
    a = random.Random(seed).randint(1, big_n - 1)

    def step(chunks, keep_from):
        batch = build_forward_batch(TINY, chunks, prefill_mode="staircase")
        out = tiny_model.forward(batch, caches, capture=True)
        rows = dspark_context_rows(batch, torch.tensor(keep_from))
        dspark_context(tiny_model, batch, caches, out.captures, rows)

    caches = new_caches()
    step([RequestChunk(ids, 0, 1, (0, 1), n, logits="all"),
          RequestChunk(ids, 0, 3, (2, 3), n),
          RequestChunk.from_sequence(ids, 0, a, 0, (4, 5), big_n)], [n - W, n - W, big_n - W])
    step([RequestChunk.from_sequence(ids, a, big_n - a, 0, (4, 5), big_n)], [big_n - W])
    for pos in range(big_n, n):
        step([RequestChunk.from_sequence(ids, pos, 1, 0, (4, 5), big_n)], [big_n - W])
    last = range(n - W, n)
    for spec in TINY.draft_layers:
        ref = _ring(caches, spec.layer_id, 1, last)
        assert ref.any(dim=1).all()  # every kept position was written
        for name, slot in (("chunked", 0), ("staircase", 3)):
            got = _ring(caches, spec.layer_id, slot, last)
            # reference ops accumulate in fp64: the records are identical byte for byte
            assert torch.equal(got, ref), f"{name}, split {a}, layer {spec.layer_id}"


def test_draft_is_deterministic_and_batch_independent(tiny_model, prefilled):
    caches, _, anchors, positions, slots, _ = prefilled
    caches = _clone(caches)
    together = dspark_draft(tiny_model, caches, anchors, positions, slots)
    again = dspark_draft(tiny_model, caches, anchors, positions, slots)
    flipped = dspark_draft(tiny_model, caches, anchors.flip(0), positions.flip(0), slots.flip(0))
    for name, out in (("again", again), ("flipped", flipped)):
        order = [1, 0] if name == "flipped" else [0, 1]
        assert torch.equal(out.draft_ids[order], together.draft_ids), name
        torch.testing.assert_close(out.logits[order], together.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.confidence[order], together.confidence, atol=1e-5,
                                   rtol=0)
    for r in range(2):
        alone = dspark_draft(tiny_model, caches, anchors[r:r + 1], positions[r:r + 1],
                             slots[r:r + 1])
        assert torch.equal(alone.draft_ids[0], together.draft_ids[r])
        torch.testing.assert_close(alone.logits[0], together.logits[r], atol=1e-5, rtol=0)
        torch.testing.assert_close(alone.confidence[0], together.confidence[r], atol=1e-5,
                                   rtol=0)


def test_draft_only_reads_the_caches(tiny_model, prefilled):
    caches, _, anchors, positions, slots, _ = prefilled
    caches = _clone(caches)
    before = _clone(caches)
    base = caches.scratch_base
    dspark_draft(tiny_model, caches, anchors, positions, slots)
    for layer, (a, b) in enumerate(zip(caches.swa, before.swa, strict=True)):
        if layer < TINY.num_layers:
            assert torch.equal(a, b), f"backbone plane {layer} was modified"
        else:  # draft planes: the rings are intact; only the scratch tail is used
            assert torch.equal(a[:base], b[:base]), f"draft ring {layer} was modified"
            assert not torch.equal(a[base:], b[base:])
    for name in ("compressed", "index_k"):
        for k, v in getattr(caches, name).items():
            assert torch.equal(v, getattr(before, name)[k]), f"{name}[{k}]"
    for k, (kv, sc) in caches.comp_state.items():
        assert torch.equal(kv, before.comp_state[k][0]) and torch.equal(
            sc, before.comp_state[k][1]), f"comp_state[{k}]"


def test_draft_rejects_bad_inputs(tiny_model, prefilled):
    caches, _, anchors, positions, slots, _ = prefilled
    with pytest.raises(ValueError, match="positions and slots"):
        dspark_draft(tiny_model, caches, anchors, positions[:1], slots)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        dspark_draft(tiny_model, caches, anchors, positions - 100, slots)
    with pytest.raises(ValueError, match="captures"):
        batch = build_forward_batch(TINY, [RequestChunk([3, 4], 0, 0, (0,), 2)])
        dspark_context(tiny_model, batch, caches, torch.zeros(3, TINY.dspark_capture_dim), None)
