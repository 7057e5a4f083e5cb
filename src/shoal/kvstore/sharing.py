"""Several processes (data-parallel replicas, later runs) sharing one store's directories, each
with its own index of the objects.

- An index miss looks at the disk: `on_disk` stats the object's last shard, which a write
  renames last, so an object another process wrote since this index was built is a hit; its
  first refresh (a hit's `touch`, or a put of it) adds it to the index.
- With a size bound, the writer rescans after writing RESCAN_EVERY of the bound (`rescan`): it
  indexes every object on disk and drops the entries whose files another process removed, so
  `bytes_on_disk` counts the directories and the bound holds for all of them; several writers
  may overshoot it by about RESCAN_EVERY of it each between their rescans.
- A put or a refresh asks the disk too: a put of an object another process removed writes it
  again, a refresh of one forgets it.
- Removal unlinks the last shard first, so a half-removed object is never taken for whole: a
  read that finds no last shard is a plain miss (not a lost read) and leaves the files alone.
- gc and eviction keep an object whose files another process refreshed (gc.py reads their
  mtime).
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from pathlib import Path
from threading import Lock

from shoal.kvstore import gc as kvgc

RESCAN_EVERY = 0.05


def on_disk(last_shard: Path, num_shards: int) -> tuple[float, int] | None:
    """(written_at, disk bytes) of an object whose last shard file is `last_shard` (every shard
    has its size), or None when there is none."""
    try:
        st = os.stat(last_shard)
    except OSError:
        return None
    return st.st_mtime, st.st_size * num_shards


def rescan(last_dir: Path, index: MutableMapping, num_shards: int, *, lock: Lock,
           add: Callable[[bytes, float, int], None], remove_object: Callable[[bytes], int],
           disk_written_at: Callable[[bytes], float | None]) -> None:
    """Index the objects listed in `last_dir` (the last shard directory: whole objects only)
    that `index` lacks (`add(key, written_at, disk_bytes)`), and drop the entries no shard file
    of which is left (`remove_object`). The listing runs outside `lock`, the merge under it."""
    if not last_dir.is_dir():  # (a lost disk: no listing to go by)
        return
    listed = kvgc.scan_shards(last_dir)
    with lock:
        for key, (mtime, size) in listed.items():
            if key not in index:
                add(key, mtime, size * num_shards)
        for key in [k for k in index if k not in listed]:
            if disk_written_at(key) is None:  # (an object written after the listing is kept)
                remove_object(key)
