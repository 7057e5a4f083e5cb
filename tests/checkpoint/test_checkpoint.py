"""Synthetic checkpoint: write -> read identity, device-independent generation, weight scales,
and errors on corrupt inputs that name the culprit (tensor and file)."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shoal.checkpoint import CheckpointError, CheckpointReader, generate_weights, write_checkpoint
from shoal.checkpoint.writer import make_checkpoint_main, near_normal
from shoal.model.config import ConfigError
from shoal.model.presets import TINY
from shoal.model.weights import checkpoint_inventory
from shoal.quant.fp4 import dequant_mxfp4
from shoal.quant.fp8 import dequant_fp8_weight

SEED = 7


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return dict(generate_weights(TINY, SEED))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, weights) -> Path:
    return write_checkpoint(TINY, tmp_path_factory.mktemp("tiny"), seed=SEED,
                            shard_size_bytes=1 << 20)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_write_read_identity(ckpt: Path, weights) -> None:
    inventory = checkpoint_inventory(TINY)
    with CheckpointReader(ckpt) as reader:
        assert reader.config == TINY
        assert reader.names() == list(inventory)
        assert len({reader.info(n).file for n in reader.names()}) > 1  # really sharded
        report = reader.check()
        assert report.ok and report.checked == len(inventory)
        for name, spec in inventory.items():
            t = reader.get(name)
            assert t.dtype == spec.dtype and tuple(t.shape) == spec.shape, name
            assert torch.equal(_bits(t), _bits(weights[name])), name
            assert reader.info(name).dtype == spec.disk_dtype  # official on-disk dtype
    disk = {reader.info(n).dtype for n in inventory}
    assert disk == {"BF16", "F32", "F8_E4M3", "F8_E8M0", "I8"}


def test_single_file_checkpoint(tmp_path: Path, weights) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    disk = dict(generate_weights(TINY, SEED, dtype_policy="disk"))
    save_file(disk, str(tmp_path / "model.safetensors"))
    with CheckpointReader(tmp_path) as reader:
        reader.check(TINY)
        name = "layers.0.ffn.experts.1.w2.weight"
        assert reader.get(name).dtype == torch.uint8
        assert torch.equal(reader.get(name), weights[name])


def test_generation_is_per_name(weights) -> None:
    names = ["layers.3.attn.wq_b.scale", "mtp.1.markov_head.head.weight",
             "layers.4.engram.embed.weight"]
    subset = dict(generate_weights(TINY, SEED, names=names))
    assert set(subset) == set(names)  # yielded in inventory order
    for n in names:
        assert torch.equal(_bits(subset[n]), _bits(weights[n]))
    small_chunks = dict(generate_weights(TINY, SEED, names=names, chunk_elems=1000))
    for n in names:
        assert torch.equal(_bits(small_chunks[n]), _bits(weights[n]))
    other = dict(generate_weights(TINY, SEED + 1, names=names[1:2]))
    assert not torch.equal(other[names[1]], weights[names[1]])
    with pytest.raises(ValueError, match="names"):
        list(generate_weights(TINY, SEED, names=["layers.0.nope"]))


def test_near_normal_statistics() -> None:
    z = near_normal(12345, 0, 200_000, "cpu")
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1) < 0.01
    assert z.abs().max().item() <= 3.0
    assert torch.equal(near_normal(12345, 1000, 10, "cpu"), z[1000:1010])


def test_weight_scales(weights) -> None:
    """Dequantised linears have rms ~ 1/sqrt(K); norms ~1; Engram rows rms ~1."""
    for name in ("layers.2.attn.wq_b", "layers.4.engram.wkv", "mtp.0.main_proj",
                 "layers.7.ffn.shared_experts.w2"):
        w = dequant_fp8_weight(weights[name + ".weight"], weights[name + ".scale"], 32)
        assert abs(w.pow(2).mean().sqrt().item() * math.sqrt(w.shape[1]) - 1) < 0.1, name
    for name in ("layers.0.ffn.experts.3.w1", "mtp.1.ffn.experts.0.w2"):
        w = dequant_mxfp4(weights[name + ".weight"], weights[name + ".scale"], 32)
        assert abs(w.pow(2).mean().sqrt().item() * math.sqrt(w.shape[1]) - 1) < 0.15, name
    table = weights["layers.1.engram.embed.weight"].float().view(384, 1, 32)
    scale = torch.exp2(weights["layers.1.engram.embed.scale"].float() - 127).unsqueeze(-1)
    rms = (table * scale).pow(2).mean().sqrt().item()
    assert 0.8 < rms < 2.0
    assert set(weights["layers.1.engram.embed.scale"].unique().tolist()) == {120, 121, 122}
    for name in ("norm.weight", "layers.3.attn.kv_norm.weight", "layers.1.engram.q_weight"):
        assert abs(weights[name].float().mean().item() - 1) < 0.05, name
    assert torch.isfinite(weights["embed.weight"].float()).all()


def test_hc_coefficients_reasonable(weights) -> None:
    """mHC coefficients (model.md §2.2, recomputed here in fp32) from the generated parameters
    on a random stream: pre ~0.5, post ~1, comb nearly doubly stochastic and identity-leaning."""
    hc, d = TINY.hc_mult, TINY.hidden_size
    fn, base = weights["layers.5.hc_attn_fn"], weights["layers.5.hc_attn_base"]
    scale = weights["layers.5.hc_attn_scale"]
    x = torch.randn(16, hc * d, generator=torch.Generator().manual_seed(0)) * 3
    m = (x @ fn.T) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-20)
    assert 0.5 < m.std().item() < 2
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + 1e-6
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = torch.softmax(m[:, 2 * hc :].view(-1, hc, hc) * scale[2]
                         + base[2 * hc :].view(hc, hc), -1)
    assert ((pre > 0.35) & (pre < 0.65)).all() and ((post > 0.7) & (post < 1.3)).all()
    diag = comb.diagonal(dim1=-2, dim2=-1)
    assert (diag > comb.sum(-1) / hc).all()


def test_make_checkpoint_cli(tmp_path: Path, weights) -> None:
    assert make_checkpoint_main(["--preset", "tiny", "--out", str(tmp_path / "c"),
                                 "--seed", str(SEED)]) == 0
    with CheckpointReader(tmp_path / "c") as reader:
        assert reader.check().ok
        assert torch.equal(reader.get("head.weight"), weights["head.weight"])
    assert (tmp_path / "c" / "tokenizer.json").is_file()


# ---- corrupt inputs -----------------------------------------------------------------------


def _shard_of(ckpt: Path, name: str) -> str:
    return json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]


def _rewrite_shard(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_truncated_shard(tmp_path: Path, ckpt: Path) -> None:
    bad = _copy(ckpt, tmp_path / "c")
    fname = _shard_of(bad, "layers.5.attn.wkv.weight")
    data = (bad / fname).read_bytes()
    (bad / fname).write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=f"{fname}: truncated"):
        CheckpointReader(bad)
    (bad / fname).write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=fname):
        CheckpointReader(bad)
    (bad / fname).write_bytes(struct.pack("<Q", 40) + b"{" * 40 + data[48:])
    with pytest.raises(CheckpointError, match=f"{fname}: corrupt header"):
        CheckpointReader(bad)


def test_wrong_dtype_shape_missing_unknown(tmp_path: Path, ckpt: Path) -> None:
    bad = _copy(ckpt, tmp_path / "c")
    norm, sink = "layers.3.attn.q_norm.weight", "layers.3.attn.attn_sink"
    gone, f_norm = "layers.2.attn.indexer.wk.weight", _shard_of(bad, norm)

    def edit(t: dict) -> None:
        t[norm] = t[norm].float()
        if sink in t:
            t[sink] = torch.zeros(5)
        t["layers.3.attn.extra.weight"] = torch.zeros(2)
        t["vision.blocks.0.w"] = torch.zeros(2)

    _rewrite_shard(bad / f_norm, edit)
    f_gone = _shard_of(bad, gone)
    _rewrite_shard(bad / f_gone, lambda t: t.pop(gone))
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    del index["weight_map"][gone]
    index["weight_map"]["layers.3.attn.extra.weight"] = f_norm
    index["weight_map"]["vision.blocks.0.w"] = f_norm
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    reader = CheckpointReader(bad)
    with pytest.raises(CheckpointError) as err:
        reader.check()
    msg = str(err.value)
    assert f"{norm} | {f_norm} | dtype F32, expected BF16" in msg
    assert gone in msg and "1 missing" in msg
    assert f"layers.3.attn.extra.weight | {f_norm}" in msg
    assert "vision.blocks.0.w" not in msg
    report = reader.check(raise_on_error=False)
    assert report.ignored == ["vision.blocks.0.w"] and report.missing == [gone]
    if _shard_of(bad, sink) == f_norm:
        assert report.shape_mismatch[0][:2] == (sink, f_norm)


def test_index_and_config_errors(tmp_path: Path, ckpt: Path) -> None:
    bad = _copy(ckpt, tmp_path / "c")
    fname = _shard_of(bad, "embed.weight")
    (bad / fname).unlink()
    with pytest.raises(CheckpointError, match=f"{fname}: listed in"):
        CheckpointReader(bad)
    bad2 = _copy(ckpt, tmp_path / "d")
    index = json.loads((bad2 / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.0.ghost"] = fname
    (bad2 / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="layers.0.ghost"):
        CheckpointReader(bad2)
    bad3 = _copy(ckpt, tmp_path / "e")
    cfg = json.loads((bad3 / "config.json").read_text())
    cfg["text_config"]["compress_ratios"] = [0, 0, 2]
    (bad3 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="compress_ratios"):
        CheckpointReader(bad3)
    with pytest.raises(CheckpointError, match="neither"):
        CheckpointReader(tmp_path, load_config=False)
    with CheckpointReader(ckpt) as reader, pytest.raises(CheckpointError, match="nope"):
        reader.get("nope")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dummy_on_cuda_equals_cpu(weights) -> None:
    for name, t in generate_weights(TINY, SEED, device="cuda"):
        assert t.is_cuda and torch.equal(_bits(t.cpu()), _bits(weights[name])), name
