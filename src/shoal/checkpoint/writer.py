"""Synthetic checkpoints in the official layout: random weights, sharded safetensors, tokenizer.

Owns `generate_weights` (every inventory tensor, also used for `load_format="dummy"` directly on
the device), `write_checkpoint` (config.json, shards, model.safetensors.index.json,
tokenizer.json) and the `shoal make-checkpoint` entry `make_checkpoint_main`.

Invariant: a tensor depends only on (seed, its name) -- never on the device, the generation
order or the other tensors. Random numbers come from a counter-based hash (splitmix64 of the
element index, keyed by blake2b(seed, name)) evaluated with exact int64 ops, turned into
approximately normal values (sum of three 21-bit uniforms, |z| <= 3, std 1) with exact fp32
arithmetic; quantisation is exact (power-of-two scales, RNE casts). So CPU and CUDA produce
bit-identical tensors, and dummy loading equals the written checkpoint. A quantised weight and
its scale are generated together from the weight's name.

Scales (D = hidden, K = a linear's input width; z ~ the near-normal above), chosen so that every
linear roughly preserves the RMS of its input and activations stay O(1) through any depth:

| tensor | values |
|---|---|
| `embed`, `markov_head.embed` | z (rms 1) |
| dense FP8 / bf16 linears, `head`, `gate.weight`, experts (MXFP4) | z / sqrt(K) |
| norm weights, `engram.q_weight/k_weight` | 1 + 0.05 z |
| `hc_*_fn` | z / sqrt(hc * D), so the mixes m are O(1) |
| `hc_*_scale` | 0.1 + 0.01 z (coefficient logits m * scale are ~N(0, 0.1)) |
| `hc_*_base` | 0.1 z; +1 on the diagonal of the 4x4 comb block (near-identity mixing) |
| `attn_sink` | 0.5 z |
| `gate.bias`, `gate.bias_vl` | 0.01 z |
| Engram table rows | e4m3 codes of 64 z with UE8M0 exponents 2^-6 * {1/2, 1, 2}: rms ~1 |
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from shoal.model.config import ModelConfig
from shoal.model.weights import TensorSpec, checkpoint_inventory
from shoal.quant.fp4 import quant_mxfp4
from shoal.quant.fp8 import quant_fp8_weight

DEFAULT_SHARD_BYTES = 4 * 1024**3
_GAMMA = 0x9E3779B97F4A7C15 - 2**64  # splitmix64 constants as signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
_M21 = (1 << 21) - 1
_ENGRAM_CODE_STD = 64.0  # codes are 64 z; |code| <= 192 < 448 (no saturation)
_ENGRAM_SCALE_BYTE = 127 - 6  # 2^-6: rows have rms ~1


def tensor_key(seed: int, name: str) -> int:
    """The signed 64-bit key of one tensor's random stream."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    return value - 2**64 if value >= 2**63 else value


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def hash_bits(key: int, start: int, count: int, device: torch.device | str) -> torch.Tensor:
    """splitmix64 of element indices start..start+count-1 under `key`: int64 [count]."""
    z = torch.arange(start + 1, start + count + 1, dtype=torch.int64, device=device)
    z = z * _GAMMA + key
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def near_normal(key: int, start: int, count: int, device: torch.device | str) -> torch.Tensor:
    """fp32 [count], mean 0, std 1, |z| <= 3; exact and identical on every device."""
    z = hash_bits(key, start, count, device)
    total = (z & _M21) + (_srl(z, 21) & _M21) + (_srl(z, 42) & _M21)
    centred = (2 * total - 3 * _M21).to(torch.float32)  # exact: |value| < 2^23
    return centred * (1.0 / (1 << 21))  # power of two: exact


def _values(key: int, start: int, count: int, device: torch.device | str, std: float,
            mean: float = 0.0) -> torch.Tensor:
    v = near_normal(key, start, count, device)
    if std != 1.0:
        v = v * std
    if mean != 0.0:
        v = v + mean
    return v


def _chunk_rows(k: int, multiple: int, chunk_elems: int) -> int:
    rows = max(1, chunk_elems // max(k, 1))
    return max(multiple, rows // multiple * multiple)


def _plain(spec: TensorSpec, key: int, config: ModelConfig, device: torch.device | str,
           chunk_elems: int) -> torch.Tensor:
    """bf16 / fp32 tensors, by name (table in the module docstring)."""
    name, shape = spec.name, spec.shape
    n = spec.numel
    tail = name.rsplit(".", 1)[-1]
    hc, d = config.hc_mult, config.hidden_size
    if name.endswith("norm.weight") or tail in ("q_weight", "k_weight"):
        std, mean = 0.05, 1.0
    elif name in ("embed.weight",) or name.endswith("markov_head.embed.weight"):
        std, mean = 1.0, 0.0
    elif "_fn" in tail and tail.startswith("hc_"):
        std, mean = 1.0 / math.sqrt(hc * d), 0.0
    elif tail.startswith("hc_") and tail.endswith("_scale"):
        std, mean = 0.01, 0.1
    elif tail.startswith("hc_") and tail.endswith("_base"):
        base = _values(key, 0, n, device, 0.1)
        comb = base[2 * hc :].view(hc, hc)
        comb += torch.eye(hc, device=device)
        return base.to(spec.dtype)
    elif tail == "attn_sink":
        std, mean = 0.5, 0.0
    elif tail in ("bias", "bias_vl"):
        std, mean = 0.01, 0.0
    elif len(shape) == 2:
        std, mean = 1.0 / math.sqrt(shape[1]), 0.0
    else:
        raise AssertionError(f"no generation rule for tensor {name!r}")
    out = torch.empty(shape, dtype=spec.dtype, device=device)
    flat = out.view(-1)
    for start in range(0, n, chunk_elems):
        count = min(chunk_elems, n - start)
        flat[start : start + count] = _values(key, start, count, device, std, mean)
    return out


def _dense_fp8(spec: TensorSpec, key: int, device: torch.device | str,
               chunk_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = spec.shape
    b = spec.block[0] if spec.block else 32
    codes = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty((-(-n // b), -(-k // b)), dtype=torch.uint8, device=device)
    rows = _chunk_rows(k, b, chunk_elems)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        w = _values(key, r0 * k, (r1 - r0) * k, device, 1.0 / math.sqrt(k)).view(r1 - r0, k)
        c, s = quant_fp8_weight(w, b)
        codes[r0:r1] = c
        scales[r0 // b : -(-r1 // b)] = s
    return codes, scales


def _engram_table(spec: TensorSpec, key: int, scale_key: int, device: torch.device | str,
                  chunk_elems: int, work: torch.device | str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows generated as codes + scales directly (no fp32 copy of the table), chunk by
    chunk on `work` (default `device`) and copied to `device`."""
    rows, hd = spec.shape
    b = spec.block[1] if spec.block else 32
    work = device if work is None else work
    codes = torch.empty((rows, hd), dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty((rows, hd // b), dtype=torch.uint8, device=device)
    step = _chunk_rows(hd, 1, chunk_elems)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        v = _values(key, r0 * hd, (r1 - r0) * hd, work, _ENGRAM_CODE_STD)
        codes[r0:r1] = v.view(r1 - r0, hd).to(torch.float8_e4m3fn).to(device)
        jitter = (hash_bits(scale_key, r0 * (hd // b), (r1 - r0) * (hd // b), work)
                  & 0xFFFF) % 3 - 1
        scales[r0:r1] = (jitter + _ENGRAM_SCALE_BYTE).to(torch.uint8).view(
            r1 - r0, hd // b).to(device)
    return codes, scales


def _mxfp4(spec: TensorSpec, key: int, device: torch.device | str,
           chunk_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = spec.logical_shape
    b = spec.block[1] if spec.block else 32
    if b == 32 and torch.device(device).type == "cuda":  # one fused kernel, same bits
        from shoal.checkpoint.mxfp4_kernel import generate_mxfp4
        return generate_mxfp4(n, k, key, 1.0 / math.sqrt(k), (_GAMMA, _MIX1, _MIX2), device)
    packed = torch.empty((n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((n, k // b), dtype=torch.uint8, device=device)
    rows = _chunk_rows(k, 1, chunk_elems)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        w = _values(key, r0 * k, (r1 - r0) * k, device, 1.0 / math.sqrt(k)).view(r1 - r0, k)
        p, s = quant_mxfp4(w, b)
        packed[r0:r1] = p
        scales[r0:r1] = s
    return packed, scales


def to_disk_dtype(spec: TensorSpec, t: torch.Tensor) -> torch.Tensor:
    """In-memory -> official on-disk dtype: packed FP4 as int8 (I8), scales as F8_E8M0."""
    if spec.kind == "fp4_weight":
        return t.view(torch.int8)
    if spec.kind in ("fp8_scale", "fp4_scale"):
        return t.view(torch.float8_e8m0fnu)
    return t


def generate_weights(config: ModelConfig, seed: int = 0, device: torch.device | str = "cpu",
                     dtype_policy: Literal["memory", "disk"] = "memory",
                     names: Iterable[str] | None = None,
                     chunk_elems: int | None = None,
                     work_device: torch.device | str | None = None,
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every inventory tensor (or only `names`), in inventory order.

    Tensors are created on `device` and are bit-identical for every device. dtype_policy
    'memory' gives the reader's normalised dtypes (uint8 scales and packed FP4); 'disk' gives
    the official on-disk dtypes (float8_e8m0fnu scales, int8 packed FP4). `work_device`: where
    the Engram tables' values are computed before they are copied to `device` (a GPU makes a
    host-placed table far faster than the CPU; same bits).
    """
    inventory = checkpoint_inventory(config)
    wanted = None if names is None else set(names)
    if wanted is not None and (bad := sorted(wanted - inventory.keys())):
        raise ValueError(f"names: {bad[:5]} are not in the inventory of config {config.name!r}")
    if chunk_elems is None:
        chunk_elems = 1 << (26 if torch.device(work_device or device).type == "cuda" else 22)
    pending: dict[str, torch.Tensor] = {}
    for name, spec in inventory.items():
        if wanted is not None and name not in wanted:
            continue
        if name in pending:
            tensor = pending.pop(name)
        elif spec.kind in ("fp8_scale", "fp4_scale"):
            weight = inventory[name[: -len(".scale")] + ".weight"]
            tensor = _pair(config, seed, weight, device, chunk_elems, work_device)[1]
        elif spec.kind in ("fp8_weight", "fp4_weight"):
            tensor, scale = _pair(config, seed, spec, device, chunk_elems, work_device)
            if wanted is None or spec.scale_name in wanted:
                pending[spec.scale_name] = scale
        else:
            tensor = _plain(spec, tensor_key(seed, name), config, device, chunk_elems)
        if dtype_policy == "disk":
            tensor = to_disk_dtype(spec, tensor)
        yield name, tensor


def _pair(config: ModelConfig, seed: int, spec: TensorSpec, device: torch.device | str,
          chunk_elems: int, work_device: torch.device | str | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    key = tensor_key(seed, spec.name)
    if spec.kind == "fp4_weight":
        return _mxfp4(spec, key, device, chunk_elems)
    if spec.block is not None and spec.block[0] == 1:  # Engram table: per-row scales
        return _engram_table(spec, key, tensor_key(seed, spec.scale_name), device, chunk_elems,
                             work_device)
    return _dense_fp8(spec, key, device, chunk_elems)


def plan_shards(config: ModelConfig, shard_size_bytes: int) -> list[list[str]]:
    """Group inventory names into shards of about `shard_size_bytes`; a weight and its scale
    always share a shard."""
    inventory = checkpoint_inventory(config)
    units: list[list[TensorSpec]] = []
    for spec in inventory.values():
        if spec.kind in ("fp8_scale", "fp4_scale") and units and \
                units[-1][0].name == spec.name[: -len(".scale")] + ".weight":
            units[-1].append(spec)
        else:
            units.append([spec])
    shards: list[list[str]] = []
    size = 0
    for unit in units:
        nbytes = sum(s.nbytes for s in unit)
        if not shards or (size and size + nbytes > shard_size_bytes):
            shards.append([])
            size = 0
        shards[-1] += [s.name for s in unit]
        size += nbytes
    return shards


def write_checkpoint(config: ModelConfig, out_dir: str | Path, seed: int = 0,
                     shard_size_bytes: int = DEFAULT_SHARD_BYTES,
                     write_tokenizer: bool = True) -> Path:
    """Write config.json, model-XXXXX-of-YYYYY.safetensors shards, the index and tokenizer.json.

    Returns the directory. Tensors are written in the official on-disk dtypes.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    inventory = checkpoint_inventory(config)
    shards = plan_shards(config, shard_size_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, tensor in generate_weights(config, seed, "cpu", "disk", names=shard):
            tensors[name] = tensor.contiguous()
            weight_map[name] = fname
            total += inventory[name].nbytes
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)  # (safetensors writes 0600; the other files are 0644)
    index = {"metadata": {"total_size": total, "seed": seed}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if write_tokenizer:
        from shoal.tokenizer.synthetic import BOS, EOS, PAD, build_synthetic_tokenizer

        build_synthetic_tokenizer(config).save(str(out / "tokenizer.json"))
        tok_cfg = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                   "add_bos_token": True, "add_eos_token": False,
                   "model_max_length": config.max_position_embeddings,
                   "tokenizer_class": "PreTrainedTokenizerFast"}
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


def make_checkpoint_main(argv: list[str] | None = None) -> int:
    """`shoal make-checkpoint --preset tiny --out DIR [--seed N] [--shard-size-mb M]`."""
    from shoal.model.presets import PRESETS, get_preset

    parser = argparse.ArgumentParser(prog="shoal make-checkpoint",
                                     description="Write a synthetic checkpoint in the official "
                                                 "DeepSeek-V4.1 layout (random weights).")
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size-mb", type=int, default=DEFAULT_SHARD_BYTES // 2**20)
    args = parser.parse_args(argv)
    config = get_preset(args.preset)
    out = write_checkpoint(config, args.out, seed=args.seed,
                           shard_size_bytes=args.shard_size_mb * 2**20)
    print(f"wrote {config.name} checkpoint (seed {args.seed}) to {out}")
    return 0
