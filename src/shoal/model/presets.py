"""Built-in model configurations: `tiny` (CPU tests), `mini` (one-H200 benchmarks), `flash`.

Invariant: `tiny` and `mini` keep every layer role and every cache kind of the released model
(model.md "Scaled-down configurations"); only widths, layer counts and Engram sizes shrink.
"""

from __future__ import annotations

from shoal.model.config import ModelConfig

TINY = ModelConfig(
    name="tiny", vocab_size=512, hidden_size=128, num_layers=12, num_draft_layers=2,
    num_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32,
    max_position_embeddings=256, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    moe_intermediate_size=64, sliding_window=8,
    compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0),
    kv_source_layers=(2, 4, 6), index_source_layers=(2, 4, 6, 8, 10), candidate_source_layer=6,
    candidate_topk_blocks=5, candidate_group_rows=2, index_n_heads=4, index_head_dim=32,
    index_topk=8, engram_layer_ids=(1, 4), engram_num_embeddings=(384, 552),
    engram_max_ngram_size=4, engram_n_heads=2, engram_head_dim=32, engram_vocab_size=50,
    engram_compressed_vocab_size=301, engram_token_map="modulo", dspark_draft_len=3,
    dspark_noise_token_id=511, dspark_target_layer_ids=(9, 10, 11), dspark_markov_rank=16,
    dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, image_token_id=None,
)

MINI = ModelConfig(
    name="mini", num_layers=8, num_draft_layers=1,
    compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0), kv_source_layers=(2, 4),
    index_source_layers=(2, 4, 6), candidate_source_layer=4, engram_layer_ids=(1, 2),
    engram_vocab_size=1_000_000, engram_num_embeddings=(24003916, 24010950),
    engram_token_map="modulo", dspark_target_layer_ids=(5, 6, 7), max_position_embeddings=65536,
)

FLASH = ModelConfig()

PRESETS: dict[str, ModelConfig] = {"tiny": TINY, "mini": MINI, "flash": FLASH}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"model preset {name!r} is unknown; expected one of "
                         f"{sorted(PRESETS)}") from None
