"""Checkpoint tensor inventory: every official tensor name, dtype and shape, derived from a config.

Owns (model.md §6, §5): the official names (`layers.L.*`, `mtp.i.*`, `embed`, `head`, `norm`),
their in-memory dtypes and shapes for any valid `ModelConfig`, and `classify`, which maps any name
found in a checkpoint to its spec, to "ignored" (the vision tower) or to "unknown".

Invariant: the inventory is generated from each layer's `LayerSpec` (role, Engram, draft), never
from Flash's layer ids; for the flash preset it has exactly 93,415 backbone + 2,401 mtp + 3
global tensors. In-memory dtypes are the reader's normalised ones: e4m3 codes are
`torch.float8_e4m3fn`, UE8M0 scales and packed FP4 bytes are `torch.uint8` (on disk F8_E8M0 and
I8, see `DISK_DTYPES`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from shoal.model.config import LayerRole, LayerSpec, ModelConfig

Kind = Literal["bf16", "fp32", "fp8_weight", "fp8_scale", "fp4_weight", "fp4_scale"]

# Kind -> accepted on-disk safetensors dtype strings (the first is what the writer writes).
DISK_DTYPES: dict[str, tuple[str, ...]] = {
    "bf16": ("BF16",),
    "fp32": ("F32",),
    "fp8_weight": ("F8_E4M3",),
    "fp8_scale": ("F8_E8M0", "U8"),
    "fp4_weight": ("I8", "U8"),
    "fp4_scale": ("F8_E8M0", "U8"),
}

_MEMORY_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "fp32": torch.float32, "fp8_weight": torch.float8_e4m3fn,
    "fp8_scale": torch.uint8, "fp4_weight": torch.uint8, "fp4_scale": torch.uint8,
}

# Names of the vision tower: present in the release, ignored by the text engine.
VISION_PREFIXES = ("vision.", "aligner.")
VISION_NAMES = ("image_start", "image_end", "image_newline")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor. `shape` is the stored shape (FP4: [N, K/2] bytes).

    `block` is the quantisation block of a weight/scale pair: (32, 32) for dense FP8 weights,
    (1, 32) for FP8 Engram table rows and MXFP4 experts; None for unquantised tensors.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: Kind
    block: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def disk_dtype(self) -> str:
        """The safetensors dtype string the writer uses (the official one)."""
        return DISK_DTYPES[self.kind][0]

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """[N, K] of the represented matrix (FP4 weights store two values per byte)."""
        if self.kind == "fp4_weight":
            return (*self.shape[:-1], self.shape[-1] * 2)
        return self.shape

    @property
    def is_weight_of_pair(self) -> bool:
        return self.kind in ("fp8_weight", "fp4_weight")

    @property
    def scale_name(self) -> str:
        """Name of the scale that belongs to this quantised weight."""
        assert self.is_weight_of_pair and self.name.endswith(".weight"), self.name
        return self.name[: -len(".weight")] + ".scale"


def _spec(name: str, shape: tuple[int, ...], kind: Kind,
          block: tuple[int, int] | None = None) -> TensorSpec:
    return TensorSpec(name, tuple(int(s) for s in shape), _MEMORY_DTYPES[kind], kind, block)


def _fp8(prefix: str, n: int, k: int, b: int) -> Iterator[TensorSpec]:
    """Dense FP8 linear [n, k] with UE8M0 scales per b x b block."""
    yield _spec(prefix + ".weight", (n, k), "fp8_weight", (b, b))
    yield _spec(prefix + ".scale", (-(-n // b), -(-k // b)), "fp8_scale", (b, b))


def _fp4(prefix: str, n: int, k: int, b: int) -> Iterator[TensorSpec]:
    """MXFP4 linear [n, k]: packed bytes [n, k/2], one UE8M0 scale per b along K."""
    if k % b:
        raise ValueError(f"{prefix}: K={k} is not a multiple of the FP4 block {b}")
    yield _spec(prefix + ".weight", (n, k // 2), "fp4_weight", (1, b))
    yield _spec(prefix + ".scale", (n, k // b), "fp4_scale", (1, b))


def _layer_tensors(c: ModelConfig, spec: LayerSpec, prefix: str) -> Iterator[TensorSpec]:
    """The tensors of one block (backbone `layers.L.` or draft `mtp.i.`)."""
    d, b = c.hidden_size, c.weight_block_size
    hc = c.hc_mult
    mix = (2 + hc) * hc
    yield _spec(prefix + "attn_norm.weight", (d,), "bf16")
    yield _spec(prefix + "ffn_norm.weight", (d,), "bf16")
    for sub in ("attn", "ffn"):
        yield _spec(f"{prefix}hc_{sub}_fn", (mix, hc * d), "fp32")
        yield _spec(f"{prefix}hc_{sub}_base", (mix,), "fp32")
        yield _spec(f"{prefix}hc_{sub}_scale", (3,), "fp32")
    a = prefix + "attn."
    heads_dim = c.num_heads * c.head_dim
    yield _spec(a + "attn_sink", (c.num_heads,), "fp32")
    yield from _fp8(a + "wq_a", c.q_lora_rank, d, b)
    yield _spec(a + "q_norm.weight", (c.q_lora_rank,), "bf16")
    yield from _fp8(a + "wq_b", heads_dim, c.q_lora_rank, b)
    yield from _fp8(a + "wkv", c.head_dim, d, b)
    yield _spec(a + "kv_norm.weight", (c.head_dim,), "bf16")
    yield from _fp8(a + "wo_a", c.o_groups * c.o_lora_rank, heads_dim // c.o_groups, b)
    yield from _fp8(a + "wo_b", d, c.o_groups * c.o_lora_rank, b)
    if not spec.is_draft:
        if spec.role is LayerRole.FULL:
            yield _spec(a + "compressor.wkv.weight", (c.head_dim, d), "bf16")
            if spec.compress_ratio >= 2:
                yield _spec(a + "compressor.wgate.weight", (c.head_dim, d), "bf16")
            yield _spec(a + "compressor.norm.weight", (c.head_dim,), "bf16")
            yield _spec(a + "indexer.wk.weight", (c.index_head_dim, c.head_dim), "bf16")
            yield _spec(a + "indexer.k_norm.weight", (c.index_head_dim,), "bf16")
        if spec.owns_index_query:
            yield from _fp8(a + "indexer.wq_b", c.index_n_heads * c.index_head_dim,
                            c.q_lora_rank, b)
            yield _spec(a + "indexer.weights_proj.weight", (c.index_n_heads, d), "bf16")
    n_exp = c.dspark_n_routed_experts if spec.is_draft else c.n_routed_experts
    f = prefix + "ffn."
    inter = c.moe_intermediate_size
    yield _spec(f + "gate.weight", (n_exp, d), "bf16")
    yield _spec(f + "gate.bias", (n_exp,), "fp32")
    yield _spec(f + "gate.bias_vl", (n_exp,), "fp32")
    if c.n_shared_experts > 1:
        raise ValueError(f"n_shared_experts: got {c.n_shared_experts}, expected 0 or 1 "
                         "(the reference has exactly one shared expert)")
    if c.n_shared_experts == 1:
        yield from _fp8(f + "shared_experts.w1", inter, d, b)
        yield from _fp8(f + "shared_experts.w2", d, inter, b)
        yield from _fp8(f + "shared_experts.w3", inter, d, b)
    for e in range(n_exp):
        yield from _fp4(f"{f}experts.{e}.w1", inter, d, c.act_block_size)
        yield from _fp4(f"{f}experts.{e}.w2", d, inter, c.act_block_size)
        yield from _fp4(f"{f}experts.{e}.w3", inter, d, c.act_block_size)
    if spec.has_engram:
        g = prefix + "engram."
        idx = c.engram_layer_ids.index(spec.layer_id)
        rows = c.engram_num_embeddings[idx]
        hd = c.engram_head_dim
        yield _spec(g + "embed.weight", (rows, hd), "fp8_weight", (1, b))
        yield _spec(g + "embed.scale", (rows, hd // b), "fp8_scale", (1, b))
        yield from _fp8(g + "wkv", d * (hc + 1), c.engram_heads_total * hd, b)
        yield _spec(g + "q_weight", (hc, d), "bf16")
        yield _spec(g + "k_weight", (hc, d), "bf16")


def iter_inventory(config: ModelConfig) -> Iterator[TensorSpec]:
    """Every tensor in a fixed order: embed, backbone layers, norm, head, draft stages."""
    c = config
    d = c.hidden_size
    yield _spec("embed.weight", (c.vocab_size, d), "bf16")
    for spec in c.backbone:
        yield from _layer_tensors(c, spec, f"layers.{spec.layer_id}.")
    yield _spec("norm.weight", (d,), "bf16")
    yield _spec("head.weight", (c.vocab_size, d), "bf16")
    n_draft = c.num_draft_layers
    for i, spec in enumerate(c.draft_layers):
        p = f"mtp.{i}."
        yield from _layer_tensors(c, spec, p)
        if i == 0:
            yield from _fp8(p + "main_proj", d, c.dspark_capture_dim, c.weight_block_size)
            yield _spec(p + "main_norm.weight", (d,), "bf16")
        if i == n_draft - 1:
            rank = c.dspark_markov_rank
            yield _spec(p + "norm.weight", (d,), "bf16")
            yield _spec(p + "markov_head.embed.weight", (c.vocab_size, rank), "bf16")
            yield _spec(p + "markov_head.head.weight", (c.vocab_size, rank), "bf16")
            yield _spec(p + "confidence_head.proj.weight", (1, d + rank), "bf16")


def is_engram_table(name: str) -> bool:
    """An Engram layer's hashed embedding table (or its scales): the bulk of the model's
    non-expert bytes, placeable in host memory."""
    return ".engram.embed." in name


def checkpoint_inventory(config: ModelConfig) -> dict[str, TensorSpec]:
    """name -> TensorSpec for every text-model tensor of `config` (insertion order = file order)."""
    return {s.name: s for s in iter_inventory(config)}


def inventory_counts(inventory: Mapping[str, TensorSpec]) -> dict[str, int]:
    """Counts by group: 'backbone' (layers.*), 'mtp' (mtp.*), 'global' (the rest)."""
    counts = {"backbone": 0, "mtp": 0, "global": 0}
    for name in inventory:
        if name.startswith("layers."):
            counts["backbone"] += 1
        elif name.startswith("mtp."):
            counts["mtp"] += 1
        else:
            counts["global"] += 1
    return counts


# Tensors the text engine never reads that a valid checkpoint may omit (a release without the
# vision tower has no vision-language router bias).
OPTIONAL_SUFFIXES = (".ffn.gate.bias_vl",)


def is_optional(name: str) -> bool:
    return name.endswith(OPTIONAL_SUFFIXES)


def is_vision_name(name: str) -> bool:
    """True for the vision tower's tensors (ignored by the text engine, never 'unknown')."""
    return name.startswith(VISION_PREFIXES) or any(
        name == v or name.startswith(v + ".") for v in VISION_NAMES)


@dataclass(frozen=True)
class NameClass:
    """What a checkpoint name is: 'known' (with its spec), 'ignored' (vision) or 'unknown'."""

    name: str
    status: Literal["known", "ignored", "unknown"]
    spec: TensorSpec | None = None


def classify(name: str, inventory: Mapping[str, TensorSpec] | ModelConfig) -> NameClass:
    """Map a name found in a checkpoint to its spec, to 'ignored' (vision) or to 'unknown'.

    Pass the inventory (preferred when classifying many names) or the config.
    """
    if isinstance(inventory, ModelConfig):
        inventory = checkpoint_inventory(inventory)
    spec = inventory.get(name)
    if spec is not None:
        return NameClass(name, "known", spec)
    if is_vision_name(name):
        return NameClass(name, "ignored")
    return NameClass(name, "unknown")
