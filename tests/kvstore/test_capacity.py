"""KVStore size bound and periodic gc: past `max_bytes` the writer evicts least recently used
objects (never the one just written) down to EVICT_TO of the bound, an object over the bound
alone is refused, an open over the bound evicts at once, the writer collects expired objects
without a reopen, and a second store over the same directories takes an object the first
evicted as a miss."""

from __future__ import annotations

import logging
import time

import pytest

from kvstore.test_store import FakeClock, blob, key, kvs_files, warnings_of
from shoal.kvstore import KVStore
from shoal.kvstore.store import EVICT_TO

SIZE = 1000  # bytes of each object's data (the `object_bytes` fixture: conftest.py)


def on_disk(root) -> int:
    return sum(p.stat().st_size for p in kvs_files(root))


def put_at(s: KVStore, clock: FakeClock, i: int) -> None:
    """Put object i one second after the last write (a distinct `written_at` each)."""
    clock.t += 1
    assert s.put(key(i), blob(SIZE, i))
    s.flush()


def test_eviction_is_least_recently_used(tmp_path, object_bytes):
    clock = FakeClock()
    # room for 3.5 objects: the 4th write evicts one (4 -> 3 <= 3.15 objects)
    with KVStore(tmp_path, max_bytes=int(3.5 * object_bytes), clock=clock) as s:
        for i in range(3):
            put_at(s, clock, i)
        clock.t += 1
        s.touch(key(0))  # a hit: the oldest write is now the most recently used
        s.flush()
        put_at(s, clock, 3)
        assert [s.contains(key(i)) for i in range(4)] == [True, False, True, True]
        assert not any(s.shard_path(i, key(1)).exists() for i in range(12))
        assert s.get(key(0)) == blob(SIZE, 0)
        st = s.stats()
        assert (st.objects, st.evicted, st.bytes_evicted) == (3, 1, object_bytes)
        assert st.bytes_on_disk == on_disk(tmp_path) == 3 * object_bytes


def test_bound_holds_after_many_puts(tmp_path, object_bytes):
    bound = int(5.5 * object_bytes)
    clock = FakeClock()
    with KVStore(tmp_path, max_bytes=bound, clock=clock) as s:
        for i in range(30):
            put_at(s, clock, i)
            assert s.stats().bytes_on_disk <= bound
        st = s.stats()
        assert st.bytes_on_disk == on_disk(tmp_path) <= bound
        # every other put from the 6th overflows, and evicts to EVICT_TO of the bound: 6 -> 4
        assert int(EVICT_TO * bound) // object_bytes == 4 and st.objects == 4
        assert st.evicted == 30 - st.objects and st.bytes_evicted == st.evicted * object_bytes
        newest = range(30 - st.objects, 30)
        assert all(s.get(key(i)) == blob(SIZE, i) for i in newest)


def test_the_object_just_written_is_never_evicted(tmp_path, object_bytes):
    clock = FakeClock()
    # one object fills the bound: reaching EVICT_TO of it would take the new object too
    with KVStore(tmp_path, max_bytes=object_bytes, clock=clock) as s:
        for i in range(3):
            put_at(s, clock, i)
            assert s.get(key(i)) == blob(SIZE, i)
        st = s.stats()
        assert (st.objects, st.evicted, st.bytes_on_disk) == (1, 2, object_bytes)


def test_an_object_over_the_bound_alone_is_refused_and_counted(tmp_path, object_bytes):
    clock = FakeClock()
    with KVStore(tmp_path, max_bytes=2 * object_bytes, clock=clock) as s:
        put_at(s, clock, 0)
        assert s.put(key(1), blob(10 * SIZE, 1))  # queued, refused by the writer
        s.flush()
        assert not s.contains(key(1)) and s.get(key(1)) is None
        assert not s.shard_path(0, key(1)).exists() and list(tmp_path.rglob("*.tmp")) == []
        st = s.stats()
        assert (st.oversized_puts, st.dropped_puts, st.evicted, st.objects) == (1, 1, 0, 1)
        assert st.writable and s.get(key(0)) == blob(SIZE, 0)  # nothing else changed


def test_open_over_a_new_smaller_bound_evicts_at_once(tmp_path, object_bytes):
    clock = FakeClock()
    with KVStore(tmp_path, clock=clock) as s:
        for i in range(6):
            put_at(s, clock, i)
    with KVStore(tmp_path, max_bytes=int(3.5 * object_bytes), clock=clock) as s:
        st = s.stats()  # written_at from the files' mtimes: the oldest three go
        assert (st.objects, st.evicted, st.bytes_on_disk) == (3, 3, 3 * object_bytes)
        assert [s.contains(key(i)) for i in range(6)] == [False] * 3 + [True] * 3
        assert on_disk(tmp_path) == 3 * object_bytes


def test_the_writer_collects_expired_objects_without_a_reopen(tmp_path):
    clock = FakeClock()
    with KVStore(tmp_path, ttl_s=100, clock=clock) as s:  # gc every 10 s of the clock
        assert s.config.gc_every_s == 10
        put_at(s, clock, 1)
        clock.t += 100
        put_at(s, clock, 2)  # the writer wakes for this put, then finds gc due
        assert not any(s.shard_path(i, key(1)).exists() for i in range(12))
        st = s.stats()
        assert (st.expired_removed, st.objects) == (1, 1)
        assert st.bytes_on_disk == on_disk(tmp_path)


def test_an_idle_writer_wakes_for_gc(tmp_path):
    clock = FakeClock()
    with KVStore(tmp_path, ttl_s=100, gc_interval_s=0.05, clock=clock) as s:
        put_at(s, clock, 1)
        clock.t += 100
        deadline = time.monotonic() + 5
        while s.stats().expired_removed == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.stats().expired_removed == 1 and kvs_files(tmp_path) == []


def test_another_store_takes_an_object_evicted_by_the_first_as_a_miss(tmp_path, object_bytes,
                                                                      caplog):
    """Two processes' stores over one directory set: each has its own index, so one's eviction
    removes files the other indexes; the other's read is a plain miss, and a put rewrites it."""
    clock = FakeClock()
    with KVStore(tmp_path, max_bytes=int(2.5 * object_bytes), clock=clock) as first:
        put_at(first, clock, 0)
        put_at(first, clock, 1)
        with KVStore(tmp_path, clock=clock) as second, \
                caplog.at_level(logging.DEBUG, logger="shoal.kvstore"):
            assert second.contains(key(0)) and second.contains(key(1))
            put_at(first, clock, 2)  # evicts object 0
            assert not first.contains(key(0)) and first.stats().evicted == 1
            second.touch(key(0))  # a refresh of vanished files: no error
            second.flush()
            assert second.get(key(0)) is None
            assert second.get(key(1)) == blob(SIZE, 1)
            st = second.stats()
            assert (st.misses, st.lost_reads, st.hits, st.writable) == (1, 0, 1, True)
            assert not second.contains(key(0))
            assert second.put(key(0), blob(SIZE, 0))
            second.flush()
            assert second.get(key(0)) == blob(SIZE, 0)
        assert warnings_of(caplog) == []
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_an_object_another_store_uses_is_neither_evicted_nor_expired(tmp_path, object_bytes):
    """Store a's index keeps the time of a's own write; b's hits move the files' mtime, and
    a's eviction and gc read it before removing an object, so b's working set stays."""
    clock = FakeClock()
    start = clock.t
    with KVStore(tmp_path, ttl_s=100, max_bytes=int(2.5 * object_bytes), clock=clock) as a:
        put_at(a, clock, 0)  # start + 1
        put_at(a, clock, 1)  # start + 2
        with KVStore(tmp_path, ttl_s=100, clock=clock) as b:
            clock.t += 1
            b.touch(key(0))  # b uses object 0
            b.flush()
            put_at(a, clock, 2)  # over the bound: 1 goes, not 0 (the oldest in a's index)
            assert [a.contains(key(i)) for i in range(3)] == [True, False, True]
            clock.t = start + 50
            b.touch(key(0))
            b.flush()
            clock.t = start + 105  # 100 s after a's writes of 0 and 2; 55 s after b's hit
            assert a.gc().expired == 1
            assert a.contains(key(0)) and not a.contains(key(2))
            assert b.get(key(0)) == blob(SIZE, 0)


def test_a_put_queued_behind_the_write_that_evicts_its_object_writes_it(tmp_path,
                                                                        object_bytes):
    """A put of a present object queues its data: if a write ahead of it evicts the object,
    the put writes it again (it is not a lost refresh); `pending` shows it until then."""
    clock = FakeClock()
    with KVStore(tmp_path, max_bytes=int(2.5 * object_bytes), clock=clock) as s:
        put_at(s, clock, 0)
        put_at(s, clock, 1)
        clock.t += 1
        with s._io_lock:  # the writer waits: both puts queue behind its first
            assert s.put(key(2), blob(SIZE, 2)) and s.put(key(0), blob(SIZE, 0))
            assert s.pending(key(0)) and s.contains(key(0))
        s.flush()  # 2 evicts 0; then 0 is written again (and evicts 1)
        assert s.get(key(0)) == blob(SIZE, 0) and not s.pending(key(0))
        st = s.stats()
        assert (st.evicted, st.dropped_puts) == (2, 0)


def test_bad_bound_or_gc_period_raises_value_error(tmp_path):
    for kwargs, name in [({"max_bytes": 0}, "max_bytes"), ({"max_bytes": float("inf")},
                                                           "max_bytes"),
                         ({"max_bytes": float("nan")}, "max_bytes"),
                         ({"gc_interval_s": 0}, "gc_interval_s")]:
        with pytest.raises(ValueError, match=name):
            KVStore(tmp_path, **kwargs)
    with KVStore(tmp_path, ttl_s=30 * 86400) as s:
        assert s.config.gc_every_s == 3600  # a tenth of the TTL, at most an hour


def test_engine_option_is_checked_and_reaches_the_store(tmp_path):
    from shoal import LLM
    from shoal.config import EngineConfig, ShoalError

    store = str(tmp_path / "kv")
    for value in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ShoalError, match="kv_store_max_gb: got"):
            EngineConfig.create("tiny", device="cpu", enable_prefix_caching=True,
                                kv_store_path=store, kv_store_max_gb=value)
    with pytest.raises(ShoalError, match="kv_store_max_gb: .* needs kv_store_path"):
        EngineConfig.create("tiny", device="cpu", enable_prefix_caching=True,
                            kv_store_max_gb=1.0)
    llm = LLM("tiny", device="cpu", enable_prefix_caching=True, kv_store_path=store,
              kv_store_max_gb=2.5, max_model_len=64)
    assert llm.engine.executor.kv_store.config.max_bytes == 2_500_000_000
