"""ModelConfig: Flash layer roles (model.md §1.2, by hand), both config.json forms (§1.1) and the
errors of malformed configs (each names its field)."""

from __future__ import annotations

import copy

import pytest

from shoal.model.config import ConfigError, LayerRole, ModelConfig
from shoal.model.presets import FLASH, TINY

S, F, U, R = LayerRole.SWA_ONLY, LayerRole.FULL, LayerRole.REUSE, LayerRole.REINDEX

# (layer, ratio, role, kv source, top-k source): model.md §1.2 written out.
FLASH_TABLE = (
    [(0, 0, S, None, None), (1, 0, S, None, None)]
    + [(2, 2, F, 2, 2)] + [(i, 2, U, 2, 2) for i in range(3, 8)]
    + [(8, 2, F, 8, 8)] + [(i, 2, U, 8, 8) for i in range(9, 14)]
    + [(14, 2, F, 14, 14)] + [(i, 2, U, 14, 14) for i in range(15, 20)]
    + [(20, 1, F, 20, 20)] + [(i, 1, U, 20, 20) for i in (21, 22, 23)]
    + [(24, 1, R, 20, 24)] + [(i, 1, U, 20, 24) for i in (25, 26, 27)]
    + [(28, 1, R, 20, 28)] + [(i, 1, U, 20, 28) for i in (29, 30, 31)]
    + [(32, 1, R, 20, 32)] + [(i, 1, U, 20, 32) for i in (33, 34, 35)]
    + [(36, 1, R, 20, 36)] + [(i, 1, U, 20, 36) for i in (37, 38, 39)]
    + [(i, 0, S, None, None) for i in (40, 41, 42)]
)


def test_flash_layer_roles() -> None:
    assert len(FLASH.layers) == 43
    for (layer, ratio, role, kv, topk), spec in zip(FLASH_TABLE, FLASH.layers, strict=True):
        assert (spec.layer_id, spec.compress_ratio, spec.role, spec.kv_source,
                spec.topk_source) == (layer, ratio, role, kv, topk), layer
        assert spec.has_engram == (layer in (1, 14))
        assert spec.is_draft == (layer >= 40)
        assert spec.is_candidate_source == (layer == 20)
        assert spec.uses_candidates == (layer in (24, 28, 32, 36))
        assert spec.compressor_gated == (layer in (2, 8, 14))
        assert spec.owns_compressor == (layer in (2, 8, 14, 20))
        assert spec.owns_index_query == (layer in (2, 8, 14, 20, 24, 28, 32, 36))
        assert spec.is_decoder == (20 <= layer <= 39)
        assert spec.uses_compress_rope == (2 <= layer <= 39)


def hf_dict() -> dict:
    """The HF nested config.json of the release, from model.md §1.1."""
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120,
        "num_hidden_layers": 40, "num_nextn_predict_layers": 3, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
        "o_groups": 8, "o_lora_rank": 1024, "rms_norm_eps": 1e-20, "hidden_act": "silu",
        "swiglu_limit": 10.0, "max_position_embeddings": 1048576, "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "moe_intermediate_size": 2304, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "gate_temp": 1.0,
        "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
        "engram_n_heads": 8, "engram_head_dim": 256, "engram_vocab_size": 16000000,
        "engram_pad_id": 2, "engram_compressed_vocab_size": 99092, "dspark_block_size": 5,
        "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 128,
        "dspark_num_experts_per_tok": 3,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
        "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "image_token_id": 129264, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                "expert_dtype": "fp4"},
        "text_config": text, "vision_config": {"model_type": "deepseek_v41_vision"},
    }


def flat_dict() -> dict:
    """The reference's flat inference/config.json, from model.md §1.1."""
    return {
        "vocab_size": 129280, "dim": 5120, "moe_inter_dim": 2304, "n_layers": 40,
        "n_mtp_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3, "n_heads": 64,
        "n_routed_experts": 384, "n_shared_experts": 1, "n_activated_experts": 6,
        "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0,
        "q_lora_rank": 1280, "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-20,
        "o_groups": 8, "o_lora_rank": 1024, "window_size": 128,
        "kv_source_layers": [2, 8, 14, 20], "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36],
        "original_seq_len": 65536, "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32,
        "beta_slow": 1, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "candidate_source_layer": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "engram_layer_ids": [1, 14],
        "engram_vocab_size": 16000000, "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_pad_id": 2, "engram_compressed_vocab_size": 99092,
        "dtype": "fp8", "expert_dtype": "fp4", "compress_rope_theta": 160000,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], "engram_n_heads": 8,
        "engram_head_dim": 256, "image_token_id": 129264, "vision_n_layers": 32,
    }


def test_hf_and_flat_forms_parse_to_flash() -> None:
    hf = ModelConfig.from_dict(hf_dict())
    flat = ModelConfig.from_dict(flat_dict())
    fields = [f for f in FLASH.__dataclass_fields__ if f not in ("layers", "name")]
    for f in fields:
        assert getattr(hf, f) == getattr(FLASH, f), f
        assert getattr(flat, f) == getattr(FLASH, f), f
    assert [s.role for s in hf.layers] == [s.role for s in FLASH.layers]


def test_round_trip_to_hf_dict() -> None:
    for config in (TINY, FLASH):
        assert ModelConfig.from_dict(config.to_hf_dict()) == config


def test_engram_pad_spelling() -> None:
    hf = hf_dict()
    del hf["text_config"]["engram_pad_id"]
    hf["text_config"]["engram_pad_token_id"] = 7
    assert ModelConfig.from_dict(hf).engram_pad_id == 7
    flat = flat_dict()
    del flat["engram_pad_id"]
    flat["engram_pad_token_id"] = 5
    assert ModelConfig.from_dict(flat).engram_pad_id == 5


def test_rope_scaling_type_spelling() -> None:
    hf = hf_dict()
    scaling = hf["text_config"]["rope_scaling"]
    scaling["type"] = scaling.pop("rope_type")
    scaling["factor"] = 8
    assert ModelConfig.from_dict(hf).rope_factor == 8


def _hf_with(**text_changes) -> dict:
    raw = hf_dict()
    raw["text_config"].update(copy.deepcopy(text_changes))
    return raw


@pytest.mark.parametrize("raw, field", [
    (_hf_with(compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0]), "compress_ratios"),
    (_hf_with(compress_ratios=[0, 0, 2, 1] + [2] * 16 + [1] * 20 + [0, 0, 0]),
     r"compress_ratios\[3\]"),
    (_hf_with(kv_source_layer_ids=[2, 8, 14, 20, 21]), "index_source_layers"),
    (_hf_with(candidate_topk_blocks=64), "candidate_topk_blocks"),
    (_hf_with(n_group=8), "n_group"),
    (_hf_with(topk_group=4), "topk_group"),
    (_hf_with(first_k_dense_replace=3), "first_k_dense_replace"),
    (_hf_with(rope_scaling={"rope_type": "linear", "factor": 16}), "rope_scaling"),
    (_hf_with(engram_num_embeddings=[384006168, 1]), "engram_num_embeddings"),
    (_hf_with(dspark_noise_token_id=129280), "dspark_noise_token_id"),
    (_hf_with(hidden_size=5000), "hidden_size"),
])
def test_malformed_configs_name_the_field(raw, field) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(raw)


def test_flat_form_forbidden_and_unrecognised() -> None:
    flat = flat_dict()
    flat["num_hash_layers"] = 3
    with pytest.raises(ConfigError, match="num_hash_layers"):
        ModelConfig.from_dict(flat)
    with pytest.raises(ConfigError, match="config"):
        ModelConfig.from_dict({"foo": 1})
    assert issubclass(ConfigError, ValueError)


def test_tiny_roles() -> None:
    roles = [s.role for s in TINY.backbone]
    assert roles == [S, S, F, U, F, U, F, U, R, U, R, U]
    assert [s.layer_id for s in TINY.layers if s.has_engram] == [1, 4]
    assert TINY.decoder_start == 6 and TINY.layers[8].uses_candidates
