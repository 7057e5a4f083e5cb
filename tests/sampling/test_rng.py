"""Counter RNG: the tensor hash equals byte-wise MurmurHash3 (checked on published vectors), noise is
batch-independent, uniforms are exact and in (0, 1), and CPU == CUDA bit for bit."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from shoal.sampling.rng import (
    bits_to_uniform,
    counter_bits,
    derive_seed,
    exponential_noise,
    gumbel_noise,
    request_seed,
    seed_to_int64,
    uniform,
)


def murmur3_32(data: bytes, seed: int = 0) -> int:
    """Textbook byte-wise MurmurHash3_x86_32 on Python ints (independent of the tensor code)."""
    mask = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    h = seed & mask
    nblocks = len(data) // 4
    for i in range(nblocks):
        (k,) = struct.unpack_from("<I", data, 4 * i)
        k = rotl((k * 0xCC9E2D51) & mask, 15) * 0x1B873593 & mask
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & mask
    tail = data[4 * nblocks :]
    k = 0
    for i, byte in enumerate(tail):
        k |= byte << (8 * i)
    if tail:
        k = rotl((k * 0xCC9E2D51) & mask, 15) * 0x1B873593 & mask
        h ^= k
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


@pytest.mark.parametrize(
    ("data", "seed", "expected"),
    [
        (b"", 0, 0),
        (b"", 1, 0x514E28B7),
        (b"", 0xFFFFFFFF, 0x81F16F39),
        (b"test", 0, 0xBA6BD213),
        (b"test", 0x9747B28C, 0x704B81DC),
        (b"Hello, world!", 0x9747B28C, 0x24884CBA),
        (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD),
    ],
)
def test_reference_murmur_matches_published_vectors(data: bytes, seed: int, expected: int) -> None:
    assert murmur3_32(data, seed) == expected


def _words_hash(seed: int, stream: int, position: int, index: int) -> int:
    s = seed & 0xFFFFFFFFFFFFFFFF
    return murmur3_32(struct.pack("<5I", s & 0xFFFFFFFF, s >> 32, stream, position, index))


def test_counter_bits_equal_murmur_of_packed_words() -> None:
    rng = random.Random(0)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1] + [rng.randrange(2**64) for _ in range(6)]
    positions = [rng.randrange(2**32) for _ in seeds]
    indices = [0, 1, 31, 129279, 2**32 - 1]
    for stream in (0, 2):
        bits = counter_bits(
            torch.tensor([seed_to_int64(s) for s in seeds]),
            torch.tensor(positions),
            torch.tensor(indices),
            stream,
        )
        for r, (s, p) in enumerate(zip(seeds, positions, strict=True)):
            for c, i in enumerate(indices):
                assert int(bits[r, c]) == _words_hash(s, stream, p, i), (s, p, i)


def test_row_bits_do_not_depend_on_batch() -> None:
    seeds = torch.tensor([5, 9, 5, -3])
    positions = torch.tensor([0, 0, 1, 70000])
    together = uniform(seeds, positions, 300)
    for r in range(4):
        alone = uniform(seeds[r : r + 1], positions[r : r + 1], 300)
        assert torch.equal(alone[0], together[r])
    flipped = uniform(seeds.flip(0), positions.flip(0), 300)
    assert torch.equal(flipped, together.flip(0))
    # Different seed, position or stream: different streams of numbers.
    assert not torch.equal(together[0], together[1])
    assert not torch.equal(together[0], together[2])
    other = uniform(seeds, positions, 300, stream=1)
    assert (other != together).float().mean() > 0.99


def test_uniform_is_exact_open_interval_and_uniform() -> None:
    bits = torch.tensor([0, 511, 512, 2**32 - 1])
    u = bits_to_uniform(bits)
    assert u.tolist() == [2.0**-24, 2.0**-24, 3 * 2.0**-24, 1 - 2.0**-24]
    u = uniform(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096).flatten()
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 4 * math.sqrt(1 / 12 / n)
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    expected = n / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45.0  # 15 degrees of freedom; p ~ 1e-4


def test_exponential_and_gumbel_moments_and_race_equivalence() -> None:
    seeds = torch.arange(32)
    positions = torch.full((32,), 11)
    e = exponential_noise(seeds, positions, 8192)
    g = gumbel_noise(seeds, positions, 8192)
    assert abs(float(e.mean()) - 1.0) < 0.02
    assert abs(float(g.mean()) - 0.5772156649) < 0.03  # Euler-Mascheroni
    assert torch.equal(g, -torch.log(e))
    # Gumbel-max and the exponential race pick the same token for the same uniforms.
    logits = torch.randn(32, 8192, generator=torch.Generator().manual_seed(3))
    race = (torch.softmax(logits, dim=1) / e).argmax(dim=1)
    assert torch.equal((logits + g).argmax(dim=1), race)


def test_seed_derivation() -> None:
    assert derive_seed(1, 2) == derive_seed(1, 2)
    values = {derive_seed(a, b) for a in range(20) for b in range(20)}
    assert len(values) == 400 and all(0 <= v < 2**63 for v in values)
    assert derive_seed(-1) == derive_seed(2**64 - 1)  # keys are taken mod 2**64
    a = request_seed(42, engine_seed=0, request_index=0)
    assert a == request_seed(42, engine_seed=7, request_index=99)  # a user seed wins
    assert a != request_seed(42, engine_seed=0, request_index=0, sample_index=1)
    b = request_seed(None, engine_seed=0, request_index=3)
    assert b == request_seed(None, engine_seed=0, request_index=3)
    assert b != request_seed(None, engine_seed=0, request_index=4)
    assert b != request_seed(None, engine_seed=1, request_index=3)
    assert seed_to_int64(2**64 - 1) == -1 and seed_to_int64(-5) == -5 and seed_to_int64(7) == 7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_bits_identical() -> None:
    seeds = torch.tensor([seed_to_int64(derive_seed(i)) for i in range(16)])
    positions = torch.arange(16) * 1000 + 17
    cpu_bits = counter_bits(seeds, positions, torch.arange(129280))
    gpu_bits = counter_bits(seeds.cuda(), positions.cuda(), torch.arange(129280).cuda())
    assert torch.equal(cpu_bits, gpu_bits.cpu())
    cpu_g = gumbel_noise(seeds, positions, 129280)
    gpu_g = gumbel_noise(seeds.cuda(), positions.cuda(), 129280).cpu()
    torch.testing.assert_close(gpu_g, cpu_g, rtol=2e-6, atol=2e-6)
