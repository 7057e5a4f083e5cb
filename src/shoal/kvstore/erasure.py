"""The erasure codec of the KV block store: an object's bytes become k data + m parity shards of
equal length (10 + 2 by default), and any k of them rebuild the object.

Invariant: `decode(encode(data))` returns `data` exactly from any k of the k + m shards; with
fewer than k present it raises `InsufficientShardsError` and never guesses. Each shard is
self-describing (the library's fragment header carries its index and the object's length), so
the original length needs no separate field and shards may arrive in any order.
"""

from __future__ import annotations

from collections.abc import Sequence

# pyeclib with ISA-L Reed-Solomon (Vandermonde): several times zfec's speed, encode and decode
# with lost shards (benchmarks/bench_erasure.py); its wheel bundles ISA-L.
from pyeclib.ec_iface import ECDriver, ECDriverError

EC_TYPE = "isa_l_rs_vand"
MAX_SHARDS = 32  # liberasurecode's limit on k + m


class InsufficientShardsError(ValueError):
    """Fewer than k usable shards: the object cannot be rebuilt."""


class ErasureCodec:
    """A k + m codec. Thread-safe: the driver holds only immutable coding tables."""

    def __init__(self, k: int = 10, m: int = 2) -> None:
        if k < 1:
            raise ValueError(f"k (data shards) must be >= 1, got {k}")
        if m < 1:
            raise ValueError(f"m (parity shards) must be >= 1, got {m}")
        if k + m > MAX_SHARDS:
            raise ValueError(f"k + m (total shards) must be <= {MAX_SHARDS}, got {k + m}")
        self.k, self.m = k, m
        try:
            self._driver = ECDriver(k=k, m=m, ec_type=EC_TYPE)
        except ECDriverError as exc:
            raise ValueError(f"erasure backend {EC_TYPE} rejects k={k}, m={m}: {exc}") from exc

    @property
    def n(self) -> int:
        return self.k + self.m

    def encode(self, data: bytes) -> list[bytes]:
        """k data shards then m parity shards, all of one length."""
        shards = self._driver.encode(bytes(data))
        assert len(shards) == self.n and len({len(s) for s in shards}) == 1
        return shards

    def decode(self, shards: Sequence[bytes | None]) -> bytes:
        """The object from `shards` (length k + m, None where a shard is lost)."""
        if len(shards) != self.n:
            raise ValueError(f"decode expects {self.n} shard slots (k + m), got {len(shards)}")
        present = [s for s in shards if s is not None]
        if len(present) < self.k:
            raise InsufficientShardsError(
                f"only {len(present)} of {self.n} shards present, need k={self.k}")
        try:
            return self._driver.decode(present)
        except ECDriverError as exc:
            # Damaged or mismatched shards: the caller's checksums should have dropped them.
            raise ValueError(f"shards do not decode to one object: {exc}") from exc


# The functions build a codec per call (~0.25 ms of backend set-up): for one-off use; repeated
# use (the store) holds one ErasureCodec.
def encode(data: bytes, k: int = 10, m: int = 2) -> list[bytes]:
    """k data + m parity shards of `data`, equal length, the length recoverable from them."""
    return ErasureCodec(k, m).encode(data)


def decode(shards: Sequence[bytes | None], k: int = 10, m: int = 2) -> bytes:
    """The object rebuilt from any k of its k + m shards (None marks a lost shard)."""
    return ErasureCodec(k, m).decode(shards)
