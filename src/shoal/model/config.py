"""Model configuration: one frozen `ModelConfig` and one `LayerSpec` per layer.

Owns: the config's fields, its validation (errors name the field, the value and what was
expected), and the layers it derives (`kv_sharing.derive_layers`: every layer's CSA2 role from
the **raw** ratio list and the source lists, model.md §1.2). Invariant: the engine is driven
only by this config; nothing downstream hard-codes Flash's layer ids. The on-disk forms (HF
nested, reference flat) are parsed in config_formats.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from shoal.model.config_formats import ConfigError, from_flat, from_hf, to_hf_dict
from shoal.model.kv_sharing import LayerRole, LayerSpec, derive_layers

__all__ = ["ConfigError", "LayerRole", "LayerSpec", "ModelConfig", "engram_primes"]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    r = math.isqrt(n)
    f = 3
    while f <= r:
        if n % f == 0:
            return False
        f += 2
    return True


def engram_primes(
    num_layers: int, max_ngram: int, n_heads: int, vocab_size: int
) -> list[list[list[int]]]:
    """Primes [layer][order-2][head] (model.md §2.10).

    For each Engram layer, then each order n = 2..max_ngram, the search restarts at
    `vocab_size - 1`; each head takes the next prime above the current value not used before
    (by any layer or order).
    """
    used: set[int] = set()
    result: list[list[list[int]]] = []
    for _ in range(num_layers):
        layer: list[list[int]] = []
        for _order in range(2, max_ngram + 1):
            current = vocab_size - 1
            heads: list[int] = []
            for _h in range(n_heads):
                current += 1
                while not _is_prime(current) or current in used:
                    current += 1
                used.add(current)
                heads.append(current)
            layer.append(heads)
        result.append(layer)
    return result


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4.1 text model configuration (flat, engine names; see model.md §1.1)."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_layers: int = 40
    num_draft_layers: int = 3
    num_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    norm_eps: float = 1e-20
    swiglu_limit: float = 10.0
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 65536
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    routed_scaling_factor: float = 1.5
    gate_temp: float = 1.0
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = tuple([0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer: int | None = 20
    candidate_topk_blocks: int = 2048
    # compressed index rows per level-1 candidate group (on disk: candidate_block_size)
    candidate_group_rows: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # "tokenizer": the normalised map built from tokenizer.json (the release);
    # "modulo": id mod engram_compressed_vocab_size (synthetic test configs only).
    engram_token_map: str = "tokenizer"
    # tokens per DSpark draft block, anchor included (on disk: dspark_block_size)
    dspark_draft_len: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int | None = 129264
    weight_block_size: int = 32  # dense FP8 weight blocks (32 x 32)
    act_block_size: int = 32  # activation quantisation block along K
    expert_dtype: str = "fp4"
    name: str = "deepseek-v4.1-flash"
    layers: tuple[LayerSpec, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_types(self)
        for key in ("compress_ratios", "kv_source_layers", "index_source_layers",
                    "engram_layer_ids", "engram_num_embeddings", "dspark_target_layer_ids"):
            object.__setattr__(self, key, tuple(int(v) for v in getattr(self, key)))
        _validate(self)
        object.__setattr__(self, "layers", tuple(derive_layers(self)))

    # ---- derived quantities -------------------------------------------------------------
    @property
    def num_total_layers(self) -> int:
        return self.num_layers + self.num_draft_layers

    @property
    def backbone(self) -> tuple[LayerSpec, ...]:
        return self.layers[: self.num_layers]

    @property
    def draft_layers(self) -> tuple[LayerSpec, ...]:
        return self.layers[self.num_layers :]

    @property
    def decoder_start(self) -> int:
        """First decoder layer: the last kv source (its KV production still runs on every row)."""
        return max(self.kv_source_layers) if self.kv_source_layers else self.num_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def engram_primes(self) -> list[list[list[int]]]:
        return engram_primes(len(self.engram_layer_ids), self.engram_max_ngram_size,
                             self.engram_n_heads, self.engram_vocab_size)

    @property
    def engram_heads_total(self) -> int:
        """Rows gathered per token per Engram layer: (max_ngram - 1) orders x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def dspark_capture_dim(self) -> int:
        return len(self.dspark_target_layer_ids) * self.hidden_size

    def replace(self, **changes: Any) -> ModelConfig:
        changes.pop("layers", None)
        return dataclasses.replace(self, **changes)

    # ---- parsing --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse either the HF nested form or the reference's flat form (detected by keys)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config: expected a JSON object, got {type(raw).__name__}")
        if "text_config" in raw or "hidden_size" in raw or "num_hidden_layers" in raw:
            return cls(**from_hf(raw))
        if "dim" in raw or "n_layers" in raw:
            return cls(**from_flat(raw))
        raise ConfigError("config: neither HF form (text_config/hidden_size) nor reference flat "
                          "form (dim/n_layers) was recognised")

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config: {path} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"config: {path} cannot be read ({exc.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config: {path} is not valid JSON ({exc})") from None
        return cls.from_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF nested `config.json` form (what synthetic checkpoints write)."""
        return to_hf_dict(self)


def _fail(field_name: str, value: Any, expected: str) -> None:
    raise ConfigError(f"{field_name}: got {value!r}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_types(c: ModelConfig) -> None:
    """Every field of the type its annotation names (a JSON string where a number belongs,
    a null, a fraction in an integer list fail here, naming the field), and the real-valued
    fields finite and positive where the model divides or takes logs by them."""
    for f in fields(c):
        kind, value = f.type, getattr(c, f.name)
        if f.name == "layers":
            continue
        if kind == "int" and not _is_int(value):
            _fail(f.name, value, "an integer")
        elif kind == "int | None" and value is not None and not _is_int(value):
            _fail(f.name, value, "an integer or null")
        elif kind == "float" and not (isinstance(value, (int, float)) and
                                      not isinstance(value, bool) and math.isfinite(value)):
            _fail(f.name, value, "a finite number")
        elif kind == "str" and not isinstance(value, str):
            _fail(f.name, value, "a string")
        elif kind == "tuple[int, ...]" and not (isinstance(value, (list, tuple))
                                                and all(_is_int(v) for v in value)):
            _fail(f.name, value, "a list of integers")
    for name in ("rope_theta", "compress_rope_theta", "rope_factor", "beta_fast", "beta_slow",
                 "routed_scaling_factor", "gate_temp", "swiglu_limit", "hc_eps"):
        if getattr(c, name) <= 0:
            _fail(name, getattr(c, name), "a positive number")


def _validate(c: ModelConfig) -> None:
    positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim",
                "weight_block_size", "act_block_size", "max_position_embeddings",
                "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "sliding_window",
                "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                "hc_sinkhorn_iters", "candidate_topk_blocks", "candidate_group_rows")
    for name in positive:
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(name, value, "a positive integer")
    if c.num_draft_layers < 0:
        _fail("num_draft_layers", c.num_draft_layers, "an integer >= 0")
    blk = c.act_block_size
    for name in ("hidden_size", "q_lora_rank", "head_dim", "moe_intermediate_size",
                 "index_head_dim"):
        if getattr(c, name) % blk:
            _fail(name, getattr(c, name), f"a multiple of the quantisation block {blk}")
    if c.head_dim % 16:
        _fail("head_dim", c.head_dim, "a multiple of 16 (compressed KV blocks)")
    if c.rope_head_dim % 2 or not 0 < c.rope_head_dim <= min(c.head_dim, c.index_head_dim):
        _fail("rope_head_dim", c.rope_head_dim,
              "an even number in (0, min(head_dim, index_head_dim)]")
    if c.num_heads % c.o_groups:
        _fail("o_groups", c.o_groups, f"a divisor of num_heads={c.num_heads}")
    if c.num_experts_per_tok > c.n_routed_experts:
        _fail("num_experts_per_tok", c.num_experts_per_tok,
              f"<= n_routed_experts={c.n_routed_experts}")
    if not 0 < c.norm_eps < 1e-3:
        _fail("norm_eps", c.norm_eps, "a small positive float (1e-20 in V4.1)")
    n_total = c.num_layers + c.num_draft_layers
    if len(c.compress_ratios) != n_total:
        _fail("compress_ratios", list(c.compress_ratios),
              f"{n_total} entries (num_layers + num_draft_layers)")
    for i, r in enumerate(c.compress_ratios):
        if r < 0:
            _fail(f"compress_ratios[{i}]", r, "an integer >= 0")
        if i >= c.num_layers and r != 0:
            _fail(f"compress_ratios[{i}]", r, "0 for a DSpark draft layer")
    for name in ("kv_source_layers", "index_source_layers"):
        ids = getattr(c, name)
        if list(ids) != sorted(set(ids)):
            _fail(name, list(ids), "strictly increasing layer ids")
        for layer in ids:
            if not 0 <= layer < c.num_layers or c.compress_ratios[layer] == 0:
                _fail(name, list(ids), f"backbone layers with ratio > 0 (layer {layer} is not)")
    if not set(c.kv_source_layers) <= set(c.index_source_layers):
        _fail("index_source_layers", list(c.index_source_layers),
              f"a superset of kv_source_layers={list(c.kv_source_layers)} "
              "(a kv source owns its index keys)")
    for layer in range(c.num_layers):
        r = c.compress_ratios[layer]
        if r == 0:
            continue
        kv = [s for s in c.kv_source_layers if s <= layer]
        if not kv:
            _fail("kv_source_layers", list(c.kv_source_layers),
                  f"a kv source at or before layer {layer} (ratio {r})")
        if c.compress_ratios[kv[-1]] != r:
            _fail(f"compress_ratios[{layer}]", r,
                  f"the ratio of its kv source layer {kv[-1]} "
                  f"({c.compress_ratios[kv[-1]]})")
    cand = c.candidate_source_layer
    if cand is not None:
        if cand not in c.kv_source_layers:
            _fail("candidate_source_layer", cand, f"one of kv_source_layers "
                  f"{list(c.kv_source_layers)}")
        if (c.candidate_topk_blocks - 1) * c.candidate_group_rows + 1 < c.index_topk:
            _fail("candidate_topk_blocks", c.candidate_topk_blocks,
                  f"(blocks - 1) * candidate_group_rows + 1 >= index_topk={c.index_topk}")
        for layer in c.index_source_layers:
            if layer not in c.kv_source_layers and layer > cand:
                src = max(s for s in c.kv_source_layers if s <= layer)
                if src != cand:
                    _fail("candidate_source_layer", cand,
                          f"the kv source of reindex layer {layer} (it reads {src})")
    # Engram
    if len(c.engram_layer_ids) != len(c.engram_num_embeddings):
        _fail("engram_num_embeddings", list(c.engram_num_embeddings),
              f"one entry per engram layer {list(c.engram_layer_ids)}")
    for layer in c.engram_layer_ids:
        if not 0 <= layer < c.num_layers:
            _fail("engram_layer_ids", list(c.engram_layer_ids), "backbone layer ids")
    if c.engram_layer_ids:
        if c.engram_max_ngram_size < 2:
            _fail("engram_max_ngram_size", c.engram_max_ngram_size, ">= 2")
        if c.engram_head_dim % blk:
            _fail("engram_head_dim", c.engram_head_dim, f"a multiple of {blk}")
        primes = engram_primes(len(c.engram_layer_ids), c.engram_max_ngram_size,
                               c.engram_n_heads, c.engram_vocab_size)
        derived = tuple(sum(sum(o) for o in layer) for layer in primes)
        if derived != c.engram_num_embeddings:
            _fail("engram_num_embeddings", list(c.engram_num_embeddings),
                  f"{list(derived)} (sums of the primes derived from engram_vocab_size="
                  f"{c.engram_vocab_size})")
        if c.engram_token_map not in ("tokenizer", "modulo"):
            _fail("engram_token_map", c.engram_token_map, "'tokenizer' or 'modulo'")
        if not 0 <= c.engram_pad_id < c.engram_compressed_vocab_size:
            _fail("engram_pad_id", c.engram_pad_id, "an id of the compressed vocabulary")
    if c.num_draft_layers:
        if c.dspark_draft_len < 1:
            _fail("dspark_draft_len", c.dspark_draft_len, ">= 1 when draft layers exist")
        for layer in c.dspark_target_layer_ids:
            if not 0 <= layer < c.num_layers:
                _fail("dspark_target_layer_ids", list(c.dspark_target_layer_ids),
                      "backbone layer ids")
        if not c.dspark_target_layer_ids:
            _fail("dspark_target_layer_ids", [], "at least one target layer")
        if c.dspark_num_experts_per_tok > c.dspark_n_routed_experts:
            _fail("dspark_num_experts_per_tok", c.dspark_num_experts_per_tok,
                  f"<= dspark_n_routed_experts={c.dspark_n_routed_experts}")
        if not 0 <= c.dspark_noise_token_id < c.vocab_size:
            _fail("dspark_noise_token_id", c.dspark_noise_token_id, f"< vocab {c.vocab_size}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if not 0 <= getattr(c, name) < c.vocab_size:
            _fail(name, getattr(c, name), f"a token id < vocab_size={c.vocab_size}")
    if c.expert_dtype != "fp4":
        _fail("expert_dtype", c.expert_dtype, "'fp4'")
