"""DSpark draft (model.md §2.12): the context writer and the draft block forward.

    context (per kept target row q):  main_x = main_norm(main_proj . capture_q)
        for each stage s:  ring_s[q] = MXFP8(RoPE_q(kv_norm_s(wkv_s . main_x)))
    draft (per request, after the target sampled the anchor for p+1):
        ids [anchor, noise x (k-1)] at positions p+1 .. p+k          (k = dspark_draft_len)
        embed -> 4 streams, one-hot pre
        each stage: a full mHC block; attention keys = ring_s (window positions <= p)
                    + the k block keys, non-causally (block keys are NOT written to the ring);
                    MoE with the draft experts, top dspark_num_experts_per_tok
        h = collapse(last pre_f);  base = head(mtp.{last}.norm(h))   [k, V]
        prev = anchor; for i in 0..k-1: logits_i = base_i + markov(prev); d_{i+1} = sample(logits_i)
        confidence_i = proj . [h_i ; markov_embed(prev_i)]   (a logit)

A block of k tokens yields k drafts d_1..d_k for positions p+2 .. p+k+1 (the official
`forward_head` samples `block_size` tokens after the anchor); verification runs the target on
[anchor, d_1..d_k] at p+1 .. p+k+1.

Invariants: no hidden state (rings live in `KVCaches.swa[num_layers + s]`); every computation
goes through the op table; the draft only reads the rings: its block keys go to the scratch
rows of the draft planes, which carry nothing between calls; context is written scratch-first
then committed (only the last ring_size positions of each request), like backbone SWA keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.model.attention import attend_and_project, project_q, swa_kv
from shoal.model.batch import ForwardBatch
from shoal.model.config import LayerSpec
from shoal.model.context import StepContext, select
from shoal.model.hyper_connections import mhc_block
from shoal.model.state import KVCaches

# (logits [B, V] fp32, positions [B] int64 of the drafted tokens) -> ids [B] int64
SampleFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def greedy(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Temperature-0 draft sampler: argmax over the vocabulary. logits [B, V] -> [B] int64."""
    del positions
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class DraftOutput:
    """One draft block per request (B requests, k = dspark_draft_len)."""

    draft_ids: torch.Tensor  # [B, k] int64: d_1..d_k for positions p+2 .. p+k+1
    logits: torch.Tensor  # [B, k, V] fp32: base + Markov bias, the distribution d_i came from
    confidence: torch.Tensor  # [B, k] fp32 confidence logits (sigmoid -> probability)


def dspark_context_rows(batch: ForwardBatch, keep_from: torch.Tensor) -> torch.Tensor:
    """Rows of `batch` whose DSpark context is kept: positions >= keep_from[request].

    keep_from [R] int64: for a (re)prefill of N known tokens, N - sliding_window (only the last
    window positions are ever read); 0 keeps every row; decode rows (p >= N) are always kept.
    Returns sorted row indices [K] int64.
    """
    if keep_from.shape != batch.slots.shape:
        raise ValueError(f"keep_from: got shape {tuple(keep_from.shape)}, expected "
                         f"{tuple(batch.slots.shape)} (one entry per request)")
    keep = batch.positions >= keep_from.to(batch.positions.device)[batch.req_index]
    return torch.nonzero(keep).flatten()


def _draft_prefix(stage: int) -> str:
    return f"mtp.{stage}."


def dspark_context(model, batch: ForwardBatch, caches: KVCaches, captures: torch.Tensor,
                   rows: torch.Tensor | None) -> None:
    """Write the DSpark context of `rows` into every draft stage's SWA ring.

    model: a DeepseekV41 (config, params, ops). captures [T, n_targets * D] bf16: the capture of
    every row of `batch` (`DeepseekV41.forward(..., capture=True).captures`); only `rows`
    ([K] int64 sorted row indices, None = all) are read, and they must be exact there (under
    tail-only prefill: the last window positions, see batch.py). Per stage s (layer
    num_layers + s): kv = RoPE_p(kv_norm(wkv . main_x)) (ratio-0 table) is quantised to MXFP8
    into the plane's scratch rows, then committed to the request rings (the last ring_size
    positions of each request among `rows`). Nothing else is written.
    """
    cfg, ops, p = model.config, model.ops, model.params
    t = batch.num_tokens
    if captures.shape != (t, cfg.dspark_capture_dim):
        raise ValueError(f"captures: got shape {tuple(captures.shape)}, expected "
                         f"({t}, {cfg.dspark_capture_dim})")
    if not cfg.num_draft_layers:
        return
    if rows is not None and rows.numel() == 0:
        return
    ctx = StepContext.build(cfg, p, caches, ops, batch)
    head = _draft_prefix(0)
    main = ops.gemm_fp8(x=select(captures, rows), weight=p[head + "main_proj.weight"],
                        weight_scale=p[head + "main_proj.scale"])
    main_x = ops.rmsnorm(x=main, weight=p[head + "main_norm.weight"], eps=cfg.norm_eps)
    for s, spec in enumerate(cfg.draft_layers):
        swa_kv(ctx, _draft_prefix(s), spec, main_x, rows)
        ctx.commit_swa(spec.layer_id, rows)
    ctx.flush_swa()


def draft_key_rows(positions: torch.Tensor, slots: torch.Tensor, *, window: int,
                   ring_size: int, scratch_base: int, block: int) -> torch.Tensor:
    """Physical SWA rows of the draft queries' keys: [B * block, window + block] int32.

    Request b (query rows b*block .. b*block+block-1, all with the same key set): the ring
    entries of context positions max(0, p_b - window + 1) .. p_b, in the official ring-slot
    order (position mod window ascending), then its `block` block keys, which live in the
    scratch rows scratch_base + b*block + j; -1 padding at the end (non-causal: every block
    query sees every block key). positions [B] = p (the anchor sits at p + 1), slots [B].
    """
    b = positions.shape[0]
    dev = positions.device
    p = positions.long().unsqueeze(1)
    s = torch.arange(window, device=dev)
    ctx_pos = p - (p - s).remainder(window)  # [B, W], the one position of ring slot s
    ring = slots.long().unsqueeze(1) * ring_size + ctx_pos.remainder(ring_size)
    ring = torch.where(ctx_pos >= 0, ring, -1)
    own = scratch_base + (torch.arange(b, device=dev).unsqueeze(1) * block
                          + torch.arange(block, device=dev))
    keys = torch.cat([ring, own], dim=1)
    order = torch.sort((keys < 0).to(torch.uint8), dim=1, stable=True).indices
    keys = keys.gather(1, order)
    return keys.repeat_interleave(block, dim=0).to(torch.int32)


def _draft_batch(anchor_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block: int, noise_id: int, n_hist: int) -> ForwardBatch:
    """The block rows as a ForwardBatch (one 'chunk' of k rows per request, p+1 .. p+k)."""
    b, dev = anchor_ids.shape[0], anchor_ids.device
    ids = torch.full((b, block), noise_id, dtype=torch.int64, device=dev)
    ids[:, 0] = anchor_ids.long()
    offs = torch.arange(block, device=dev)
    pos = (positions.long().unsqueeze(1) + 1 + offs).flatten()
    req = torch.arange(b, device=dev).repeat_interleave(block)
    n = b * block
    return ForwardBatch(
        input_ids=ids.flatten(), positions=pos, req_index=req, slots=slots.long(),
        chunk_start=positions.long() + 1,
        block_table=torch.full((b, 1), -1, dtype=torch.int32, device=dev),
        engram_history=torch.full((n, n_hist), -1, dtype=torch.int64, device=dev),
        logits_rows=None,
        decoder_floor=torch.zeros(n, dtype=torch.int64, device=dev))


def _draft_attention(ctx: StepContext, stage: int, spec: LayerSpec,
                     x: torch.Tensor) -> torch.Tensor:
    """x [N, D] bf16 (attn_norm of the block rows) -> y [N, D] bf16.

    The block kv goes to the scratch rows (never committed); keys per query are
    `ctx.swa_rows_encoder` (see draft_key_rows)."""
    prefix = _draft_prefix(stage)
    pos = ctx.batch.positions
    swa_kv(ctx, prefix, spec, x, None)
    _, q = project_q(ctx, prefix, spec, x, pos)
    return attend_and_project(ctx, prefix, spec, q, pos, ctx.swa_rows_encoder, None, None)


def dspark_draft(model, caches: KVCaches, anchor_ids: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, sample_fn: SampleFn = greedy) -> DraftOutput:
    """Draft one block per request.

    model: a DeepseekV41. anchor_ids [B] int: the target's sample for position p+1;
    positions [B] int64: p, the last position whose context is in the draft rings (context
    for max(0, p - window + 1) .. p must have been written by `dspark_context`); slots [B]
    int64: request slots (rings). sample_fn(logits [B, V] fp32, positions [B]) -> ids [B]
    is called once per block index i with the positions p + 2 + i of the tokens it drafts.
    Reads the draft rings; writes only the scratch rows of the draft planes. Reads nothing
    back from the device (CUDA graphs capture it: runner/draft_graphs.py).
    """
    cfg, ops, p = model.config, model.ops, model.params
    if not cfg.num_draft_layers:
        raise ValueError("dspark_draft: the model has no draft layers (num_draft_layers=0)")
    b = int(anchor_ids.shape[0])
    if anchor_ids.dim() != 1 or positions.shape != (b,) or slots.shape != (b,):
        raise ValueError(f"dspark_draft: anchor_ids, positions and slots must all be [B]; got "
                         f"{tuple(anchor_ids.shape)}, {tuple(positions.shape)}, "
                         f"{tuple(slots.shape)}")
    k = cfg.dspark_draft_len
    if k < 1:
        raise ValueError(f"dspark_draft: dspark_draft_len is {k}, expected >= 1")
    n = b * k
    if n > caches.max_tokens:
        raise ValueError(f"dspark_draft: {b} requests x block {k} = {n} rows, more than the "
                         f"caches' scratch ({caches.max_tokens})")
    # checked on the host only: on a device it would be a sync (and none inside a CUDA graph)
    if b and positions.device.type == "cpu" and bool((positions < 0).any()):
        raise ValueError(f"dspark_draft: positions must be >= 0, got {positions.tolist()}")
    vocab, d, hc = cfg.vocab_size, cfg.hidden_size, cfg.hc_mult
    batch = _draft_batch(anchor_ids, positions, slots, k, cfg.dspark_noise_token_id,
                         max(cfg.engram_max_ngram_size - 1, 0))
    keys = draft_key_rows(positions, slots, window=cfg.sliding_window,
                          ring_size=caches.ring_size, scratch_base=caches.scratch_base, block=k)
    ctx = StepContext(cfg, p, caches, ops, batch, swa_rows_encoder=keys, swa_rows_decoder=keys,
                      token_slot=batch.slots[batch.req_index], ep=model.ep)
    emb = ops.embed(ids=batch.input_ids, table=p["embed.weight"])
    stream = emb.unsqueeze(1).expand(n, hc, d).contiguous()
    pre_prev = torch.zeros(n, hc, dtype=torch.float32, device=emb.device)
    pre_prev[:, 0] = 1.0
    for s, spec in enumerate(cfg.draft_layers):
        stream, pre_prev = mhc_block(
            ctx, _draft_prefix(s), stream, pre_prev,
            lambda x, s=s, spec=spec: _draft_attention(ctx, s, spec, x),
            cfg.dspark_num_experts_per_tok)
    last = _draft_prefix(cfg.num_draft_layers - 1)
    h = ops.hc_collapse(stream=stream, pre=pre_prev)  # [N, D] pre-norm hidden
    hn = ops.rmsnorm(x=h, weight=p[last + "norm.weight"], eps=cfg.norm_eps)
    logits = ops.lm_head(h=hn, weight=p["head.weight"]).view(b, k, vocab)
    prev = anchor_ids.long()
    drafts, embeds = [], []
    for i in range(k):
        bias, e = ops.markov_bias(prev=prev, embed=p[last + "markov_head.embed.weight"],
                                  head=p[last + "markov_head.head.weight"])
        logits[:, i] += bias
        embeds.append(e)
        prev = sample_fn(logits[:, i], positions.long() + 2 + i).long()
        drafts.append(prev)
    draft_ids = torch.stack(drafts, dim=1)
    conf = ops.confidence(hidden=h.view(b, k, d), markov_embed=torch.stack(embeds, dim=1),
                          proj=p[last + "confidence_head.proj.weight"])
    return DraftOutput(draft_ids, logits, conf)
