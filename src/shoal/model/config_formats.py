"""The on-disk forms of the model configuration: the official HF `config.json` (nested
`text_config`, top-level `quantization_config`) and the reference's flat `inference/config.json`.

Owns the name maps between those forms and `ModelConfig`'s fields, and the rejection of V4-only
fields. Invariant: parsing returns plain keyword dicts for `ModelConfig(...)`, which validates.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A model configuration is malformed; the message names the field, value and expectation."""


def to_hf_dict(config: Any) -> dict[str, Any]:
    """The HF nested `config.json` form (what synthetic checkpoints write)."""
    text = {hf: getattr(config, ours) for hf, ours in _HF_TO_OURS.items()
            if not isinstance(ours, tuple)}
    text = {k: (list(v) if isinstance(v, tuple) else v) for k, v in text.items()}
    text["model_type"] = "deepseek_v41_text"
    text["num_key_value_heads"] = 1
    text["hidden_act"] = "silu"
    text["scoring_func"] = "sqrtsoftplus"
    text["topk_method"] = "noaux_tc"
    text["norm_topk_prob"] = True
    text["rope_scaling"] = {
        "rope_type": "yarn", "factor": config.rope_factor, "beta_fast": config.beta_fast,
        "beta_slow": config.beta_slow,
        "original_max_position_embeddings": config.original_max_position_embeddings,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "image_token_id": config.image_token_id,
        "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "fp8", "activation_scheme": "dynamic",
            "weight_block_size": [config.weight_block_size, config.weight_block_size],
            "scale_fmt": "ue8m0", "expert_dtype": config.expert_dtype,
        },
        "text_config": text,
        "shoal": {"name": config.name, "engram_token_map": config.engram_token_map,
                  "act_block_size": config.act_block_size},
    }


# HF text_config name -> our field name (a tuple value marks a nested/special field).
_HF_TO_OURS: dict[str, Any] = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers", "num_nextn_predict_layers": "num_draft_layers",
    "num_attention_heads": "num_heads", "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim", "q_lora_rank": "q_lora_rank", "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank", "rms_norm_eps": "norm_eps", "swiglu_limit": "swiglu_limit",
    "max_position_embeddings": "max_position_embeddings", "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta", "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts", "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "routed_scaling_factor": "routed_scaling_factor", "gate_temp": "gate_temp",
    "sliding_window": "sliding_window", "compress_ratios": "compress_ratios",
    "kv_source_layer_ids": "kv_source_layers", "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_group_rows", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids", "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size", "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim", "engram_vocab_size": "engram_vocab_size",
    "engram_pad_id": "engram_pad_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "dspark_block_size": "dspark_draft_len", "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_num_experts_per_tok",
}

# Reference flat name -> our field name.
_FLAT_TO_OURS: dict[str, str] = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_layers",
    "n_mtp_layers": "num_draft_layers", "n_heads": "num_heads", "head_dim": "head_dim",
    "rope_head_dim": "rope_head_dim", "q_lora_rank": "q_lora_rank", "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank", "norm_eps": "norm_eps", "swiglu_limit": "swiglu_limit",
    "rope_theta": "rope_theta", "compress_rope_theta": "compress_rope_theta",
    "rope_factor": "rope_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
    "original_seq_len": "original_max_position_embeddings",
    "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok", "moe_inter_dim": "moe_intermediate_size",
    "route_scale": "routed_scaling_factor", "gate_temp": "gate_temp",
    "window_size": "sliding_window", "compress_ratios": "compress_ratios",
    "kv_source_layers": "kv_source_layers", "index_source_layers": "index_source_layers",
    "candidate_source_layer": "candidate_source_layer",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_group_rows", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids", "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size", "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim", "engram_vocab_size": "engram_vocab_size",
    "engram_pad_id": "engram_pad_id", "engram_pad_token_id": "engram_pad_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "dspark_block_size": "dspark_draft_len", "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
    "image_token_id": "image_token_id", "expert_dtype": "expert_dtype",
}

# Fields that must be absent (V4 features that V4.1 does not have; never default them).
_FORBIDDEN = ("n_group", "topk_group", "num_hash_layers", "first_k_dense_replace",
              "intermediate_size", "n_hash_layers")


def from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError(f"text_config: expected an object, got {type(text).__name__}")
    out: dict[str, Any] = {}
    for hf, ours in _HF_TO_OURS.items():
        if hf in text:
            out[ours] = text[hf]
    if "engram_pad_token_id" in text:
        out["engram_pad_id"] = text["engram_pad_token_id"]
    _check_forbidden(text)
    scaling = text.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ConfigError(f"rope_scaling: got {scaling!r}, expected an object")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "yarn":
            raise ConfigError(f"rope_scaling.rope_type: got {kind!r}, expected 'yarn'")
        for key, ours in (("factor", "rope_factor"), ("beta_fast", "beta_fast"),
                          ("beta_slow", "beta_slow"),
                          ("original_max_position_embeddings",
                           "original_max_position_embeddings")):
            if key in scaling:
                out[ours] = scaling[key]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
        if key in raw:
            out[key] = raw[key]
        elif key in text:
            out[key] = text[key]
    quant = raw.get("quantization_config")  # top level only (model.md §1.1)
    if quant is not None:
        if not isinstance(quant, dict):
            raise ConfigError(f"quantization_config: got {quant!r}, expected an object")
        block = quant.get("weight_block_size", [32, 32])
        if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1]
                and isinstance(block[0], int) and block[0] > 0):
            raise ConfigError(f"quantization_config.weight_block_size: got {block!r}, "
                              "expected [b, b] with b a positive integer")
        out["weight_block_size"] = int(block[0])
        out["act_block_size"] = int(block[0])
        if quant.get("scale_fmt", "ue8m0") != "ue8m0":
            raise ConfigError(f"quantization_config.scale_fmt: got {quant.get('scale_fmt')!r}, "
                              "expected 'ue8m0'")
        out["expert_dtype"] = quant.get("expert_dtype", "fp4")
    extra = raw.get("shoal", {})
    if not isinstance(extra, dict):
        raise ConfigError(f"shoal: got {extra!r}, expected an object")
    for key in ("name", "engram_token_map", "act_block_size"):
        if key in extra:
            out[key] = extra[key]
    return _no_candidate_source(out)


def from_flat(raw: dict[str, Any]) -> dict[str, Any]:
    _check_forbidden(raw)
    out = {ours: raw[flat] for flat, ours in _FLAT_TO_OURS.items() if flat in raw}
    return _no_candidate_source(out)


def _no_candidate_source(out: dict[str, Any]) -> dict[str, Any]:
    """The reference writes candidate_source_layer -1 for "no candidate source"."""
    if out.get("candidate_source_layer") == -1:
        out["candidate_source_layer"] = None
    return out


def _check_forbidden(raw: dict[str, Any]) -> None:
    """V4 keys are refused; a key one letter or two off a known one is logged (a misspelling
    would otherwise leave that field at Flash's value without a word)."""
    known = {*_HF_TO_OURS, *_FLAT_TO_OURS, "rope_scaling", "quantization_config"}
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
            if close:
                logger.warning("config: unknown key %r ignored (did you mean %r?)", key,
                               close[0])
    for key in _FORBIDDEN:
        if raw.get(key) not in (None, 0):
            raise ConfigError(f"{key}: got {raw[key]!r}, but V4.1 has no such feature "
                              "(expected it absent); is this a V4 config?")
