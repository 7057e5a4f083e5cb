"""The loader takes every checkpoint the official reference takes: no vision tower (no
`ffn.gate.bias_vl`), `candidate_source_layer: -1` in the flat config, no Engram layers, no DSpark
layers; and still rejects a missing tensor by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from shoal import LLM, SamplingParams
from shoal.checkpoint import CheckpointError, CheckpointReader, write_checkpoint
from shoal.model.config_formats import from_flat
from shoal.model.presets import TINY

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 61))]


def _drop(ckpt: Path, predicate) -> list[str]:
    """Remove the tensors whose name matches from every shard and the index."""
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = [n for n in index["weight_map"] if predicate(n)]
    for shard in sorted({index["weight_map"][n] for n in dropped}):
        tensors = load_file(ckpt / shard)
        save_file({k: v for k, v in tensors.items() if not predicate(k)}, ckpt / shard)
    for name in dropped:
        del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    return dropped


def _tokens(path: Path) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", max_model_len=128)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_checkpoint_without_the_vision_router_bias(tmp_path: Path) -> None:
    full = write_checkpoint(TINY, tmp_path / "full", seed=3, shard_size_bytes=1 << 20)
    text = write_checkpoint(TINY, tmp_path / "text", seed=3, shard_size_bytes=1 << 20)
    dropped = _drop(text, lambda n: n.endswith(".ffn.gate.bias_vl"))
    assert len(dropped) == TINY.num_total_layers
    assert CheckpointReader(text).check().ok
    assert _tokens(text) == _tokens(full)  # the text engine never reads it
    gone = _drop(text, lambda n: n == "layers.1.ffn.gate.bias")  # a tensor it does read
    with pytest.raises(CheckpointError, match="1 missing"):
        CheckpointReader(text).check()
    assert gone == ["layers.1.ffn.gate.bias"]


def test_no_candidate_source_is_minus_one_in_the_flat_config() -> None:
    assert from_flat({"candidate_source_layer": -1})["candidate_source_layer"] is None
    assert from_flat({"candidate_source_layer": 20})["candidate_source_layer"] == 20


@pytest.mark.parametrize("variant", ["no_engram", "no_dspark"])
def test_checkpoints_without_engram_or_dspark_layers(tmp_path: Path, variant: str) -> None:
    if variant == "no_engram":
        config = TINY.replace(engram_layer_ids=(), engram_num_embeddings=())
    else:
        config = TINY.replace(num_draft_layers=0, compress_ratios=TINY.compress_ratios[:12])
    path = write_checkpoint(config, tmp_path / variant, seed=5)
    assert CheckpointReader(path).check().ok
    outs = _tokens(path)
    assert [len(t) for t in outs] == [6, 6]
