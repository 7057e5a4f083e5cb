"""Engram n-gram hash: its constants, the token-id compression map, and a pure torch reference.

Owns (model.md §2.10): the per-layer primes [L][orders][heads], the offsets (exclusive cumulative
sum of a layer's primes in (order, head) order), the odd multipliers `2v+1` drawn from
`numpy.random.default_rng(10007 * layer_id)`, the compressed token map (built from a tokenizer, or
the synthetic `id % compressed_vocab` map), and `engram_hash`, the definition the engine's hash op
is tested against.

Invariant: every constant is derived from the config (and the tokenizer); nothing is hard-coded.
`rolling` never overflows int64: a compressed id is < compressed_vocab and every multiplier is
< (2**63 - 1) // compressed_vocab, so each product fits, and XOR keeps values non-negative.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shoal.model.config import ModelConfig
from shoal.ops.reference.engram import engram_hash as reference_engram_hash

_INT64_MAX = int(np.iinfo(np.int64).max)


def multiplier_bound(compressed_vocab_size: int) -> int:
    """Exclusive upper bound B of the random part v of a multiplier `2v + 1`."""
    return max(1, (_INT64_MAX // compressed_vocab_size) // 2)


def engram_multipliers(
    layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab_size: int
) -> torch.Tensor:
    """Multipliers [L, max_ngram] int64: `2v + 1`, v ~ default_rng(10007 * layer_id) in [0, B)."""
    bound = multiplier_bound(compressed_vocab_size)
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(10007 * layer_id)
        v = rng.integers(0, bound, size=max_ngram, dtype=np.int64)
        rows.append(v * 2 + 1)
    if not rows:
        return torch.zeros(0, max_ngram, dtype=torch.int64)
    return torch.from_numpy(np.stack(rows)).to(torch.int64)


@dataclass(frozen=True, eq=False)
class EngramConstants:
    """Hash constants of all Engram layers (index l follows `config.engram_layer_ids`).

    primes: [L, max_ngram - 1, heads] int64; offsets: [L, (max_ngram - 1) * heads] int64;
    multipliers: [L, max_ngram] int64; pad_id: the compressed id written into blocked slots
    (= token_map[config.engram_pad_id], as the reference does).
    """

    layer_ids: tuple[int, ...]
    primes: torch.Tensor
    offsets: torch.Tensor
    multipliers: torch.Tensor
    pad_id: int
    compressed_vocab_size: int
    max_ngram: int
    n_heads: int

    @property
    def rows_per_layer(self) -> tuple[int, ...]:
        """Table rows of each layer: the sum of its primes."""
        return tuple(int(p.sum()) for p in self.primes)

    def to(self, device: torch.device | str) -> EngramConstants:
        return EngramConstants(
            self.layer_ids, self.primes.to(device), self.offsets.to(device),
            self.multipliers.to(device), self.pad_id, self.compressed_vocab_size,
            self.max_ngram, self.n_heads)


def engram_constants(config: ModelConfig, token_map: torch.Tensor | None = None) -> EngramConstants:
    """Derive the constants from `config`; `token_map` (int32 [vocab]) fixes the pad id.

    Without a map, the pad id is `config.engram_pad_id` itself (true for the release, where
    map[2] == 2, and for the modulo map whenever engram_pad_id < compressed vocab).
    """
    primes = torch.tensor(config.engram_primes, dtype=torch.int64).reshape(
        len(config.engram_layer_ids), config.engram_max_ngram_size - 1, config.engram_n_heads)
    flat = primes.flatten(1)
    offsets = torch.cumsum(flat, dim=1) - flat  # exclusive cumulative sum, (order, head) order
    pad = config.engram_pad_id if token_map is None else int(token_map[config.engram_pad_id])
    return EngramConstants(
        layer_ids=tuple(config.engram_layer_ids), primes=primes, offsets=offsets,
        multipliers=engram_multipliers(tuple(config.engram_layer_ids),
                                       config.engram_max_ngram_size,
                                       config.engram_compressed_vocab_size),
        pad_id=pad, compressed_vocab_size=config.engram_compressed_vocab_size,
        max_ngram=config.engram_max_ngram_size, n_heads=config.engram_n_heads)


# ---- token-id compression map ---------------------------------------------------------------


def _normalizer():  # type: ignore[no-untyped-def]
    from tokenizers import Regex, normalizers

    placeholder = "\ue000"  # keeps a token that is exactly one space from stripping to ""
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), placeholder), normalizers.Strip(),
        normalizers.Replace(placeholder, " "),
    ])


def build_token_map(tokenizer, vocab_size: int | None = None) -> tuple[torch.Tensor, int]:  # type: ignore[no-untyped-def]
    """Compressed id of every token id (model.md §2.10 steps 1-4) from a `tokenizers.Tokenizer`.

    Returns (map int32 [max(vocab_size, len(tokenizer))], number of distinct keys). Ids at or
    beyond len(tokenizer) (open question §10.12) map to the compressed id of token 2 (pad) for
    now; the caller checks the key count against the config.
    """
    norm = _normalizer()
    n_tok = tokenizer.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    values = []
    for token_id in range(n_tok):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            normalised = norm.normalize_str(text)
            key = normalised or text
        values.append(keys.setdefault(key, len(keys)))
    size = max(vocab_size or 0, n_tok)
    pad_fill = values[2] if n_tok > 2 else 0
    values.extend([pad_fill] * (size - n_tok))
    return torch.tensor(values, dtype=torch.int32), len(keys)


def modulo_token_map(vocab_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """The synthetic map of test configs: `id % compressed_vocab_size`, int32 [vocab_size]."""
    return (torch.arange(vocab_size, dtype=torch.int64) % compressed_vocab_size).to(torch.int32)


def token_map_for(config: ModelConfig, tokenizer=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The map the config asks for (`engram_token_map`), int32 [config.vocab_size].

    For 'tokenizer' the number of distinct keys must equal engram_compressed_vocab_size (step 5).
    """
    if config.engram_token_map == "modulo":
        return modulo_token_map(config.vocab_size, config.engram_compressed_vocab_size)
    if tokenizer is None:
        raise ValueError("engram_token_map: 'tokenizer' needs a tokenizer to build the map")
    token_map, n_keys = build_token_map(tokenizer, config.vocab_size)
    if n_keys != config.engram_compressed_vocab_size:
        raise ValueError(f"engram_compressed_vocab_size: the tokenizer yields {n_keys} distinct "
                         f"normalised keys, expected {config.engram_compressed_vocab_size}")
    return token_map[: config.vocab_size] if token_map.numel() > config.vocab_size else token_map


# ---- the hash -------------------------------------------------------------------------------


def sequence_history(token_ids: torch.Tensor, dead: torch.Tensor | None = None,
                     lookback: int = 3) -> torch.Tensor:
    """History [T, lookback] of one sequence starting at position 0: column s-1 holds the id at
    t - s, or -1 before the start or where that token is dead."""
    ids = token_ids.to(torch.int64)
    if dead is not None:
        ids = torch.where(dead, torch.full_like(ids, -1), ids)
    cols = []
    for s in range(1, lookback + 1):
        shifted = torch.full_like(ids, -1)
        if s < ids.numel():
            shifted[s:] = ids[:-s]
        cols.append(shifted)
    return torch.stack(cols, dim=1) if cols else ids.new_zeros(ids.numel(), 0)


def engram_hash(token_ids: torch.Tensor, positions: torch.Tensor, history: torch.Tensor,
                dead: torch.Tensor, token_map: torch.Tensor,
                constants: EngramConstants) -> torch.Tensor:
    """Row ids [T, L, (max_ngram - 1) * heads] int64 of every Engram layer (model.md §2.10): the
    reference `engram_hash` op (ops/reference/engram.py) with this model's constants.

    token_ids [T] int: the token at position p; positions [T] int: p (absolute, 0-based);
    history [T, max_ngram - 1] int: column s-1 is the raw token id at p - s, negative when that
    slot is before the sequence start or a dead (image) token; dead [T] bool: the token at p is
    dead; token_map [vocab] int: compressed ids.
    """
    n_hist = constants.max_ngram - 1
    if history.shape != (token_ids.shape[0], n_hist):
        raise ValueError(f"history: got shape {tuple(history.shape)}, expected "
                         f"[{token_ids.shape[0]}, {n_hist}]")
    device = token_ids.device
    ids = torch.cat([token_ids.to(torch.int64).unsqueeze(1), history.to(torch.int64)], dim=1)
    return reference_engram_hash(
        ids=ids, positions=positions, dead=dead.to(device), token_map=token_map.to(device),
        multipliers=constants.multipliers.to(device), primes=constants.primes.to(device),
        offsets=constants.offsets.to(device), pad_id=constants.pad_id)
