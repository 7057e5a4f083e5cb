"""The shard file format of the KV block store: a 64-byte header (magic, format version, shard
index, shard count, key, object length, write id, xxh3-64 checksum of the header's other fields
and the payload) followed by the payload. A shard is used only if all of it checks out.
An object's shards are written in index order, each as a temp file renamed into place, so the
last shard's file existing means the whole object was written."""

from __future__ import annotations

import os
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

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


def write_object(paths: Sequence[Path], key: bytes, length: int, write: int,
                 payloads: Sequence[bytes], temp_name: Callable[[str], str],
                 mtime: float) -> None:
    """Write shard i of the object `key` to paths[i], in order, each as a temp file (named by
    `temp_name(stem)`) renamed into place with `mtime`; on an error no shard of this write
    remains and the error is raised."""
    done: list[Path] = []
    tmp: Path | None = None
    try:
        for i, (final, payload) in enumerate(zip(paths, payloads, strict=True)):
            head = header(i, len(paths), key, length, write, payload)
            tmp = final.with_name(temp_name(final.stem))
            try:
                f = open(tmp, "wb")
            except FileNotFoundError:  # fan-out directory: made on first use (or after loss)
                tmp.parent.mkdir(parents=True, exist_ok=True)
                f = open(tmp, "wb")
            with f:
                f.write(head)
                f.write(payload)
            os.utime(tmp, (mtime, mtime))
            os.replace(tmp, final)
            tmp = None
            done.append(final)
    except BaseException:
        for p in done + ([tmp] if tmp is not None else []):
            try:
                os.unlink(p)
            except OSError:
                pass
        raise


def read_shard(path: Path, index: int, count: int, key: bytes) -> tuple[bytes, int] | None:
    """Shard `index` of `key` from `path` as (payload, write id), None if unreadable or bad."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return parse(raw, index, count, key)


def read_object(paths: Sequence[Path], key: bytes, k: int,
                decode: Callable[[list[bytes | None]], bytes]) -> tuple[bytes | None, int]:
    """(the object, data shards missing or bad) from its shard files paths[i]; the object is
    None when fewer than k good shards of one write remain. The first k (data) shards are read
    first; the parity only when one of them is bad or of another write."""
    n = len(paths)
    reads = [read_shard(paths[i], i, n, key) for i in range(k)]
    whole = None not in reads and len({r[1] for r in reads}) == 1
    reads += [None if whole else read_shard(paths[i], i, n, key) for i in range(k, n)]
    writes = Counter(r[1] for r in reads if r is not None)
    write = max(writes, key=writes.__getitem__) if writes else None
    shards = [r[0] if r is not None and r[1] == write else None for r in reads]
    try:
        data = decode(shards)
    except ValueError:  # fewer than k good shards (InsufficientShardsError)
        data = None
    return data, shards[:k].count(None)
