"""The persistent, content-addressed KV block store (the disk tier of the prefix cache): on-disk
layout, the in-memory index, reads, and the background writer.

Layout: an object under a 32-byte key is cut by the erasure codec (erasure.py) into k data and
m parity shards; shard i lives in directory i (`root/dNN`, one per disk) at
`<dir>/<hex[:2]>/<hex>.kvs`, written as a temp file and renamed (format: shard_file.py). A
shard's write id is random per put: two processes writing one key at once may leave shards of
both writes, and an object is rebuilt only from shards of one write.
The file's mtime is the object's `written_at`: set from the store's clock on write, moved by a
refresh (a re-put of a present key touches the shard files instead of rewriting them), read back
when the index is rebuilt by scanning the directories on open (gc.recover). There is no fsync:
this is a cache, and a shard torn by a power loss fails its checksum.
Size: `bytes_on_disk` counts the shard files of the objects in this process's index. A write
that takes it over `max_bytes` makes the writer evict the least recently used objects (oldest
`written_at`; never the object just written) down to `EVICT_TO * max_bytes`; an object over
`max_bytes` alone is not written; an open over the bound evicts at once. gc (expiry, orphans)
runs at open, then on the writer every `config.gc_every_s` of the store's clock.
Several processes may share the directories, each with its own index (sharing.py: an index
miss, a refresh and a put look at the disk; rescans keep one bound for all of them).

Invariants: `get` returns the bytes that were put or None, never other bytes: a shard is used
only if its checksum, key and index match, and fewer than k such shards is a miss. No call
raises into the caller on I/O failure and `put` never blocks: a full queue drops the put; a
failed write (a full disk) stops the writes with one warning while reads go on; a directory
that cannot be used at open disables the store with one warning. `bytes_on_disk <= max_bytes`
but while the writer evicts after a write; eviction and gc re-check each object under the
writer lock (gc.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from shoal.kvstore import gc as kvgc
from shoal.kvstore import shard_file, sharing
from shoal.kvstore.config import KVStoreConfig, KVStoreStats
from shoal.kvstore.erasure import ErasureCodec

logger = logging.getLogger("shoal.kvstore")

KEY_BYTES = 32
_STOP = object()
# Eviction goes below the bound so that a full store sorts its index once per ~10% of max_bytes
# written rather than on every put.
EVICT_TO = 0.9


@dataclass
class _Entry:
    written_at: float
    disk_bytes: int


class KVStore:
    """The store (see the module docstring). `root`: one directory (shards in `root/d00 ..`) or a
    list of directories; `clock`: the time of writes and expiry (tests pass a fake one)."""

    def __init__(self, root: str | os.PathLike | Sequence[str | os.PathLike], *,
                 num_dirs: int | None = None, data_shards: int = 10,
                 ttl_s: float = 3 * 86400.0, max_queue: int = 64, orphan_age_s: float = 600.0,
                 max_bytes: int | None = None, gc_interval_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if isinstance(root, str | os.PathLike):
            n = 12 if num_dirs is None else num_dirs
            dirs = [Path(root) / f"d{i:02d}" for i in range(n)]
        else:
            dirs = [Path(d) for d in root]
            if num_dirs is not None and num_dirs != len(dirs):
                raise ValueError(f"num_dirs ({num_dirs}) != number of directories ({len(dirs)})")
        self.config = KVStoreConfig(num_dirs=len(dirs), data_shards=data_shards, ttl_s=ttl_s,
                                    max_queue=max_queue, orphan_age_s=orphan_age_s,
                                    max_bytes=max_bytes, gc_interval_s=gc_interval_s)
        if len({os.path.abspath(d) for d in dirs}) != len(dirs):
            raise ValueError("directories must be distinct: shards of one object share a name")
        self.dirs = tuple(dirs)
        self._k, self._n = data_shards, len(dirs)
        self._codec = ErasureCodec(self._k, self._n - self._k)
        self._clock = clock
        self._token = uuid.uuid4().hex[:16]  # names this writer's temp files (see gc.py)
        self._index: dict[bytes, _Entry] = {}
        self._disk_bytes = 0
        self._since_rescan = 0  # bytes this writer wrote since its last rescan
        self._pending: Counter = Counter()  # keys queued with data, not yet written (_lock)
        self._io_lock = threading.Lock()  # object writes, gc, eviction, lost-object removal
        self._lock = threading.Lock()  # the counters and the enabled flag
        self._counts = {f.name: 0 for f in fields(KVStoreStats)[4:]}  # the counters of stats()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._enabled = self._writable = True
        try:
            self._prepare_dirs()
            objects, removed = kvgc.recover(self.dirs, min_shards=self._k, live_token=self._token,
                                            orphan_age_s=orphan_age_s)
        except OSError as exc:
            self._disable(f"cannot use the shard directories: {exc}")
            return
        for key, (written_at, disk_bytes) in objects.items():  # the index, rebuilt from disk
            self._index_add(key, _Entry(written_at, disk_bytes))
        self._count(orphans_removed=removed)
        self.gc()
        self._evict(keep=None)  # the directories may hold more (a new bound, other processes)
        self._thread = threading.Thread(target=self._writer, name="shoal-kvstore-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._enabled

    def put(self, key: bytes, data: bytes) -> bool:
        """Queue `data` under `key`; False if dropped (queue full or store disabled). A key
        present when the writer gets to it only gets its timestamp refreshed (no rewrite)."""
        _check_key(key)
        self._count(puts=1)
        if not self._writable or self._thread is None:
            self._count(dropped_puts=1)
            return False
        with self._lock:
            self._pending[key] += 1
        try:  # (the data stays queued: the object may be gone by the time the writer runs)
            self._queue.put_nowait((key, bytes(data)))
        except queue.Full:
            self._done_pending(key)
            self._count(dropped_puts=1)
            return False
        return True

    def pending(self, key: bytes) -> bool:
        """Queued to be written and not written yet (the index does not show it)."""
        with self._lock:
            return key in self._pending

    def _done_pending(self, key: bytes) -> None:
        with self._lock:
            self._pending -= Counter({key: 1})  # (drops keys that reach 0)

    def touch(self, key: bytes) -> None:
        """Restart a present object's time to live (a hit keeps what is used); queued as a
        refresh, dropped when the queue is full."""
        _check_key(key)
        if self.contains(key) and self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait((key, None))

    def get(self, key: bytes) -> bytes | None:
        """The object under `key`, or None (absent, expired, disabled or unrecoverable)."""
        _check_key(key)
        if not self.contains(key):
            self._count(misses=1)
            return None
        data, missing_data = shard_file.read_object(
            [self.shard_path(i, key) for i in range(self._n)], key, self._k, self._codec.decode)
        if data is None:
            # No last shard: another process sharing the directories removed it or is removing
            # it (last shard first), a plain miss whose files are left to it; else shards were
            # lost or damaged, and the object is removed.
            gone = self._on_disk(key) is None
            logger.debug("kvstore: %s has fewer than %d good shards (%s)", key.hex(), self._k,
                         "gone" if gone else "lost")
            self._count(lost_reads=0 if gone else 1, misses=1)
            try:  # so that contains() says no and a later put writes it afresh
                with self._io_lock:
                    self._forget(key) if gone else self._remove_object(key)
            except OSError as exc:
                self._stop_writes(f"cannot remove an unrecoverable object: {exc}")
            return None
        self._count(hits=1, repaired_reads=1 if missing_data else 0)
        return data

    def contains(self, key: bytes) -> bool:
        """Present, not expired, store enabled: the index, else the disk (another process's
        object written after this index was built; one stat)."""
        if not self._enabled:
            return False
        entry = self._index.get(key)
        found = (entry.written_at, entry.disk_bytes) if entry is not None else self._on_disk(key)
        return found is not None and not kvgc.is_expired(found[0], self._clock(),
                                                         self.config.ttl_s)

    def _on_disk(self, key: bytes) -> tuple[float, int] | None:
        return sharing.on_disk(self.shard_path(self._n - 1, key), self._n)

    def gc(self) -> kvgc.GcReport:
        """Remove expired objects and orphaned temp files (run on open and by the writer every
        `config.gc_every_s`; the caller may also run it)."""
        if not self._writable:
            return kvgc.GcReport()
        try:
            report = kvgc.collect(self._index, now=self._clock(), ttl_s=self.config.ttl_s,
                                  disk_written_at=self._disk_written_at,
                                  lock=self._io_lock, remove_object=self._remove_object,
                                  dirs=self.dirs, live_token=self._token,
                                  orphan_age_s=self.config.orphan_age_s)
        except OSError as exc:
            self._stop_writes(f"gc failed: {exc}")
            return kvgc.GcReport()
        self._count(expired_removed=report.expired, orphans_removed=report.orphans)
        return report

    def flush(self) -> None:
        """Wait until every queued write is done (or dropped by a disabled store)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(_STOP)
            thread.join()

    def stats(self) -> KVStoreStats:
        with self._lock:
            return KVStoreStats(enabled=self._enabled, writable=self._writable,
                                objects=len(self._index),
                                bytes_on_disk=self._disk_bytes, **self._counts)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def shard_path(self, i: int, key: bytes) -> Path:
        return self.dirs[i] / key[:1].hex() / kvgc.shard_name(key)

    def _prepare_dirs(self) -> None:
        for d in self.dirs:  # every directory must take a file, or the store is off
            d.mkdir(parents=True, exist_ok=True)
            probe = d / kvgc.temp_name("probe", self._token)
            probe.write_bytes(b"")
            probe.unlink()

    def _index_add(self, key: bytes, entry: _Entry) -> None:
        old = self._index.get(key)
        self._disk_bytes += entry.disk_bytes - (old.disk_bytes if old else 0)
        self._index[key] = entry

    def _disk_written_at(self, key: bytes) -> float | None:
        return kvgc.newest_mtime(self.shard_path(i, key) for i in range(self._n))

    def _forget(self, key: bytes) -> int:
        """Drop `key`'s index entry (the caller holds _io_lock); returns its bytes."""
        entry = self._index.pop(key, None)
        freed = entry.disk_bytes if entry else 0
        self._disk_bytes -= freed
        return freed

    def _remove_object(self, key: bytes) -> int:
        """Drop `key`'s index entry and shard files, the last shard first, so that another
        process never takes a half-removed object for a whole one (the caller holds
        _io_lock)."""
        freed = self._forget(key)
        for i in reversed(range(self._n)):
            kvgc.unlink_quiet(self.shard_path(i, key))
        return freed

    def _writer(self) -> None:
        every = self.config.gc_every_s
        next_gc = self._clock() + every
        while True:
            # Wake for the next gc when idle. The wait is real time; the store's clock decides
            # whether gc is due, checked after every item too (so a fake clock needs no sleep).
            try:
                item = self._queue.get(timeout=min(max(next_gc - self._clock(), 0.0), every))
            except queue.Empty:
                item = None
            try:
                if item is _STOP:
                    return
                if item is not None:
                    self._write_or_refresh(*item)
                if self._clock() >= next_gc:
                    self.gc()
                    next_gc = self._clock() + every
            except OSError as exc:
                self._count(dropped_puts=1)
                self._stop_writes(f"write failed: {exc}")
            except Exception:  # a bug must not kill the writer: flush() would then hang
                logger.exception("kvstore writer failed")
                self._count(dropped_puts=1)
                self._stop_writes("writer error")
            finally:
                if item is not None:
                    if item is not _STOP and item[1] is not None:
                        self._done_pending(item[0])
                    self._queue.task_done()

    def _write_or_refresh(self, key: bytes, data: bytes | None) -> None:
        if not self._writable:
            self._count(dropped_puts=1)
            return
        written = 0
        with self._io_lock:
            # The disk decides (another process may have written or removed it): present (for a
            # refresh of an indexed object, any shard left) is a refresh, for a put too; a
            # refresh of an object gone forgets it; a put of one gone writes it.
            if self._on_disk(key) is not None or (data is None and key in self._index and
                                                  self._disk_written_at(key) is not None):
                if not self._refresh(key):
                    return
            elif data is None:
                self._forget(key)
                return
            elif not (written := self._write_object(key, data)):
                return
        bound = self.config.max_bytes
        self._since_rescan += written
        if bound is not None and self._since_rescan >= sharing.RESCAN_EVERY * bound:
            self._rescan()
        self._evict(keep=key)

    def _rescan(self) -> None:
        self._since_rescan = 0
        sharing.rescan(self.dirs[-1], self._index, self._n, lock=self._io_lock,
                       add=lambda key, mtime, size: self._index_add(key, _Entry(mtime, size)),
                       remove_object=self._remove_object, disk_written_at=self._disk_written_at)

    def _evict(self, keep: bytes | None) -> None:
        """Evict least recently used objects down to EVICT_TO * max_bytes if over max_bytes."""
        bound = self.config.max_bytes
        if bound is None or self._disk_bytes <= bound or not self._writable:
            return
        try:
            evicted, freed = kvgc.evict_lru(
                self._index, target_bytes=int(bound * EVICT_TO), total=lambda: self._disk_bytes,
                keep=keep, lock=self._io_lock, remove_object=self._remove_object,
                disk_written_at=self._disk_written_at)
        except OSError as exc:  # the bound cannot be kept: stop growing
            self._stop_writes(f"eviction failed: {exc}")
            return
        self._count(evicted=evicted, bytes_evicted=freed)

    def _refresh(self, key: bytes) -> bool:
        """Restart an object's time on disk; True if that indexed it (another process's)."""
        entry = self._index.get(key)
        adopted = entry is None
        if adopted:
            found = self._on_disk(key)
            if found is None:
                return False
            entry = _Entry(*found)
            self._index_add(key, entry)
        now = self._clock()
        for i in range(self._n):
            with contextlib.suppress(FileNotFoundError):  # a lost shard: reads rebuild it
                os.utime(self.shard_path(i, key), (now, now))
        entry.written_at = now
        return adopted

    def _write_object(self, key: bytes, data: bytes) -> int:
        """Write the object's shards and index it; its bytes on disk, 0 if it alone exceeds
        max_bytes (not written)."""
        now = self._clock()
        shards = self._codec.encode(data)
        disk_bytes = sum(shard_file.HEADER.size + len(s) for s in shards)
        if self.config.max_bytes is not None and disk_bytes > self.config.max_bytes:
            self._count(dropped_puts=1, oversized_puts=1)
            return 0
        write = int.from_bytes(os.urandom(8), "little")
        shard_file.write_object([self.shard_path(i, key) for i in range(self._n)], key,
                                len(data), write, shards,
                                lambda stem: kvgc.temp_name(stem, self._token), now)
        self._index_add(key, _Entry(now, disk_bytes))
        return disk_bytes

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _disable(self, reason: str) -> None:
        with self._lock:  # the writer and callers may fail at once: one warning
            if not self._enabled:
                return
            self._enabled = self._writable = False
        logger.warning("kvstore disabled (puts dropped, gets miss): %s", reason)

    def _stop_writes(self, reason: str) -> None:
        with self._lock:
            if not self._writable:
                return
            self._writable = False
        logger.warning("kvstore writes stopped (puts dropped; reads go on): %s", reason)


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {key!r:.80}")
