"""Damaged or ambiguous checkpoints fail with one line naming the culprit before any tensor is
used: shard paths outside the checkpoint or of the wrong type, config values of the wrong type
or range, a preset name that is also a folder, another model's tokenizer; a shard in a
sub-folder reads its own bytes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from shoal.checkpoint import CheckpointError, CheckpointReader, write_checkpoint
from shoal.checkpoint.reader import INDEX_FILE
from shoal.config import ShoalError, resolve_model_config
from shoal.model.config import ConfigError, ModelConfig
from shoal.model.presets import TINY


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(TINY, tmp_path_factory.mktemp("tiny"), seed=3,
                            shard_size_bytes=1 << 20)


def _index(path: Path) -> dict:
    return json.loads((path / INDEX_FILE).read_text())


def _write_index(path: Path, index: dict) -> None:
    (path / INDEX_FILE).write_text(json.dumps(index))


def test_a_shard_in_a_sub_folder_reads_its_own_bytes(ckpt: Path, tmp_path: Path) -> None:
    """The header and the data come from the same file (a stale copy of the same name at the
    top must not be read)."""
    copy = Path(shutil.copytree(ckpt, tmp_path / "c"))
    index = _index(copy)
    moved = sorted(set(index["weight_map"].values()))[0]
    other = sorted(set(index["weight_map"].values()))[1]
    (copy / "sub").mkdir()
    shutil.move(copy / moved, copy / "sub" / moved)
    shutil.copy(copy / other, copy / moved)  # a stale file under the moved shard's name
    index["weight_map"] = {n: f"sub/{f}" if f == moved else f
                           for n, f in index["weight_map"].items()}
    _write_index(copy, index)
    name = next(n for n, f in index["weight_map"].items() if f == f"sub/{moved}")
    with CheckpointReader(ckpt) as want, CheckpointReader(copy) as got:
        assert torch.equal(got.get(name), want.get(name))


@pytest.mark.parametrize("where", ["../model.safetensors", "/etc/passwd", 1, None, ["x"], ""])
def test_shard_names_outside_the_checkpoint_or_not_names(ckpt: Path, tmp_path: Path,
                                                        where) -> None:
    copy = Path(shutil.copytree(ckpt, tmp_path / "c"))
    index = _index(copy)
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = where
    _write_index(copy, index)
    with pytest.raises(CheckpointError, match=f"{name!r} maps to"):
        CheckpointReader(copy)


@pytest.mark.parametrize("field, value, message", [
    ("rope_theta", "10000", "a finite number"), ("swiglu_limit", None, "a finite number"),
    ("num_draft_layers", "2", "an integer"), ("hc_eps", math.nan, "a finite number"),
    ("gate_temp", 0.0, "a positive number"), ("routed_scaling_factor", -1.5, "a positive number"),
    ("compress_ratios", [0, 0, 2.7] + [1] * 11, "a list of integers"),
    ("candidate_source_layer", "6", "an integer or null"), ("expert_dtype", 4, "a string"),
    ("weight_block_size", 0, "a positive integer"),
])
def test_config_values_of_the_wrong_type_or_range(field: str, value, message: str) -> None:
    import dataclasses

    with pytest.raises(ConfigError, match=f"{field}: got .*expected {message}"):
        dataclasses.replace(TINY, **{field: value})


@pytest.mark.parametrize("key, value, field", [
    ("rope_scaling", "yarn", "rope_scaling"), ("quantization_config", [], "quantization_config"),
])
def test_config_objects_of_the_wrong_shape(key: str, value, field: str) -> None:
    raw = TINY.to_hf_dict()
    (raw["text_config"] if key == "rope_scaling" and "text_config" in raw else raw)[key] = value
    with pytest.raises(ConfigError, match=f"{field}: got"):
        ModelConfig.from_dict(raw)


def test_a_preset_name_that_is_also_a_folder_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    with pytest.raises(ShoalError, match="both a preset and a folder"):
        resolve_model_config("tiny")


def test_a_tensor_stored_twice_and_a_file_as_the_model(ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(ckpt, tmp_path / "c"))
    shards = sorted(set(_index(copy)["weight_map"].values()))
    first, second = (load_file(copy / f) for f in shards[:2])
    name = next(iter(first))
    save_file({**second, name: torch.zeros_like(first[name])}, str(copy / shards[1]))
    with pytest.raises(CheckpointError, match=f"{name!r} is stored in both"):
        CheckpointReader(copy)
    with pytest.raises(ShoalError, match="is a file"):
        resolve_model_config(str(ckpt / "config.json"))
    assert (ckpt / shards[0]).stat().st_mode & 0o777 == 0o644


def test_a_tokenizer_of_another_model_is_refused(ckpt: Path, tmp_path: Path) -> None:
    """A tokenizer.json whose size fits but whose BOS / EOS ids are not config.json's."""
    from shoal.config import EngineConfig
    from shoal.tokenizer.tokenizer import load_tokenizer

    copy = Path(shutil.copytree(ckpt, tmp_path / "c"))
    assert load_tokenizer(EngineConfig.create(str(copy), device="cpu")).eos_token_id == 1
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
    with pytest.raises(ShoalError, match=r"tokenizer.json does not match config.json: EOS "
                                         r"\S+ is id 1 in the tokenizer, 2 in the config"):
        load_tokenizer(EngineConfig.create(str(copy), device="cpu"))
