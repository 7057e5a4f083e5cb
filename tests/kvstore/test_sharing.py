"""Several stores (processes) over one directory set: an object another store wrote after this
one opened is a hit and joins this index on its first refresh; an object whose last shard is
not yet written is not; with a size bound the stores' rescans keep the directories under it
(each store alone would hold the bound), and rescans drop objects another store removed."""

from __future__ import annotations

from kvstore.test_capacity import SIZE, on_disk, put_at
from kvstore.test_store import FakeClock, blob, key
from shoal.kvstore import KVStore
from shoal.kvstore.sharing import RESCAN_EVERY


def test_an_object_written_by_another_store_after_open_is_a_hit(tmp_path):
    clock = FakeClock()
    with KVStore(tmp_path, ttl_s=100, clock=clock) as a, \
            KVStore(tmp_path, ttl_s=100, clock=clock) as b:
        assert not a.contains(key(1))
        put_at(b, clock, 1)
        assert a.contains(key(1)) and a.get(key(1)) == blob(SIZE, 1)
        assert a.stats().objects == 0  # on disk, not yet in a's index
        clock.t += 60
        a.touch(key(1))  # a's hit: indexed and refreshed for every store
        a.flush()
        assert a.stats().objects == 1
        clock.t += 60  # 120 s after b's write, 60 s after a's hit
        assert a.contains(key(1)) and b.gc().expired == 0 and b.contains(key(1))
        assert a.put(key(1), blob(SIZE, 9))  # present: refreshed, not rewritten
        a.flush()
        assert b.get(key(1)) == blob(SIZE, 1) and a.stats().dropped_puts == 0
        clock.t += 101
        assert not a.contains(key(1))  # expired by its files' time too


def test_an_object_without_its_last_shard_is_not_a_hit(tmp_path):
    """A write renames its shards in order: until the last is there, another store misses."""
    with KVStore(tmp_path) as a, KVStore(tmp_path) as b:
        b.put(key(2), blob(SIZE, 2))
        b.flush()
        last = b.shard_path(11, key(2))
        held = last.read_bytes()
        last.unlink()  # as if b were still writing it
        assert not a.contains(key(2)) and a.get(key(2)) is None
        assert all(b.shard_path(i, key(2)).exists() for i in range(11))  # left alone
        last.write_bytes(held)
        assert a.get(key(2)) == blob(SIZE, 2)


def test_the_bound_holds_for_stores_sharing_the_directories(tmp_path, object_bytes):
    """Two stores each bounded at 20 objects write 30 each: together the files stay within
    the bound (plus each one's writes between rescans), the most recent objects stay, and each
    index counts the other's objects."""
    clock = FakeClock()
    bound = 20 * object_bytes
    with KVStore(tmp_path, max_bytes=bound, clock=clock) as a, \
            KVStore(tmp_path, max_bytes=bound, clock=clock) as b:
        for i in range(30):
            put_at(a, clock, 2 * i)
            put_at(b, clock, 2 * i + 1)
            assert on_disk(tmp_path) <= bound * (1 + 2 * RESCAN_EVERY) + object_bytes
        assert on_disk(tmp_path) <= bound
        assert all(a.contains(key(i)) and b.contains(key(i)) for i in range(56, 60))
        assert not a.contains(key(0)) and not b.contains(key(1))
        assert a.stats().objects > 10 and b.stats().objects > 10  # both stores' objects
        assert a.stats().evicted + b.stats().evicted >= 40


def test_a_rescan_drops_objects_another_store_removed(tmp_path, object_bytes):
    clock = FakeClock()
    with KVStore(tmp_path, clock=clock) as b:
        for i in range(3):
            put_at(b, clock, i)
    with KVStore(tmp_path, max_bytes=100 * object_bytes, clock=clock) as a:
        assert a.stats().objects == 3
        for i in range(3):
            for d in range(12):
                a.shard_path(d, key(i)).unlink()
        put_at(a, clock, 10)
        for i in range(11, 16):  # 5 objects of 100: past RESCAN_EVERY of the bound
            put_at(a, clock, i)
        st = a.stats()
        assert st.objects == 6 and st.bytes_on_disk == on_disk(tmp_path) == 6 * object_bytes


def test_a_put_of_an_object_another_store_removed_writes_it(tmp_path, object_bytes):
    """a's index still lists block 0 after b evicted it: a's put writes it again (not a
    refresh of files that are gone), and a touch of such an object forgets it."""
    clock = FakeClock()
    with KVStore(tmp_path, clock=clock) as a, \
            KVStore(tmp_path, max_bytes=3 * object_bytes, clock=clock) as b:
        put_at(a, clock, 0)
        put_at(a, clock, 1)
        for i in range(2, 10):
            put_at(b, clock, i)
        assert not b.shard_path(11, key(0)).exists() and a.stats().objects == 2
        put_at(a, clock, 0)
        assert a.get(key(0)) == blob(SIZE, 0) and a.stats().dropped_puts == 0
        a.touch(key(1))
        a.flush()
        assert not a.contains(key(1)) and a.stats().objects == 1


def test_a_read_during_another_stores_removal_is_a_plain_miss(tmp_path, monkeypatch,
                                                             object_bytes):
    """b removes an object, its last shard first; a read by a before b's last unlink finds no
    last shard: a plain miss that leaves b's files to b, never a lost read."""
    from shoal.kvstore import store as store_mod

    clock = FakeClock()
    with KVStore(tmp_path, ttl_s=100, clock=clock) as a, \
            KVStore(tmp_path, max_bytes=int(1.5 * object_bytes), clock=clock) as b:
        put_at(b, clock, 1)
        assert a.contains(key(1))
        a.touch(key(1))  # indexed by a
        a.flush()
        real, seen = store_mod.kvgc.unlink_quiet, []

        def unlink(path):
            if str(path) == str(b.shard_path(0, key(1))) and not seen:  # b's last unlink
                seen.append((a.contains(key(1)), a.get(key(1)),
                             sum(b.shard_path(i, key(1)).exists() for i in range(12))))
            return real(path)

        monkeypatch.setattr(store_mod.kvgc, "unlink_quiet", unlink)
        put_at(b, clock, 2)  # b evicts object 1
        assert b.stats().evicted == 1
        assert seen == [(True, None, 1)]  # a's index still said yes; the read missed
        st = a.stats()
        assert (st.lost_reads, st.misses, st.objects) == (0, 1, 0)


def test_an_adopted_object_counts_against_the_bound(tmp_path, object_bytes):
    """A store that only reads indexes another store's objects as it refreshes them, and
    keeps its bound with them."""
    clock = FakeClock()
    with KVStore(tmp_path, clock=clock) as writer, \
            KVStore(tmp_path, max_bytes=int(2.5 * object_bytes), clock=clock) as reader:
        for i in range(4):
            put_at(writer, clock, i)
        for i in range(4):
            clock.t += 1
            reader.touch(key(i))
            reader.flush()
        assert reader.stats().objects <= 2 and reader.stats().evicted >= 2
        assert on_disk(tmp_path) <= 2.5 * object_bytes


def test_a_hit_on_an_object_whose_last_shard_is_lost_keeps_it(tmp_path):
    """A lost last-shard disk (the store survives two): a read rebuilds the object from the
    others, and the hit's refresh keeps it (a refresh asks for any shard of an indexed
    object, not only the last)."""
    import shutil

    with KVStore(tmp_path) as s:
        s.put(key(1), blob(10_000, 1))
        s.flush()
        shutil.rmtree(tmp_path / "d11")
        for _ in range(2):
            assert s.get(key(1)) == blob(10_000, 1)
            s.touch(key(1))
            s.flush()
        assert s.stats().objects == 1
