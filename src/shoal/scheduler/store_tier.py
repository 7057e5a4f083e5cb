"""The persistent tier of the prefix cache: blocks and ring snapshots in a content-addressed
store (`shoal.kvstore.KVStore`: 10 + 2 erasure-coded shards, checksums, TTL) that outlives the
process.

Writes go through: a block is persisted when it is registered, and a ring snapshot at the last
block boundary of a prompt (where the same prompt, or a longer one, resumes) and when a hit
first uses it; each becomes a `*_persist` transfer that the runner copies out and hands to the
store's background writer (a full queue drops it; the step never waits). Reads are the
scheduler's: `find` asks the store's index, the object is read and checked once (a corrupt or
expired object is a miss, never wrong KV) and its bytes travel in the plan as a `*_load`
transfer. A snapshot object is one byte (decoder rings exact) followed by the snapshot.

The store is passed in as an object with `contains(key)`, `pending(key)` (queued, not yet
written), `get(key)` and `touch(key)` (a hit restarts the object's time to live) (the
scheduler imports no package beyond the standard library).
"""

from __future__ import annotations

import hashlib
from typing import Any

from shoal.scheduler.host_tier import (
    BLOCK_LOAD,
    BLOCK_PERSIST,
    SNAPSHOT_LOAD,
    SNAPSHOT_PERSIST,
    Transfer,
)

MAX_FETCHED = 256  # objects earlier lookups read (a waiting head is looked up every step)


def snapshot_key(key: bytes) -> bytes:
    """The store key of the ring snapshot at the boundary after block `key`."""
    return hashlib.sha256(key + b"/ring-snapshot").digest()


class StoreTier:
    def __init__(self, store: Any, transfers: list[Transfer]) -> None:
        self.store = store
        self._transfers = transfers  # the prefix cache's list for the plan being built
        self._fetched: dict[bytes, bytes | None] = {}
        self._lookup: dict[bytes, bytes | None] = {}  # what the last lookup read (for its load)
        self.blocks_loaded = 0
        self.snapshots_loaded = 0

    # ---- writes -------------------------------------------------------------------------
    def persist_block(self, key: bytes, block_id: int) -> None:
        if self._absent(key):
            self._transfers.append(Transfer(BLOCK_PERSIST, block_id, key=key))

    def persist_snapshot(self, key: bytes, sid: int, decoder_exact: bool) -> None:
        skey = snapshot_key(key)
        if self._absent(skey):
            self._transfers.append(Transfer(SNAPSHOT_PERSIST, sid, key=skey,
                                            data=bytes([decoder_exact])))

    def _absent(self, key: bytes) -> bool:
        """Neither stored nor queued to be (an object the store evicted or expired is absent
        again; a second put of one still in flight only refreshes it)."""
        return not self.store.contains(key) and not self.store.pending(key)

    # ---- reads --------------------------------------------------------------------------
    def begin_lookup(self) -> None:
        """A new lookup: what it reads is kept for its load, however many objects it reads."""
        self._lookup = {}

    def has_block(self, key: bytes) -> bool:
        return self.store.contains(key)

    def block(self, key: bytes) -> bytes | None:
        """The block's bytes (read and checked once), None if unreadable."""
        return self._fetch(key)

    def snapshot(self, key: bytes) -> tuple[bool, bytes] | None:
        """(decoder rings exact, the snapshot's bytes) at the boundary after `key`, or None."""
        skey = snapshot_key(key)
        if skey not in self._lookup and skey not in self._fetched and \
                not self.store.contains(skey):
            return None
        data = self._fetch(skey)
        if not data:
            return None
        return bool(data[0]), data[1:]

    def load_block(self, key: bytes, block_id: int) -> None:
        data = self._take(key)
        self.store.touch(key)  # a hit keeps the object alive
        self._transfers.append(Transfer(BLOCK_LOAD, block_id, key=key, data=data))
        self.blocks_loaded += 1

    def load_snapshot(self, key: bytes, sid: int) -> None:
        data = self._take(snapshot_key(key))
        self.store.touch(snapshot_key(key))
        self._transfers.append(Transfer(SNAPSHOT_LOAD, sid, key=key, data=data[1:]))
        self.snapshots_loaded += 1

    def _take(self, key: bytes) -> bytes:
        """A fetched object for a load (read again if a long lookup pushed it out)."""
        data = self._lookup.get(key) or self._fetched.pop(key, None) or self.store.get(key)
        if data is None:
            raise RuntimeError(f"store object {key.hex()[:16]} vanished between lookup and load")
        return data

    def _fetch(self, key: bytes) -> bytes | None:
        """The object's bytes, read once: a lookup and the load after it use the same bytes,
        also when the store's writer evicts or expires the object in between."""
        if key not in self._lookup:
            if key not in self._fetched:
                if len(self._fetched) >= MAX_FETCHED:
                    self._fetched.pop(next(iter(self._fetched)))
                self._fetched[key] = self.store.get(key)
            self._lookup[key] = self._fetched[key]
        return self._lookup[key]
