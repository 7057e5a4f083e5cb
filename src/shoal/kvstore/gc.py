"""TTL expiry and garbage collection of the KV block store (src/shoal/kvstore/store.py): when an
object counts as expired, the collection pass that removes expired objects, and the sweep of
temp files left behind by a writer that died between writing a shard and renaming it.

Invariants: an object is expired once `now - written_at >= ttl_s`, where `written_at` is its last
write or refresh; an expired object is never served. The pass re-checks each candidate and
removes it under the store's writer lock, so a concurrent re-put either lands first (and keeps
the object) or after (and rewrites it). A temp file is removed only when its name does not carry
the live writer's token: the live writer's in-flight temp files are never touched.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from threading import Lock
from typing import Protocol

logger = logging.getLogger("shoal.kvstore")

TEMP_SUFFIX = ".tmp"


class Expirable(Protocol):
    written_at: float


@dataclass(frozen=True)
class GcReport:
    expired: int = 0  # objects removed because their TTL ran out
    orphans: int = 0  # temp files of dead writers removed
    bytes_freed: int = 0  # bytes of the removed objects' shard files


def is_expired(written_at: float, now: float, ttl_s: float) -> bool:
    return now - written_at >= ttl_s


def temp_name(stem: str, token: str) -> str:
    """The temp file name a writer whose token is `token` uses for `stem` before its rename."""
    return f"{stem}.{token}{TEMP_SUFFIX}"


def is_orphan_temp(name: str, live_token: str) -> bool:
    return name.endswith(TEMP_SUFFIX) and not name.endswith(f".{live_token}{TEMP_SUFFIX}")


def sweep_temps(dirs: Sequence[Path], live_token: str) -> int:
    """Remove orphaned temp files under the shard directories (`dir/<fan-out>/<file>`)."""
    removed = 0
    for root in dirs:
        try:
            subdirs = [e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue  # a missing or unreadable directory holds nothing we can remove
        for sub in subdirs:
            try:
                names = [e.name for e in os.scandir(sub) if is_orphan_temp(e.name, live_token)]
            except OSError:
                continue
            for name in names:
                try:
                    os.unlink(os.path.join(sub, name))
                    removed += 1
                except FileNotFoundError:
                    pass
    return removed


def collect(index: Mapping[bytes, Expirable], *, now: float, ttl_s: float, lock: Lock,
            remove_object: Callable[[bytes], int], dirs: Sequence[Path],
            live_token: str) -> GcReport:
    """One collection pass: expired objects (index entry and shard files) and orphaned temps.

    `remove_object(key)` is called with `lock` held; it drops the key's index entry and shard
    files and returns the bytes freed. The lock is taken per object, so the writer is held up
    for one object's unlinks at a time, never for the whole pass.
    """
    with lock:
        candidates = [key for key, e in index.items() if is_expired(e.written_at, now, ttl_s)]
    expired = freed = 0
    for key in candidates:
        with lock:
            entry = index.get(key)
            if entry is None or not is_expired(entry.written_at, now, ttl_s):
                continue  # removed meanwhile, or refreshed by a re-put
            freed += remove_object(key)
            expired += 1
    orphans = sweep_temps(dirs, live_token)
    if expired or orphans:
        logger.debug("kvstore gc: %d expired objects (%d bytes), %d orphaned temp files",
                     expired, freed, orphans)
    return GcReport(expired=expired, orphans=orphans, bytes_freed=freed)
