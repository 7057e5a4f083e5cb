"""CacheLayout byte counts (890 B/token for Flash) and plan_memory arithmetic."""

from __future__ import annotations

import pytest

from shoal.model.presets import FLASH, MINI, TINY
from shoal.runner.cache_memory import CacheLayout, plan_memory


def test_flash_is_890_bytes_per_context_token() -> None:
    layout = CacheLayout.from_model_config(FLASH)
    assert [s.layer_id for s in layout.sources] == [2, 8, 14, 20]
    assert [s.compress_ratio for s in layout.sources] == [2, 2, 2, 1]
    assert [s.rows_per_block for s in layout.sources] == [128, 128, 128, 256]
    for source in layout.sources:
        assert (source.compressed_record_bytes, source.index_record_bytes) == (288, 68)
    assert layout.bytes_per_block == 3 * 128 * 356 + 256 * 356 == 256 * 890
    assert layout.bytes_per_context_token() == 890.0
    # Same figure at a larger page.
    assert CacheLayout.from_model_config(FLASH, block_size=512).bytes_per_context_token() == 890.0


def test_flash_slot_bytes() -> None:
    layout = CacheLayout.from_model_config(FLASH)
    assert layout.swa_record_bytes == 528
    assert layout.swa_ring_len == 128 + 5  # window + DSpark block slack
    assert len(layout.swa_layer_ids) == 43  # 40 backbone + 3 draft layers
    assert layout.swa_bytes_per_slot == 43 * 133 * 528
    assert [s.layer_id for s in layout.compressor_states] == [2, 8, 14]  # layer 20 has no gate
    # a ring of r + slack = 2 + 5 tokens per gated source: [kv | score] x 512 fp32 each
    assert layout.compressor_bytes_per_slot == 3 * (7 * 2 * 512 * 4)
    assert layout.bytes_per_slot == 3_019_632 + 86_016


def test_tiny_and_mini_figures() -> None:
    tiny = CacheLayout.from_model_config(TINY, block_size=128)
    # head_dim 64 -> 32 + 4 = 36 B; index_head_dim 32 -> 16 + 1 = 17 B; sources r = 2, 2, 1.
    assert tiny.bytes_per_context_token() == 2 * 53 / 2 + 53 == 106.0
    assert tiny.swa_record_bytes == 66 and tiny.swa_ring_len == 8 + 3
    assert tiny.bytes_per_slot == 14 * 11 * 66 + 2 * ((2 + 3) * 2 * 64 * 4)  # ring r + slack
    mini = CacheLayout.from_model_config(MINI)
    assert mini.bytes_per_context_token() == 356 / 2 + 356 == 534.0
    assert mini.bytes_per_slot == 9 * 133 * 528 + (2 + 5) * 2 * 512 * 4


def test_block_size_must_be_aligned() -> None:
    for bad in (0, 64, 200, 257):
        with pytest.raises(ValueError, match="block_size"):
            CacheLayout.from_model_config(FLASH, block_size=bad)
    assert CacheLayout.from_model_config(FLASH, block_size=384).sources[0].rows_per_block == 192


def test_plan_memory_math() -> None:
    layout = CacheLayout.from_model_config(FLASH)
    per_block, per_slot = 227_840, 3_105_648
    budget = 10 * 2**30
    plan = plan_memory(layout, budget, max_num_seqs=16, max_model_len=2**20)
    assert plan.max_blocks_per_request == 4096
    assert plan.num_slots == 16
    assert plan.num_blocks == (budget - 16 * per_slot) // per_block == 46_908
    assert plan.total_bytes <= budget
    assert budget - plan.total_bytes < per_block
    # Blocks are capped at what num_slots max-length requests can use.
    capped = plan_memory(layout, budget, max_num_seqs=2, max_model_len=4096)
    assert (capped.num_slots, capped.num_blocks) == (2, 2 * 16)
    # ... unless prefix caching keeps finished requests' blocks: then the whole budget.
    cached = plan_memory(layout, budget, max_num_seqs=2, max_model_len=4096, prefix_caching=True)
    assert cached.num_blocks == (budget - 2 * per_slot) // per_block


def test_plan_memory_reduces_slots_then_fails_clearly() -> None:
    layout = CacheLayout.from_model_config(FLASH)
    per_block, per_slot = layout.bytes_per_block, layout.bytes_per_slot
    one = per_slot + 4 * per_block  # one request of 1024 tokens
    plan = plan_memory(layout, one + 2 * per_slot, max_num_seqs=8, max_model_len=1024)
    assert (plan.num_slots, plan.num_blocks) == (3, 4)
    exact = plan_memory(layout, one, max_num_seqs=8, max_model_len=1024)
    assert (exact.num_slots, exact.num_blocks) == (1, 4)
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len=1024"):
        plan_memory(layout, one - 1, max_num_seqs=8, max_model_len=1024)
