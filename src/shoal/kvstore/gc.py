"""Garbage collection of the KV block store (src/shoal/kvstore/store.py): the names of its files,
when an object counts as expired, the open-time recovery scan (which objects on disk are whole,
which files are garbage), the collection pass (expired objects, orphaned temp files) and the
eviction pass (least recently used objects, when the store is over its size bound).

Invariants: an object is expired once `now - written_at >= ttl_s`, where `written_at` is its last
write or refresh; an expired object is never served. Both passes re-check each candidate and
remove it under the store's writer lock, so a concurrent re-put either lands first (and keeps
the object: it is no longer expired, or no longer the least recently used) or after (and
rewrites it). Both see only the calling process's index: another process sharing the
directories finds the objects removed here missing, which its reads take as a miss. A temp
file is removed only when its name does not carry the live writer's token and it has not
changed for `orphan_age_s` (another live process's writes in flight are younger), and an object
with too few shard files likewise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from threading import Lock
from typing import Protocol

logger = logging.getLogger("shoal.kvstore")

SHARD_SUFFIX = ".kvs"
MTIME_SLACK_S = 1e-3  # file times round to the file system's resolution
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


def shard_name(key: bytes) -> str:
    return key.hex() + SHARD_SUFFIX


def _shard_key(name: str) -> bytes | None:
    stem = name[:-len(SHARD_SUFFIX)]
    if not name.endswith(SHARD_SUFFIX) or len(stem) != 64:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None  # not a shard name: not ours, left alone


def temp_name(stem: str, token: str) -> str:
    """The temp file name a writer whose token is `token` uses for `stem` before its rename."""
    return f"{stem}.{token}{TEMP_SUFFIX}"


def is_orphan_temp(name: str, live_token: str) -> bool:
    return name.endswith(TEMP_SUFFIX) and not name.endswith(f".{live_token}{TEMP_SUFFIX}")


def is_stale(path: str | Path, age_s: float) -> bool:
    """Unchanged for `age_s` seconds of real time (ctime: a fake store clock cannot move it)."""
    try:
        return age_s <= 0 or time.time() - os.stat(path).st_ctime >= age_s
    except FileNotFoundError:
        return False


def _fanout_dirs(root: Path) -> list[str]:
    """The `<hex[:2]>` subdirectories of a shard directory (none if it is missing)."""
    try:
        return [e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def recover(dirs: Sequence[Path], *, min_shards: int, live_token: str,
            orphan_age_s: float) -> tuple[dict[bytes, tuple[float, int]], int]:
    """Open-time scan: one listing of every shard directory, one stat per object found.

    Returns `{key: (written_at, disk_bytes)}` for the objects with at least `min_shards` shard
    files (`written_at` is a shard file's mtime), and the number of garbage items removed:
    orphaned temp files and objects with fewer shard files (a crash mid-write, or lost disks),
    once stale (`is_stale`: younger ones may be another process's writes in flight).
    """
    found: dict[bytes, list[str]] = {}
    removed = 0
    for root in dirs:
        for sub in _fanout_dirs(root):
            for e in os.scandir(sub):
                key = _shard_key(e.name)
                if key is not None:
                    found.setdefault(key, []).append(e.path)
                elif is_orphan_temp(e.name, live_token) and is_stale(e.path, orphan_age_s):
                    removed += unlink_quiet(e.path)
    objects: dict[bytes, tuple[float, int]] = {}
    for key, paths in found.items():
        if len(paths) < min_shards:
            if not all(is_stale(p, orphan_age_s) for p in paths):
                continue  # being written: neither served nor removed
            removed += 1
            for p in paths:
                unlink_quiet(p)
            continue
        st = os.stat(paths[0])
        objects[key] = (st.st_mtime, st.st_size * len(paths))
    return objects, removed


def scan_shards(root: Path) -> dict[bytes, tuple[float, int]]:
    """`{key: (mtime, size)}` of the shard files in one shard directory (one listing, one stat
    per file); a file removed meanwhile is skipped."""
    found: dict[bytes, tuple[float, int]] = {}
    for sub in _fanout_dirs(root):
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(sub):
                key = _shard_key(e.name)
                if key is not None:
                    with contextlib.suppress(FileNotFoundError):
                        st = e.stat()
                        found[key] = (st.st_mtime, st.st_size)
    return found


def sweep_temps(dirs: Sequence[Path], live_token: str, orphan_age_s: float) -> int:
    """Remove stale orphaned temp files under the shard directories (`dir/<hex[:2]>/<file>`)."""
    removed = 0
    for root in dirs:
        for sub in _fanout_dirs(root):
            try:
                names = [e.name for e in os.scandir(sub) if is_orphan_temp(e.name, live_token)
                         and is_stale(e.path, orphan_age_s)]
            except FileNotFoundError:
                continue
            removed += sum(unlink_quiet(os.path.join(sub, name)) for name in names)
    return removed


def unlink_quiet(path: str | Path) -> int:
    """Remove a file; 1 if removed, 0 if it was already gone."""
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


def newest_mtime(paths: Iterable[Path]) -> float | None:
    """The newest mtime of an object's shard files (another process sharing the directories
    refreshes an object by touching them), None if none is left."""
    times = []
    for path in paths:
        with contextlib.suppress(OSError):
            times.append(os.stat(path).st_mtime)
    return max(times, default=None)


def _moved_on_disk(entry: Expirable, key: bytes,
                   disk_written_at: Callable[[bytes], float | None]) -> bool:
    """Whether another process refreshed the object since this index saw it (its files' mtime
    is newer); the entry then takes that time."""
    on_disk = disk_written_at(key)
    if on_disk is None or on_disk <= entry.written_at + MTIME_SLACK_S:
        return False
    entry.written_at = on_disk
    return True


def collect(index: Mapping[bytes, Expirable], *, now: float, ttl_s: float, lock: Lock,
            remove_object: Callable[[bytes], int], dirs: Sequence[Path],
            live_token: str, orphan_age_s: float,
            disk_written_at: Callable[[bytes], float | None] = lambda key: None) -> GcReport:
    """One collection pass: expired objects (index entry and shard files) and orphaned temps.

    `remove_object(key)` is called with `lock` held; it drops the key's index entry and shard
    files and returns the bytes freed. The lock is taken per object, so the writer is held up
    for one object's unlinks at a time, never for the whole pass. `disk_written_at(key)`: the
    object's files' newest mtime, checked before removing it (another process's refresh).
    """
    with lock:
        candidates = [key for key, e in index.items() if is_expired(e.written_at, now, ttl_s)]
    expired = freed = 0
    for key in candidates:
        with lock:
            entry = index.get(key)
            if entry is None or not is_expired(entry.written_at, now, ttl_s):
                continue  # removed meanwhile, or refreshed by a re-put
            if _moved_on_disk(entry, key, disk_written_at) and \
                    not is_expired(entry.written_at, now, ttl_s):
                continue  # refreshed by another process
            freed += remove_object(key)
            expired += 1
    orphans = sweep_temps(dirs, live_token, orphan_age_s)
    if expired or orphans:
        logger.debug("kvstore gc: %d expired objects (%d bytes), %d orphaned temp files",
                     expired, freed, orphans)
    return GcReport(expired=expired, orphans=orphans, bytes_freed=freed)


def evict_lru(index: Mapping[bytes, Expirable], *, target_bytes: int, total: Callable[[], int],
              keep: bytes | None, lock: Lock, remove_object: Callable[[bytes], int],
              disk_written_at: Callable[[bytes], float | None] = lambda key: None
              ) -> tuple[int, int]:
    """Remove objects, oldest `written_at` first and never `keep`, until `total()` (the index's
    bytes) is at most `target_bytes`; returns (objects removed, bytes freed).

    As in `collect`: candidates are listed under `lock`, and each is re-checked and removed
    under it, one at a time; one whose `written_at` moved meanwhile (refreshed, also by another
    process: `disk_written_at`) is kept.
    """
    with lock:
        order = [(e.written_at, key) for key, e in index.items() if key != keep]
    order.sort()  # (outside the lock: O(n log n) over the whole index)
    evicted = freed = 0
    for written_at, key in order:
        with lock:
            if total() <= target_bytes:
                break
            entry = index.get(key)
            if entry is None or entry.written_at != written_at:
                continue  # removed meanwhile, or refreshed (now recently used)
            if _moved_on_disk(entry, key, disk_written_at):
                continue  # used by another process: recently used
            freed += remove_object(key)
            evicted += 1
    if evicted:
        logger.debug("kvstore eviction: %d least recently used objects (%d bytes)",
                     evicted, freed)
    return evicted, freed
