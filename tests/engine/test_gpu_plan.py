"""`shoal info --gpus N`: the per-GPU plan from the checkpoint inventory (derived bytes)."""

from __future__ import annotations

import pytest

from shoal.cli import main
from shoal.model.presets import PRESETS
from shoal.parallel.gpu_plan import plan_gpus


def test_experts_split_and_engram_placement() -> None:
    one = plan_gpus(PRESETS["flash"], 1, 141, max_num_seqs=64, max_model_len=65536)
    eight = plan_gpus(PRESETS["flash"], 8, 141, max_num_seqs=64, max_model_len=65536)
    assert eight.experts_gb == pytest.approx(one.experts_gb / 8)
    assert eight.dense_gb == one.dense_gb and eight.engram_gb == one.engram_gb
    assert one.experts_gb > 250 and one.engram_gb > 150  # the released model's sizes
    assert not one.fits and not one.kv_blocks  # the experts alone exceed one GPU
    assert not eight.engram_on_gpu and eight.kv_blocks > 0
    assert eight.fits and not eight.host_checked  # on the GPUs; the host was not given
    node = plan_gpus(PRESETS["flash"], 8, 141, max_num_seqs=64, max_model_len=65536,
                     host_memory_gb=560)
    assert node.fits and node.host_checked  # one copy of 203 GB per node
    small = plan_gpus(PRESETS["flash"], 8, 141, max_num_seqs=64, max_model_len=65536,
                      host_memory_gb=128)
    assert not small.fits and "pinned host memory" in small.reason
    mini = plan_gpus(PRESETS["mini"], 1, 141, max_num_seqs=64, max_model_len=65536)
    assert mini.fits and mini.engram_on_gpu and mini.kv_blocks > 0
    odd = plan_gpus(PRESETS["mini"], 3, 141, max_num_seqs=64, max_model_len=65536)
    assert not odd.fits and "do not split" in odd.reason


def test_info_prints_the_plan(capsys) -> None:
    assert main(["info", "--model", "flash", "--gpus", "8", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "plan for 8 GPU(s) of 80 GB" in out and "routed experts 37.0 GB" in out



def test_prefix_caching_plans_the_whole_pool(capsys) -> None:
    """With prefix caching the pool takes every block the budget holds (less the snapshots),
    as the engine sizes it; without, only what `max_num_seqs` max-length requests use."""
    plain = plan_gpus(PRESETS["mini"], 1, 141, max_num_seqs=1, max_model_len=4096)
    cached = plan_gpus(PRESETS["mini"], 1, 141, max_num_seqs=1, max_model_len=4096,
                       prefix_caching=True, num_snapshots=64)
    assert plain.kv_blocks == 4096 // 256 and cached.kv_blocks > 100 * plain.kv_blocks
    assert main(["info", "--model", "mini", "--max-num-seqs", "1", "--max-model-len", "4096",
                 "--kv-cache-memory-gb", "2"]) == 0
    assert "16 blocks of 256 tokens" in capsys.readouterr().out
    assert main(["info", "--model", "mini", "--max-num-seqs", "1", "--max-model-len", "4096",
                 "--kv-cache-memory-gb", "2", "--enable-prefix-caching"]) == 0
    out = capsys.readouterr().out
    assert "64 ring snapshots" in out and "16 blocks of" not in out


def test_gpu_memory_utilization_flag(capsys) -> None:
    """vLLM's --gpu-memory-utilization reaches the engine config (checked before loading)."""
    assert main(["generate", "--model", "tiny", "--device", "cpu",
                 "--gpu-memory-utilization", "1.5", "--prompt", "x"]) == 2
    assert "gpu_memory_utilization: got 1.5" in capsys.readouterr().err
