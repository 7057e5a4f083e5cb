"""Counter-based random numbers for sampling: noise is a pure function of (seed, stream, position, id).

Owns: the stateless hash that turns a request's seed, a stream id, the position of the token being
sampled and a vocabulary id into 32 random bits, and the uniform / exponential / Gumbel noise
derived from them; plus the host-side seed derivation (`derive_seed`, `request_seed`).

Invariant: the bits for a row depend only on that row's (seed, stream, position) and the column id,
never on the batch size, the row order or the device. The hash is MurmurHash3_x86_32 over five
little-endian 32-bit words ``[seed_lo, seed_hi, stream, position, index]`` with hash seed 0. Every
32-bit lane is held in int64 and every product is split into 16-bit halves, so no intermediate
exceeds 2**63 and the integer results are bit-identical on CPU and CUDA torch. The fp32 uniform
``(2k + 1) * 2**-24`` for ``k = bits >> 9`` is exact, lies in (0, 1) and is never 0 or 1; the
transcendental step (log) may differ between devices by an ulp.

Streams separate independent uses of the same (seed, position): 0 = token sampling,
1 = draft-model sampling, 2 = speculative-acceptance uniforms.
"""

from __future__ import annotations

import torch
from torch import Tensor

STREAM_SAMPLE = 0
STREAM_DRAFT = 1
STREAM_ACCEPT = 2

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_NUM_WORDS = 5


# --- host side: seed derivation ---------------------------------------------------------------


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def derive_seed(*keys: int) -> int:
    """Mix integer keys (any sign, taken mod 2**64) into a seed in [0, 2**63)."""
    state = 0x243F6A8885A308D3
    for key in keys:
        state = _splitmix64(state ^ (key & _M64))
    return state >> 1


def request_seed(
    user_seed: int | None, *, engine_seed: int, request_index: int, sample_index: int = 0
) -> int:
    """The seed of one sample sequence of a request, in [0, 2**63).

    Args:
        user_seed: `SamplingParams.seed`; None lets the engine choose from its own seed.
        engine_seed: the engine's seed (EngineConfig); makes unseeded runs reproducible.
        request_index: a per-engine counter of requests (used only when user_seed is None).
        sample_index: 0..n-1 for the n sequences of one request, so they differ.
    """
    if user_seed is None:
        return derive_seed(0x5EED, engine_seed, request_index, sample_index)
    return derive_seed(0x05EE, user_seed, sample_index)


def seed_to_int64(seed: int) -> int:
    """Map a seed in [-2**63, 2**64) to the signed int64 with the same low 64 bits."""
    seed &= _M64
    return seed - (1 << 64) if seed >= (1 << 63) else seed


# --- device side: the hash ----------------------------------------------------------------------


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) (int64) and a constant c < 2**32, without overflow."""
    lo = c & 0xFFFF
    hi = c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _rotl32(x: Tensor, r: int) -> Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _scramble(k: Tensor) -> Tensor:
    return _mul32(_rotl32(_mul32(k, _C1), 15), _C2)


def _mix(h: Tensor, scrambled: Tensor) -> Tensor:
    h = _rotl32(h ^ scrambled, 13)
    return (h * 5 + 0xE6546B64) & _M32


def _absorb(h: Tensor, k: Tensor) -> Tensor:
    return _mix(h, _scramble(k))


def _finalize(h: Tensor) -> Tensor:
    h = h ^ (4 * _NUM_WORDS)
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def counter_bits(seeds: Tensor, positions: Tensor, indices: Tensor, stream: int = 0) -> Tensor:
    """32 random bits per (row, index), as int64 in [0, 2**32).

    Args:
        seeds: [B] int64 (two's complement of a 64-bit seed, see `seed_to_int64`).
        positions: [B] int64 in [0, 2**32), the position of the token being sampled.
        indices: [N] or [B, N] int64 in [0, 2**32) (usually vocabulary ids).
        stream: which independent use (STREAM_*), in [0, 2**32).
    Returns:
        [B, N] int64 on the device of `seeds`.
    """
    seeds = seeds.to(torch.int64)
    seed_lo = seeds & _M32  # [B]
    seed_hi = (seeds >> 32) & _M32  # arithmetic shift, then mask: the high word's bits
    h = torch.zeros_like(seed_lo)
    h = _absorb(h, seed_lo)
    h = _absorb(h, seed_hi)
    h = _absorb(h, torch.full_like(seed_lo, stream & _M32))
    h = _absorb(h, positions.to(device=seeds.device, dtype=torch.int64) & _M32)  # [B]
    indices = indices.to(device=seeds.device, dtype=torch.int64) & _M32
    if indices.dim() == 1:
        indices = indices.unsqueeze(0)
    # The last word's scramble depends on the index only: for [N] indices it is computed once and
    # broadcast over the rows, which halves the [B, N] integer work.
    h = _mix(h.unsqueeze(1), _scramble(indices))  # [B, N]
    return _finalize(h)


def bits_to_uniform(bits: Tensor) -> Tensor:
    """Exact fp32 uniforms (2k+1) * 2**-24 in (0, 1) from 32-bit hashes (k = bits >> 9)."""
    odd = ((bits >> 9) << 1) | 1  # < 2**24: exact in fp32
    return odd.to(torch.float32) * (2.0**-24)


def uniform(seeds: Tensor, positions: Tensor, num_cols: int, stream: int = STREAM_SAMPLE) -> Tensor:
    """[B, num_cols] fp32 uniforms in (0, 1) for columns 0..num_cols-1."""
    cols = torch.arange(num_cols, device=seeds.device, dtype=torch.int64)
    return bits_to_uniform(counter_bits(seeds, positions, cols, stream))


def exponential_noise(
    seeds: Tensor, positions: Tensor, num_cols: int, stream: int = STREAM_SAMPLE
) -> Tensor:
    """[B, num_cols] fp32 Exp(1) samples, -log(u)."""
    return -torch.log(uniform(seeds, positions, num_cols, stream))


def gumbel_noise(
    seeds: Tensor, positions: Tensor, num_cols: int, stream: int = STREAM_SAMPLE
) -> Tensor:
    """[B, num_cols] fp32 standard Gumbel samples, -log(-log(u)) = -log(Exp(1)).

    argmax(z + gumbel) is a sample of softmax(z); it picks the same token as the exponential race
    argmax(softmax(z) / Exp(1)) for the same u.
    """
    return -torch.log(exponential_noise(seeds, positions, num_cols, stream))
