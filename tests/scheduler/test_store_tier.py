"""The prefix cache's store tier: a lookup and its load use the bytes read once, also when the
store's writer thread evicts or expires the object in between (a size bound, periodic gc, or
another process sharing the directories)."""

from __future__ import annotations

from shoal.scheduler.host_tier import BLOCK_LOAD, SNAPSHOT_LOAD
from shoal.scheduler.store_tier import StoreTier, snapshot_key


class VanishingStore:
    """Each object reads back once, then it is gone (evicted by another thread)."""

    def __init__(self, objects: dict[bytes, bytes]) -> None:
        self.objects, self.touched = dict(objects), []

    def contains(self, key: bytes) -> bool:
        return key in self.objects

    def get(self, key: bytes) -> bytes | None:
        return self.objects.pop(key, None)

    def touch(self, key: bytes) -> None:
        self.touched.append(key)


def test_an_object_removed_between_lookup_and_load_still_loads() -> None:
    key = bytes(range(32))
    store = VanishingStore({key: b"block", snapshot_key(key): b"\x01ring"})
    transfers: list = []
    tier = StoreTier(store, transfers)
    assert tier.has_block(key) and tier.block(key) == b"block"  # the lookup
    assert tier.snapshot(key) == (True, b"ring")
    assert not store.objects  # both evicted now
    assert tier.snapshot(key) == (True, b"ring")  # the load asks again
    tier.load_block(key, 3)
    tier.load_snapshot(key, 1)
    assert [(t.kind, t.device, t.data) for t in transfers] == [
        (BLOCK_LOAD, 3, b"block"), (SNAPSHOT_LOAD, 1, b"ring")]
    assert tier.snapshot(bytes(32)) is None
