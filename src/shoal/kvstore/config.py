"""Settings and counters of the KV block store (src/shoal/kvstore/store.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

GC_INTERVAL_MAX_S = 3600.0  # periodic gc at least hourly, whatever the TTL


@dataclass(frozen=True)
class KVStoreConfig:
    num_dirs: int = 12  # shards per object, one directory (disk) each
    data_shards: int = 10  # k: any k of the num_dirs shards rebuild an object
    ttl_s: float = 3 * 86400.0  # an object expires this long after its last write or refresh
    max_queue: int = 64  # pending writes; a put beyond this is dropped, never blocks
    # a temp file or an incomplete object untouched this long belongs to a dead writer (another
    # live process's writes in flight are younger) and is removed
    orphan_age_s: float = 600.0
    max_bytes: int | None = None  # bound on bytes_on_disk (LRU eviction); None: unbounded
    gc_interval_s: float | None = None  # the writer's gc period; None: gc_every_s's default

    def __post_init__(self) -> None:
        for name, ok, rule in [
                ("data_shards", self.data_shards >= 1, ">= 1"),
                ("num_dirs", self.num_dirs > self.data_shards, f"> data_shards ({self.data_shards})"),
                ("ttl_s", self.ttl_s > 0, "> 0"), ("max_queue", self.max_queue >= 1, ">= 1"),
                ("max_bytes", self.max_bytes is None or 0 < self.max_bytes < math.inf,
                 "> 0 and finite, or None"),
                ("gc_interval_s", self.gc_interval_s is None or 0 < self.gc_interval_s < math.inf,
                 "> 0 and finite, or None")]:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")

    @property
    def gc_every_s(self) -> float:
        """A tenth of the TTL (an object outlives it by at most 10%), at most an hour."""
        if self.gc_interval_s is not None:
            return self.gc_interval_s
        return min(self.ttl_s / 10, GC_INTERVAL_MAX_S)


@dataclass(frozen=True)
class KVStoreStats:
    enabled: bool  # reads served (False: nothing is)
    writable: bool  # puts written (False after a failed write: reads go on)
    objects: int
    bytes_on_disk: int  # shard file bytes of the indexed objects: what max_bytes bounds
    puts: int  # put() calls, refreshes and drops included
    dropped_puts: int  # not written: queue full, store disabled, write failed or oversized
    hits: int
    misses: int
    repaired_reads: int  # hits that rebuilt a missing or corrupt data shard from parity
    lost_reads: int  # objects with some but < k good shards (lost, damaged): a miss, removed
    expired_removed: int
    orphans_removed: int  # dead writers' temp files and objects left with < k shard files
    evicted: int  # least recently used objects removed to keep bytes_on_disk <= max_bytes
    bytes_evicted: int
    oversized_puts: int  # of dropped_puts: an object larger than max_bytes alone
