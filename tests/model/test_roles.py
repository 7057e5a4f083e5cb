"""CSA2 role wiring on the tiny model, and loading errors.

- a Reuse layer has no compressor of its own (its weights would be rejected as unknown);
- perturbing a Full source's compressor changes the attention of every consumer of that
  source and of nothing before it;
- a Reindex layer's top-k rows lie inside the candidate source's published candidates;
- a missing tensor fails by name.
"""

from __future__ import annotations

import pytest
import torch

import shoal.model.attention as attention_mod
import shoal.model.deepseek_v41 as model_mod
from shoal.checkpoint.writer import generate_weights
from shoal.model.config import LayerRole
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams, WeightError
from shoal.model.presets import TINY
from support.tiny import run_steps


def _weights() -> dict[str, torch.Tensor]:
    return dict(generate_weights(TINY, seed=0))


def _model(weights: dict[str, torch.Tensor], tiny_model) -> DeepseekV41:
    return DeepseekV41(TINY, ModelParams.load(TINY, weights.items()), tiny_model.ops,
                       token_map_for(TINY))


def _attention_outputs(model: DeepseekV41, ids: list[int], monkeypatch) -> dict[int, torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    original = model_mod.attention

    def record(ctx, spec, x, rows):
        y = original(ctx, spec, x, rows)
        seen[spec.layer_id] = y.float().clone()
        return y

    monkeypatch.setattr(model_mod, "attention", record)
    run_steps(model, ids, [(0, len(ids))])
    monkeypatch.setattr(model_mod, "attention", original)
    return seen


def test_reuse_layers_have_no_compressor_of_their_own(tiny_model):
    reuse = [s.layer_id for s in TINY.backbone if s.role is LayerRole.REUSE]
    assert reuse
    weights = _weights()
    assert not any(f"layers.{layer}.attn.compressor" in n for n in weights for layer in reuse)
    weights[f"layers.{reuse[0]}.attn.compressor.wkv.weight"] = torch.zeros(
        TINY.head_dim, TINY.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(WeightError, match=f"layers.{reuse[0]}.attn.compressor.wkv.weight"):
        ModelParams.load(TINY, weights.items())


def test_perturbing_a_full_source_changes_exactly_its_consumers(tiny_model, monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY.vocab_size, (40,), generator=g).tolist()
    weights = _weights()
    base = _attention_outputs(_model(weights, tiny_model), ids, monkeypatch)
    source = 2
    name = f"layers.{source}.attn.compressor.wkv.weight"
    weights[name] = weights[name] * -1.5
    moved = _attention_outputs(_model(weights, tiny_model), ids, monkeypatch)
    consumers = [s.layer_id for s in TINY.backbone if s.kv_source == source]
    assert consumers == [2, 3]
    for layer in range(TINY.num_layers):
        changed = not torch.equal(base[layer], moved[layer])
        if layer < source:
            assert not changed, f"layer {layer} is before the source but changed"
        elif layer in consumers:
            assert changed, f"consumer {layer} of source {source} did not change"


def test_reindex_topk_lies_inside_the_candidates(tiny_model, monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY.vocab_size, (60,), generator=g).tolist()  # 60 rows at r = 1
    checked = []
    original = attention_mod.run_indexer

    def check(ctx, spec, x, qr, rows):
        original(ctx, spec, x, qr, rows)
        if spec.uses_candidates:
            top = ctx.shared.topk[spec.layer_id]
            cand = ctx.shared.candidates
            for t in range(top.shape[0]):
                picked = top[t][top[t] >= 0].long()
                assert bool(cand[t, picked].all()), (spec.layer_id, t, picked.tolist())
                n_vis = int(ctx.batch.positions[t]) + 1
                if n_vis > TINY.candidate_topk_blocks * TINY.candidate_group_rows:
                    assert int(cand[t].sum()) < n_vis  # the filter really bites here
            checked.append(spec.layer_id)

    monkeypatch.setattr(attention_mod, "run_indexer", check)
    run_steps(tiny_model, ids, [(0, 60)])
    assert checked == [8, 10]


def test_missing_tensor_fails_by_name():
    weights = _weights()
    del weights["layers.6.attn.indexer.wk.weight"]
    with pytest.raises(WeightError, match="layers.6.attn.indexer.wk.weight"):
        ModelParams.load(TINY, weights.items())


def test_wrong_shape_fails_by_name():
    weights = _weights()
    weights["layers.0.attn.attn_sink"] = torch.zeros(TINY.num_heads + 1)
    with pytest.raises(WeightError, match="layers.0.attn.attn_sink"):
        ModelParams.load(TINY, weights.items())
