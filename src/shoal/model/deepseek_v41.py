"""DeepSeek-V4.1 text model: the table of contents of one forward step (model.md §2).

    ids -> embed -> 4 streams, pre_prev = one-hot
    for each backbone layer L (rows per the tail-only plan):
        [Engram mix]                       (Engram layers, every row)
        [DSpark capture: mean of streams]  (target layers)
        attn coeffs (pre_a, post_a, C_a) = hc_coeffs(R)
        x = attn_norm(collapse(R, pre_prev));  R = post(attention(x), R, post_a, C_a)
        ffn coeffs (pre_f, post_f, C_f) = hc_coeffs(R)
        x = ffn_norm(collapse(R, pre_a));      R = post(moe(x), R, post_f, C_f)
        pre_prev = pre_f
    logits = head(norm(collapse(R, pre_prev)))   only for the rows that are sampled

Invariant: the model holds no per-request state; everything lives in the `KVCaches` passed in,
and every computation goes through the resolved op table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.model.attention import attention
from shoal.model.batch import ForwardBatch
from shoal.model.config import ModelConfig
from shoal.model.context import StepContext, select
from shoal.model.engram import engram
from shoal.model.engram_hash import EngramConstants, engram_constants
from shoal.model.hyper_connections import mhc_block
from shoal.model.params import ModelParams
from shoal.model.ring_snapshots import restore, save
from shoal.model.state import KVCaches
from shoal.ops.registry import OpTable
from shoal.parallel.expert_parallel import ExpertParallel


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [T', V] fp32 for batch.logits_rows (every row when None)
    # [T, n_targets * D] bf16 DSpark capture (if asked). Under tail-only prefill only the rows
    # that run every target layer in full are exact (the last window rows of a prefill and
    # every decode row): pass those to dspark_context (dspark_context_rows).
    captures: torch.Tensor | None = None


class DeepseekV41:
    """The backbone forward over explicit caches. Build once; call `forward` per step."""

    def __init__(self, config: ModelConfig, params: ModelParams, ops: OpTable,
                 token_map: torch.Tensor | None = None, ep: ExpertParallel | None = None
                 ) -> None:
        self.config = config
        self.params = params
        self.ops = ops
        self.engram_consts: EngramConstants | None = None
        self.token_map = token_map
        self.ep = ep
        # MoE prefix -> tokens routed to each expert, while recording (None: not recording)
        self.expert_loads: dict[str, torch.Tensor] | None = None
        # the first block's pre_prev (one-hot on stream 0), expanded per step: no launches
        self.first_pre = torch.zeros(config.hc_mult, dtype=torch.float32,
                                     device=params["embed.weight"].device)
        self.first_pre[0] = 1.0
        if config.engram_layer_ids:
            if token_map is None:
                raise ValueError("an Engram model needs the token map (engram_hash.token_map_for)")
            # on the weights' device once: the hash then copies nothing host -> device per step
            # (no sync, and CUDA graphs can capture it)
            device = params["embed.weight"].device
            self.engram_consts = engram_constants(config, token_map).to(device)
            self.token_map = token_map.to(device)

    def engram_rows(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Row ids [T, L, n] of every Engram layer (host-side metadata, before the forward)."""
        if self.engram_consts is None:
            return None
        c = self.engram_consts
        dead = torch.zeros_like(batch.input_ids, dtype=torch.bool)
        ids = torch.cat([batch.input_ids.to(torch.int64).unsqueeze(1),
                         batch.engram_history.to(torch.int64)], dim=1)
        return self.ops.engram_hash(ids=ids, positions=batch.positions, dead=dead,
                                    token_map=self.token_map, multipliers=c.multipliers,
                                    primes=c.primes, offsets=c.offsets, pad_id=c.pad_id)

    def forward(self, batch: ForwardBatch, caches: KVCaches,
                capture: bool = False) -> ForwardOutput:
        cfg, ops, p = self.config, self.ops, self.params
        restore(caches, batch.snapshot_restores)  # prefix-cache hits: rings below their start
        ctx = StepContext.build(cfg, p, caches, ops, batch, self.ep, self.expert_loads)
        t = batch.num_tokens
        hc = cfg.hc_mult
        emb = ops.embed(ids=batch.input_ids, table=p["embed.weight"])
        stream = emb.unsqueeze(1).expand(t, hc, cfg.hidden_size).contiguous()
        pre_prev = self.first_pre.expand(t, hc)  # [T, hc] fp32, row stride 0
        erows = self.engram_rows(batch)
        captures = []
        for spec in cfg.backbone:
            layer = spec.layer_id
            pre = f"layers.{layer}."
            rows = batch.rows(layer)
            if spec.has_engram:
                idx = cfg.engram_layer_ids.index(layer)
                stream = engram(ctx, layer, stream, erows[:, idx])
            if capture and layer in cfg.dspark_target_layer_ids:
                captures.append(ops.stream_mean(stream=stream))
            full = rows.full
            r_full, pre_f = mhc_block(
                ctx, pre, stream, pre_prev,
                lambda x, spec=spec, rows=rows: attention(ctx, spec, x, rows),
                cfg.num_experts_per_tok, rows)
            if full is None:
                stream, pre_prev = r_full, pre_f
            else:
                stream = stream.index_copy(0, full, r_full)
                pre_prev = pre_prev.index_copy(0, full, pre_f)
        save(caches, batch.snapshot_saves, committed=False)  # before the keys leave scratch
        ctx.flush_swa()
        rows = batch.logits_rows
        h = ops.hc_collapse_norm(stream=select(stream, rows), pre=select(pre_prev, rows),
                                 weight=p["norm.weight"], eps=cfg.norm_eps)
        logits = ops.lm_head(h=h, weight=p["head.weight"])
        return ForwardOutput(logits, torch.cat(captures, dim=-1) if captures else None)

    def serve_experts(self, draft: bool = False) -> None:
        """Expert parallelism, a forward this rank does not run (nothing scheduled, or no
        drafts to propose): serve the other ranks' rows through every MoE layer of the backbone
        (or of the DSpark block), in the forward's order."""
        assert self.ep is not None
        device = self.params["embed.weight"].device
        prefixes = [f"mtp.{s}." for s in range(self.config.num_draft_layers)] if draft else [
            f"layers.{spec.layer_id}." for spec in self.config.backbone]
        top_k = self.config.dspark_num_experts_per_tok if draft else \
            self.config.num_experts_per_tok
        for prefix in prefixes:
            self.ep.serve(self.ops, self.params.experts(prefix), self.config.swiglu_limit,
                          device, top_k)
