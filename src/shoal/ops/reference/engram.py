"""Engram ops (model.md §2.10): the n-gram hash (token ids -> table row ids), FP8 table row
gather with UE8M0 dequantisation, and the gated mix of the n-gram value into each residual
stream. The hash constants (primes, offsets, multipliers, token map) are derived from the config
in `shoal.model.engram_hash`.

Invariant: the gate is a normalised per-(token, stream) dot product with eps 1e-20, a signed
square root clamped at 1e-6 before the sigmoid, and 0 at masked (image) tokens.
"""

from __future__ import annotations

import torch

from shoal.ops.reference._cases import randn
from shoal.ops.reference._math import sigmoid
from shoal.ops.registry import REGISTRY, OpCase, Tolerance
from shoal.quant.fp8 import dequant_fp8_act, quant_fp8_act


def _hash_case(t: int, layers: int, n: int, heads: int, vocab: int, comp: int,
               prime_lo: int) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        pos = torch.randint(0, 6, (t,), generator=g)
        ids = torch.randint(0, vocab, (t, n), generator=g)
        ids = torch.where(torch.rand(t, n, generator=g) < 0.1, -1, ids)  # dead / blocked slots
        ids[:, 1:] = torch.where(torch.arange(1, n) > pos[:, None], -1, ids[:, 1:])
        primes = prime_lo + torch.randint(0, prime_lo, (layers, n - 1, heads), generator=g)
        flat = primes.flatten(1)
        bound = (2**63 - 1) // comp // 2
        return {"ids": ids.to(d), "positions": pos.to(d),
                "dead": (torch.rand(t, generator=g) < 0.1).to(d),
                "token_map": torch.randint(0, comp, (vocab,), generator=g).to(d),
                "multipliers": (torch.randint(0, bound, (layers, n), generator=g) * 2 + 1).to(d),
                "primes": primes.to(d), "offsets": (torch.cumsum(flat, 1) - flat).to(d),
                "pad_id": 2}

    return OpCase(f"T{t}xL{layers}xN{n}xH{heads}", make)


@REGISTRY.define("engram_hash", tolerances={torch.int64: Tolerance()},
                 cases=[_hash_case(1, 2, 4, 2, 50, 31, 97), _hash_case(0, 2, 4, 2, 50, 31, 97),
                        _hash_case(37, 1, 3, 3, 500, 301, 1009),
                        _hash_case(300, 2, 4, 8, 129280, 99092, 16_000_000)])
def engram_hash(*, ids: torch.Tensor, positions: torch.Tensor, dead: torch.Tensor,
                token_map: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                offsets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Engram row ids -> [T, L, (n - 1) * H] int64, for L layers, n-grams up to n, H heads.

    ids [T, n] int: column 0 the token at position p, column s the raw id at p - s (negative
    where that slot is before the sequence start or a dead token); positions [T] int (p); dead
    [T] bool (the token at p is dead); token_map [vocab] int (compressed ids; every id in `ids`
    is < vocab); multipliers [L, n], primes [L, n - 1, H], offsets [L, (n - 1) * H] int64.
    Slot s is blocked once p < s, its id is negative or the token is dead, and a blocked slot
    blocks every older one: blocked slots take `pad_id`, the others token_map[id]. Per layer,
    rolling_1 = v_0 m_0, rolling_s = rolling_{s-1} XOR v_s m_s, and for order s (2..n) and head h
    the row is rolling_{s-1} mod primes[s-2, h] + offsets[(s-2) H + h]. No int64 overflow: a
    compressed id times a multiplier fits (see model/engram_hash.multiplier_bound).
    """
    t, n = ids.shape
    src = ids.to(torch.int64)
    pos = positions.to(torch.int64)
    tmap = token_map.to(torch.int64)
    blocked = dead.to(torch.bool).clone()
    slots = []
    for s in range(n):
        blocked = blocked | (pos < s) | (src[:, s] < 0)
        mapped = tmap[src[:, s].clamp_min(0)]
        slots.append(torch.where(blocked, torch.full_like(mapped, pad_id), mapped))
    values = torch.stack(slots, dim=1) if n else src.new_zeros(t, 0)  # [T, n]
    products = values.unsqueeze(1) * multipliers.to(torch.int64).unsqueeze(0)  # [T, L, n]
    rolling = products[..., 0]
    rows = []
    for s in range(1, n):
        rolling = torch.bitwise_xor(rolling, products[..., s])
        rows.append(rolling.unsqueeze(-1) % primes[:, s - 1].to(torch.int64).unsqueeze(0))
    return torch.cat(rows, dim=-1) + offsets.to(torch.int64).unsqueeze(0)


def _gather_case(t: int, n: int, dim: int, rows: int) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        codes, scales = quant_fp8_act(randn(g, rows, dim, dtype=torch.float32), 32)
        return {"table": codes.to(d), "table_scale": scales.to(d),
                "row_ids": torch.randint(0, rows, (t, n), generator=g).to(d)}

    return OpCase(f"T{t}xN{n}xD{dim}", make)


@REGISTRY.define("engram_gather", tolerances={torch.bfloat16: Tolerance()},
                 cases=[_gather_case(1, 6, 32, 50), _gather_case(7, 6, 32, 300),
                        _gather_case(0, 6, 32, 10), _gather_case(83, 24, 256, 1000)])
def engram_gather(*, table: torch.Tensor, table_scale: torch.Tensor,
                  row_ids: torch.Tensor) -> torch.Tensor:
    """table [rows, Dh] float8_e4m3fn + table_scale [rows, Dh/32] uint8 UE8M0; row_ids [T, n]
    int (on the table's device) -> [T, n * Dh] bf16 (rows concatenated in (order, head) order)."""
    t, n = row_ids.shape
    flat = row_ids.reshape(-1).long()
    vals = dequant_fp8_act(table[flat], table_scale[flat], 32)
    return vals.to(torch.bfloat16).view(t, n * table.shape[1])


def _mix_case(t: int, d: int) -> OpCase:
    def make(g: torch.Generator, dev: torch.device) -> dict:
        return {"stream": randn(g, t, 4, d, device=dev), "kv": randn(g, t, 5 * d, device=dev),
                "q_weight": randn(g, 4, d, scale=0.1, device=dev) + 1,
                "k_weight": randn(g, 4, d, scale=0.1, device=dev) + 1, "eps": 1e-20,
                "gate_mask": (torch.rand(t, generator=g) > 0.2).to(dev)}

    return OpCase(f"T{t}xD{d}", make)


@REGISTRY.define("engram_mix", tolerances={torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2)},
                 cases=[_mix_case(1, 32), _mix_case(7, 128), _mix_case(0, 32), _mix_case(83, 256)])
def engram_mix(*, stream: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor,
               k_weight: torch.Tensor, eps: float,
               gate_mask: torch.Tensor | None = None) -> torch.Tensor:
    """R_i <- bf16(R_i + gate_i * value) per stream i.

    stream [T, hc, D] bf16; kv [T, (hc+1) D] bf16 = engram.wkv . rows (key = first hc*D values
    viewed [hc, D], value = last D); q_weight, k_weight [hc, D] bf16 (only their product is
    used); gate_mask [T] bool (False = image token: gate 0) or None.
    """
    t, hc, d = stream.shape
    key = kv[:, : hc * d].float().view(t, hc, d)
    value = kv[:, hc * d:].float()
    w = q_weight.float() * k_weight.float()
    h = stream.float()
    # the reference's fp32 expression, except the sigmoid evaluated in fp64 (batch-invariant)
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * w * key).sum(-1) * rstd * d**-0.5
    gate = sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if gate_mask is not None:
        gate = gate.masked_fill(~gate_mask.unsqueeze(-1), 0)
    return (h + gate.unsqueeze(-1) * value.unsqueeze(1)).to(torch.bfloat16)
