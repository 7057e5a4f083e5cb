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

