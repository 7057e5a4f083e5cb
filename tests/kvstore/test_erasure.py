"""The 10+2 erasure codec: any 10 of the 12 shards rebuild the object byte for byte, fewer raise."""

from __future__ import annotations

import itertools
import random

import pytest

from shoal.kvstore.erasure import ErasureCodec, InsufficientShardsError, decode, encode

SIZES = [0, 1, 2, 9, 10, 11, 4097, 65536 + 3, 3 << 20]


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_all_present(size):
    data = random.Random(size).randbytes(size)
    shards = encode(data)
    assert len(shards) == 12
    assert len({len(s) for s in shards}) == 1, "shards must have one length"
    assert decode(shards) == data
    assert decode(shards[:10] + [None, None]) == data  # data shards alone suffice
    assert decode([None, None] + shards[2:]) == data  # two data shards rebuilt from parity


def test_every_pair_of_lost_shards_decodes_identically():
    data = random.Random(7).randbytes(1001)
    shards = encode(data)
    for lost in itertools.combinations(range(12), 2):
        have = [None if i in lost else s for i, s in enumerate(shards)]
        assert decode(have) == data, lost
    for lost in range(12):
        assert decode([None if i == lost else s for i, s in enumerate(shards)]) == data, lost


def test_three_lost_shards_raise():
    shards = encode(b"x" * 5000)
    for lost in itertools.combinations(range(12), 3):
        with pytest.raises(InsufficientShardsError, match="need k=10"):
            decode([None if i in lost else s for i, s in enumerate(shards)])
    assert issubclass(InsufficientShardsError, ValueError)


def test_other_k_m():
    codec = ErasureCodec(4, 3)
    data = random.Random(1).randbytes(12345)
    shards = codec.encode(data)
    assert len(shards) == 7
    for lost in itertools.combinations(range(7), 3):
        assert codec.decode([None if i in lost else s for i, s in enumerate(shards)]) == data
    assert decode(shards[:4] + [None] * 3, k=4, m=3) == data


def test_bad_settings_name_the_setting():
    with pytest.raises(ValueError, match="k \\(data shards\\)"):
        ErasureCodec(0, 2)
    with pytest.raises(ValueError, match="m \\(parity shards\\)"):
        ErasureCodec(10, 0)
    with pytest.raises(ValueError, match="k \\+ m"):
        ErasureCodec(30, 3)
    with pytest.raises(ValueError, match="12 shard slots"):
        decode(encode(b"abc")[:11])
