"""Checkpoint inventory against model.md §6 (Flash, by hand) and against each config's roles."""

from __future__ import annotations

import re

import pytest
import torch

from shoal.model.config import LayerRole
from shoal.model.presets import FLASH, MINI, TINY
from shoal.model.weights import checkpoint_inventory, classify, inventory_counts

FP8, U8, BF16, F32 = torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.float32


@pytest.fixture(scope="module")
def flash():
    return checkpoint_inventory(FLASH)


def _layers_with(inv, suffix: str) -> set[int]:
    out = set()
    for name in inv:
        m = re.fullmatch(r"layers\.(\d+)\.(.*)", name)
        if m and m.group(2) == suffix:
            out.add(int(m.group(1)))
    return out


def test_flash_counts(flash) -> None:
    assert inventory_counts(flash) == {"backbone": 93415, "mtp": 2401, "global": 3}
    assert len(flash) == 93415 + 2401 + 3
    per_layer = [n for n in flash if n.startswith("layers.0.")]
    assert len(per_layer) == 2334
    experts = [n for n in flash if ".ffn.experts." in n and n.endswith(".weight")]
    assert len(experts) == 47232


def test_flash_shapes_table(flash) -> None:
    expected = {  # model.md §6, written out by hand
        "layers.0.attn_norm.weight": ((5120,), BF16),
        "layers.0.hc_attn_fn": ((24, 20480), F32), "layers.0.hc_ffn_base": ((24,), F32),
        "layers.0.hc_ffn_scale": ((3,), F32), "layers.0.attn.attn_sink": ((64,), F32),
        "layers.0.attn.wq_a.weight": ((1280, 5120), FP8), "layers.0.attn.wq_a.scale": ((40, 160), U8),
        "layers.0.attn.q_norm.weight": ((1280,), BF16),
        "layers.0.attn.wq_b.weight": ((32768, 1280), FP8), "layers.0.attn.wq_b.scale": ((1024, 40), U8),
        "layers.0.attn.wkv.weight": ((512, 5120), FP8), "layers.0.attn.wkv.scale": ((16, 160), U8),
        "layers.0.attn.kv_norm.weight": ((512,), BF16),
        "layers.0.attn.wo_a.weight": ((8192, 4096), FP8), "layers.0.attn.wo_a.scale": ((256, 128), U8),
        "layers.0.attn.wo_b.weight": ((5120, 8192), FP8), "layers.0.attn.wo_b.scale": ((160, 256), U8),
        "layers.0.ffn.gate.weight": ((384, 5120), BF16), "layers.0.ffn.gate.bias": ((384,), F32),
        "layers.0.ffn.gate.bias_vl": ((384,), F32),
        "layers.0.ffn.shared_experts.w1.weight": ((2304, 5120), FP8),
        "layers.0.ffn.shared_experts.w1.scale": ((72, 160), U8),
        "layers.0.ffn.shared_experts.w2.weight": ((5120, 2304), FP8),
        "layers.0.ffn.shared_experts.w2.scale": ((160, 72), U8),
        "layers.39.ffn.experts.383.w1.weight": ((2304, 2560), U8),
        "layers.39.ffn.experts.383.w3.scale": ((2304, 160), U8),
        "layers.5.ffn.experts.0.w2.weight": ((5120, 1152), U8),
        "layers.5.ffn.experts.0.w2.scale": ((5120, 72), U8),
        "layers.2.attn.compressor.wgate.weight": ((512, 5120), BF16),
        "layers.20.attn.compressor.wkv.weight": ((512, 5120), BF16),
        "layers.20.attn.compressor.norm.weight": ((512,), BF16),
        "layers.8.attn.indexer.wk.weight": ((128, 512), BF16),
        "layers.8.attn.indexer.k_norm.weight": ((128,), BF16),
        "layers.36.attn.indexer.wq_b.weight": ((4096, 1280), FP8),
        "layers.36.attn.indexer.wq_b.scale": ((128, 40), U8),
        "layers.36.attn.indexer.weights_proj.weight": ((32, 5120), BF16),
        "layers.1.engram.embed.weight": ((384006168, 256), FP8),
        "layers.1.engram.embed.scale": ((384006168, 8), U8),
        "layers.14.engram.embed.weight": ((384016682, 256), FP8),
        "layers.14.engram.wkv.weight": ((25600, 6144), FP8),
        "layers.14.engram.wkv.scale": ((800, 192), U8),
        "layers.1.engram.q_weight": ((4, 5120), BF16), "layers.1.engram.k_weight": ((4, 5120), BF16),
        "embed.weight": ((129280, 5120), BF16), "head.weight": ((129280, 5120), BF16),
        "norm.weight": ((5120,), BF16),
        "mtp.1.ffn.gate.weight": ((128, 5120), BF16),
        "mtp.2.ffn.experts.127.w2.weight": ((5120, 1152), U8),
        "mtp.0.main_proj.weight": ((5120, 15360), FP8), "mtp.0.main_proj.scale": ((160, 480), U8),
        "mtp.0.main_norm.weight": ((5120,), BF16), "mtp.2.norm.weight": ((5120,), BF16),
        "mtp.2.markov_head.embed.weight": ((129280, 256), BF16),
        "mtp.2.markov_head.head.weight": ((129280, 256), BF16),
        "mtp.2.confidence_head.proj.weight": ((1, 5376), BF16),
    }
    for name, (shape, dtype) in expected.items():
        assert (flash[name].shape, flash[name].dtype) == (shape, dtype), name


def test_flash_role_extras(flash) -> None:
    assert _layers_with(flash, "attn.compressor.wgate.weight") == {2, 8, 14}
    assert _layers_with(flash, "attn.compressor.wkv.weight") == {2, 8, 14, 20}
    assert _layers_with(flash, "attn.compressor.norm.weight") == {2, 8, 14, 20}
    assert _layers_with(flash, "attn.indexer.wk.weight") == {2, 8, 14, 20}
    assert _layers_with(flash, "attn.indexer.k_norm.weight") == {2, 8, 14, 20}
    assert _layers_with(flash, "attn.indexer.wq_b.weight") == {2, 8, 14, 20, 24, 28, 32, 36}
    assert _layers_with(flash, "attn.indexer.weights_proj.weight") == {2, 8, 14, 20, 24, 28, 32,
                                                                       36}
    assert _layers_with(flash, "engram.embed.weight") == {1, 14}
    assert not [n for n in flash if n.startswith("mtp.") and ("compressor" in n or "indexer" in n)]
    assert [n for n in flash if "main_proj" in n or "main_norm" in n] == [
        "mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight"]
    assert {n.split(".")[1] for n in flash if "markov_head" in n or "confidence" in n} == {"2"}
    assert not [n for n in flash if re.match(r"mtp\.\d\.ffn\.experts\.128\.", n)]


def test_flash_sizes(flash) -> None:
    one_expert = sum(flash[f"layers.0.ffn.experts.0.{w}.{p}"].nbytes
                     for w in ("w1", "w2", "w3") for p in ("weight", "scale"))
    assert one_expert == 18_800_640  # 18.80 MB
    rows = sum(FLASH.engram_num_embeddings)
    assert flash["layers.1.engram.embed.weight"].nbytes // 384006168 + \
        flash["layers.1.engram.embed.scale"].nbytes // 384006168 == 264
    total = sum(s.nbytes for s in flash.values())
    assert 505e9 < total < 512e9 and rows * 264 > 202e9  # ≈ 510 GB without vision


def _expected_count(c) -> int:
    """Count derived independently from the config fields and roles (model.md §6 rules)."""
    total = 3
    for spec in c.layers:
        n_exp = c.dspark_n_routed_experts if spec.is_draft else c.n_routed_experts
        total += 30 + 6 * n_exp
        if spec.is_draft:
            continue
        if spec.role is LayerRole.FULL:
            total += 4 + (1 if spec.compress_ratio >= 2 else 0) + 3
        elif spec.role is LayerRole.REINDEX:
            total += 3
        total += 6 if spec.has_engram else 0
    return total + (3 if c.num_draft_layers else 0) + (4 if c.num_draft_layers else 0)


@pytest.mark.parametrize("config", [TINY, MINI, FLASH], ids=lambda c: c.name)
def test_inventory_consistent_with_config(config) -> None:
    inv = checkpoint_inventory(config)
    assert len(inv) == _expected_count(config)
    d, hc = config.hidden_size, config.hc_mult
    for spec in config.backbone:
        p = f"layers.{spec.layer_id}."
        assert inv[p + "attn.wq_b.weight"].shape == (config.num_heads * config.head_dim,
                                                     config.q_lora_rank)
        assert inv[p + "hc_attn_fn"].shape == ((2 + hc) * hc, hc * d)
        assert (p + "attn.compressor.wkv.weight" in inv) == (spec.role is LayerRole.FULL)
        assert (p + "attn.compressor.wgate.weight" in inv) == spec.compressor_gated
        assert (p + "attn.indexer.wq_b.weight" in inv) == spec.owns_index_query
        assert (p + "engram.wkv.weight" in inv) == spec.has_engram
        n_exp = config.n_routed_experts
        assert inv[f"{p}ffn.experts.{n_exp - 1}.w1.weight"].shape == (
            config.moe_intermediate_size, d // 2)
        assert f"{p}ffn.experts.{n_exp}.w1.weight" not in inv
    for li, layer in enumerate(config.engram_layer_ids):
        p = f"layers.{layer}.engram."
        assert inv[p + "embed.weight"].shape == (config.engram_num_embeddings[li],
                                                 config.engram_head_dim)
        assert inv[p + "wkv.weight"].shape == (
            d * (hc + 1), (config.engram_max_ngram_size - 1) * config.engram_n_heads
            * config.engram_head_dim)
    last = config.num_draft_layers - 1
    assert inv["mtp.0.main_proj.weight"].shape == (d, len(config.dspark_target_layer_ids) * d)
    assert inv[f"mtp.{last}.confidence_head.proj.weight"].shape == (
        1, d + config.dspark_markov_rank)
    assert inv[f"mtp.{last}.ffn.gate.weight"].shape == (config.dspark_n_routed_experts, d)


def test_tiny_specifics() -> None:
    inv = checkpoint_inventory(TINY)
    assert inv["layers.4.engram.embed.weight"].shape == (552, 32)
    assert inv["layers.4.engram.embed.scale"].shape == (552, 1)
    assert inv["layers.6.attn.compressor.wkv.weight"].shape == (64, 128)
    assert "layers.6.attn.compressor.wgate.weight" not in inv
    assert "layers.8.attn.indexer.wk.weight" not in inv
    assert inv["layers.8.attn.indexer.wq_b.weight"].shape == (4 * 32, 64)
    assert inv["mtp.1.markov_head.embed.weight"].shape == (512, 16)
    assert "mtp.0.markov_head.embed.weight" not in inv and "mtp.1.main_proj.weight" not in inv
    assert inv["mtp.0.ffn.experts.3.w2.scale"].shape == (128, 2)


def test_classify() -> None:
    inv = checkpoint_inventory(TINY)
    known = classify("layers.2.attn.compressor.wgate.weight", inv)
    assert known.status == "known" and known.spec is inv[known.name]
    for name in ("vision.blocks.0.attn.qkv.weight", "aligner.w1.weight", "image_start",
                 "image_newline"):
        assert classify(name, inv).status == "ignored"
    for name in ("layers.12.attn.wq_a.weight", "layers.6.attn.compressor.wgate.weight",
                 "layers.0.ffn.experts.8.w1.weight", "layers.0.attn.q_proj.weight", "visionx"):
        assert classify(name, TINY).status == "unknown", name
