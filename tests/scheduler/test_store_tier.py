"""The prefix cache's store tier: a lookup and its load use the bytes read once, also when the
store's writer thread evicts or expires the objects in between (a size bound, periodic gc, or
another process sharing the directories) and however many objects the lookup read; an object
the store dropped is persisted again."""

from __future__ import annotations

import hashlib

from shoal.scheduler.host_tier import BLOCK_LOAD, BLOCK_PERSIST, SNAPSHOT_LOAD
from shoal.scheduler.store_tier import MAX_FETCHED, StoreTier, snapshot_key


class VanishingStore:
    """Each object reads back once, then it is gone (evicted by another thread)."""

    def __init__(self, objects: dict[bytes, bytes]) -> None:
        self.objects, self.touched, self.queued = dict(objects), [], set()

    def contains(self, key: bytes) -> bool:
        return key in self.objects

    def pending(self, key: bytes) -> bool:
        return key in self.queued

    def get(self, key: bytes) -> bytes | None:
        return self.objects.pop(key, None)

    def touch(self, key: bytes) -> None:
        self.touched.append(key)


def keys(n: int) -> list[bytes]:
    return [hashlib.sha256(bytes([i % 256, i // 256])).digest() for i in range(n)]


def test_an_object_removed_between_lookup_and_load_still_loads() -> None:
    key = bytes(range(32))
    store = VanishingStore({key: b"block", snapshot_key(key): b"\x01ring"})
    transfers: list = []
    tier = StoreTier(store, transfers)
    tier.begin_lookup()
    assert tier.has_block(key) and tier.block(key) == b"block"  # the lookup
    assert tier.snapshot(key) == (True, b"ring")
    assert not store.objects  # both evicted now
    assert tier.snapshot(key) == (True, b"ring")  # the load asks again
    tier.load_block(key, 3)
    tier.load_snapshot(key, 1)
    assert [(t.kind, t.device, t.data) for t in transfers] == [
        (BLOCK_LOAD, 3, b"block"), (SNAPSHOT_LOAD, 1, b"ring")]
    assert tier.snapshot(bytes(32)) is None


def test_a_lookup_of_more_objects_than_the_read_cache_holds_loads_them_all() -> None:
    """A long prompt restored from the store: its snapshot and every block stay readable for
    the load although the store dropped them and the lookup read past MAX_FETCHED."""
    blocks = keys(MAX_FETCHED + 10)
    last = blocks[-1]
    store = VanishingStore({**{k: k[:4] for k in blocks}, snapshot_key(last): b"\x00ring"})
    transfers: list = []
    tier = StoreTier(store, transfers)
    tier.begin_lookup()
    assert tier.snapshot(last) == (False, b"ring")  # as find(): the snapshot, then the blocks
    assert all(tier.block(k) == k[:4] for k in blocks)
    assert tier.snapshot(last) == (False, b"ring")  # as load()
    for i, k in enumerate(blocks):
        tier.load_block(k, i)
    tier.load_snapshot(last, 0)
    assert [t.data for t in transfers] == [k[:4] for k in blocks] + [b"ring"]


def test_an_object_the_store_dropped_is_persisted_again() -> None:
    key = bytes(range(32))
    store = VanishingStore({})
    transfers: list = []
    tier = StoreTier(store, transfers)
    tier.persist_block(key, 5)
    store.queued.add(key)  # the runner's put, not written yet: no second persist
    tier.persist_block(key, 5)
    store.queued.clear()
    store.objects[key] = b"block"  # written
    tier.persist_block(key, 5)
    del store.objects[key]  # evicted by the size bound
    tier.persist_block(key, 6)
    assert [(t.kind, t.device) for t in transfers] == [(BLOCK_PERSIST, 5), (BLOCK_PERSIST, 6)]
