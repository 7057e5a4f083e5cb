"""The shard file format of the KV block store: a 64-byte header (magic, format version, shard
index, shard count, key, object length, write id, xxh3-64 checksum of the header's other fields
and the payload) followed by the payload. A shard is used only if all of it checks out."""

from __future__ import annotations

import struct

import xxhash

FORMAT_VERSION = 2
MAGIC = b"SKVS"
# magic, version, shard index, shard count, key, object length, write id, checksum: 64 bytes
HEADER = struct.Struct("<4sHBB32sQQQ")
CHECKED = HEADER.size - 8  # the checksum covers every header byte before it, then the payload


def header(index: int, count: int, key: bytes, length: int, write: int, payload: bytes) -> bytes:
    """The header of shard `index` of `count` of the object `key` (`length` bytes, put `write`)."""
    head = HEADER.pack(MAGIC, FORMAT_VERSION, index, count, key, length, write, 0)
    h = xxhash.xxh3_64(head[:CHECKED])
    h.update(payload)
    return head[:CHECKED] + struct.pack("<Q", h.intdigest())


def parse(raw: bytes, index: int, count: int, key: bytes) -> tuple[bytes, int] | None:
    """(payload, write id) of a shard file's bytes if they are shard `index` of `count` of `key`
    and the checksum holds, else None."""
    if len(raw) < HEADER.size:
        return None
    magic, version, i, n, hkey, _, write, checksum = HEADER.unpack_from(raw)
    if (magic, version, i, n, hkey) != (MAGIC, FORMAT_VERSION, index, count, key):
        return None
    view = memoryview(raw)
    h = xxhash.xxh3_64(view[:CHECKED])
    h.update(view[HEADER.size:])
    return (raw[HEADER.size:], write) if h.intdigest() == checksum else None
