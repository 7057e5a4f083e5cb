"""KVStore: objects survive a restart and the loss of any 2 of 12 directories, corrupt shards are
never served, expiry and gc follow the store's clock, I/O failures disable the store with one
warning, and a full write queue drops puts instead of blocking."""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import random
import shutil
import threading
import time

import pytest

from shoal.kvstore import KVStore, shard_file
from shoal.kvstore import store as store_mod


def key(i: int) -> bytes:
    return hashlib.sha256(b"block-%d" % i).digest()


def blob(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def flip(path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))


def kvs_files(root):
    return sorted(root.rglob("*.kvs"))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "shoal.kvstore" and r.levelno == logging.WARNING]


def test_reopen_reads_back_identical(tmp_path):
    objects = {key(i): blob(size, i) for i, size in enumerate([0, 1, 999, 65536, 262149])}
    with KVStore(tmp_path) as s:
        for k, v in objects.items():
            assert s.put(k, v)
        s.flush()
        before = s.stats()
        assert before.objects == 5 and before.enabled
    assert len(kvs_files(tmp_path)) == 5 * 12
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"d{i:02d}" for i in range(12)]
    assert before.bytes_on_disk == sum(p.stat().st_size for p in kvs_files(tmp_path))
    with KVStore(tmp_path) as s:
        st = s.stats()
        assert (st.objects, st.bytes_on_disk) == (5, before.bytes_on_disk)
        for k, v in objects.items():
            assert s.contains(k)
            assert s.get(k) == v
        assert not s.contains(key(99)) and s.get(key(99)) is None
        st = s.stats()
        assert (st.hits, st.misses, st.repaired_reads, st.lost_reads) == (5, 1, 0, 0)


@pytest.mark.parametrize("lost", [(0, 1), (4, 10), (10, 11)])
def test_two_lost_directories_still_identical(tmp_path, lost):
    objects = {key(i): blob(10_000 + 37 * i, i) for i in range(3)}
    with KVStore(tmp_path) as s:
        for k, v in objects.items():
            s.put(k, v)
        s.flush()
        for i in lost:  # while open
            shutil.rmtree(tmp_path / f"d{i:02d}")
        assert all(s.get(k) == v for k, v in objects.items())
    with KVStore(tmp_path) as s:  # and after a restart
        assert s.stats().objects == 3
        assert all(s.get(k) == v for k, v in objects.items())
        data_lost = any(i < 10 for i in lost)
        assert s.stats().repaired_reads == (3 if data_lost else 0)
        assert s.put(key(7), b"new") and (s.flush() or s.get(key(7)) == b"new")  # dirs recreated


def test_list_of_directories_and_other_k(tmp_path):
    dirs = [tmp_path / f"disk{i}" for i in range(6)]
    with KVStore(dirs, data_shards=4) as s:
        s.put(key(1), blob(5000, 1))
        s.flush()
    shutil.rmtree(dirs[0])
    shutil.rmtree(dirs[5])
    with KVStore(dirs, data_shards=4) as s:
        assert s.get(key(1)) == blob(5000, 1)


def test_corrupt_shards_repaired_or_lost_never_wrong(tmp_path):
    pairs = list(itertools.combinations(range(12), 2))
    objects = {key(i): blob(3000, i) for i in range(len(pairs) + 2)}
    with KVStore(tmp_path, max_queue=len(objects)) as s:
        assert all([s.put(k, v) for k, v in objects.items()])
        s.flush()
        keys = list(objects)
        hsize = shard_file.HEADER.size
        for k, (a, b) in zip(keys, pairs, strict=False):  # every pair of shards corrupted
            flip(s.shard_path(a, k), hsize + 17)
            flip(s.shard_path(b, k), 40)  # a header byte (object length), checksummed too
        for k, (a, b) in zip(keys, pairs, strict=False):
            assert s.get(k) == objects[k], (a, b)
        st = s.stats()
        # All but (10, 11) hit a data shard; with only parity corrupt, parity is never read.
        assert (st.hits, st.repaired_reads, st.lost_reads) == (66, 65, 0)
        three = keys[66]
        for i in (0, 5, 11):
            flip(s.shard_path(i, three), hsize + 1)
        assert s.get(three) is None
        st = s.stats()
        assert (st.lost_reads, st.misses, st.objects) == (1, 1, len(objects) - 1)
        assert not s.contains(three)
        assert not any(s.shard_path(i, three).exists() for i in range(12))
        # a put after the loss writes the object again
        s.put(three, objects[three])
        s.flush()
        assert s.get(three) == objects[three]


def test_shards_of_another_object_or_index_are_rejected(tmp_path):
    a, b = key(1), key(2)
    with KVStore(tmp_path) as s:
        s.put(a, blob(4000, 1))
        s.put(b, blob(4000, 2))
        s.flush()
        # b's shard 0 under a's name: a valid checksum, but the wrong key
        shutil.copy(s.shard_path(0, b), s.shard_path(0, a))
        assert s.get(a) == blob(4000, 1)
        # a's shard 1 copied into slots 2 and 3: right key, wrong index -> 3 bad shards
        shutil.copy(s.shard_path(1, a), s.shard_path(2, a))
        shutil.copy(s.shard_path(1, a), s.shard_path(3, a))
        assert s.get(a) is None
        assert s.stats().lost_reads == 1
        assert s.get(b) == blob(4000, 2)


def test_expired_objects_miss_and_gc_removes_their_files(tmp_path):
    clock = FakeClock()
    with KVStore(tmp_path, ttl_s=100, clock=clock) as s:
        s.put(key(1), b"old")
        s.flush()
        clock.t += 99
        assert s.get(key(1)) == b"old"
        s.put(key(2), b"young")
        s.flush()
        clock.t += 1
        assert not s.contains(key(1)) and s.get(key(1)) is None
        assert s.shard_path(0, key(1)).exists()  # a miss before gc, files still there
        report = s.gc()
        assert (report.expired, report.bytes_freed > 0) == (1, True)
        assert not any(s.shard_path(i, key(1)).exists() for i in range(12))
        assert s.get(key(2)) == b"young"
        st = s.stats()
        assert (st.objects, st.expired_removed) == (1, 1)
        assert st.bytes_on_disk == sum(p.stat().st_size for p in kvs_files(tmp_path))


def test_reput_refreshes_without_rewriting_and_persists(tmp_path):
    clock = FakeClock()
    with KVStore(tmp_path, ttl_s=100, clock=clock) as s:
        s.put(key(1), b"block")
        s.flush()
        path = s.shard_path(3, key(1))
        inode, content = path.stat().st_ino, path.read_bytes()
        clock.t += 90
        assert s.put(key(1), b"block")
        s.flush()
        assert (path.stat().st_ino, path.read_bytes()) == (inode, content)  # not rewritten
        assert path.stat().st_mtime == pytest.approx(clock.t)
        clock.t += 50  # 140 s after the write, 50 after the refresh
        assert s.get(key(1)) == b"block"
    with KVStore(tmp_path, ttl_s=100, clock=clock) as s:  # the refresh survives a restart
        assert s.contains(key(1))
    clock.t += 50
    with KVStore(tmp_path, ttl_s=100, clock=clock) as s:  # gc on open
        st = s.stats()
        assert (st.objects, st.expired_removed) == (0, 1)
    assert kvs_files(tmp_path) == []
    with KVStore(tmp_path, ttl_s=8 * 86400, clock=clock) as s:  # TTL beyond a week is allowed
        assert s.config.ttl_s == 8 * 86400


def test_open_removes_orphaned_temps_and_incomplete_objects(tmp_path):
    with KVStore(tmp_path) as s:
        s.put(key(1), b"kept")
        s.flush()
        hexkey = key(2).hex()
    temp = tmp_path / "d00" / hexkey[:2] / f"{hexkey}.deadbeef.tmp"
    temp.parent.mkdir(parents=True, exist_ok=True)
    temp.write_bytes(b"half a shard")
    partial = [tmp_path / f"d{i:02d}" / hexkey[:2] / f"{hexkey}.kvs" for i in range(5)]
    for p in partial:  # a writer that died after 5 of 12 shards
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 100)
    with KVStore(tmp_path, orphan_age_s=0) as s:  # (stale at once)
        st = s.stats()
        assert (st.objects, st.orphans_removed) == (1, 2)
        assert not temp.exists() and not any(p.exists() for p in partial)
        assert s.get(key(1)) == b"kept"


@pytest.mark.parametrize("blocker", ["root", "one_dir"])
def test_unusable_directory_disables_with_one_warning(tmp_path, caplog, blocker):
    # A regular file where a directory is expected (chmod would not stop root).
    if blocker == "root":
        root = tmp_path / "root"
        root.write_bytes(b"")
    else:
        root = tmp_path
        (tmp_path / "d05").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="shoal.kvstore"):
        s = KVStore(root)
        assert not s.enabled
        assert s.put(key(1), b"data") is False
        s.flush()
        assert s.get(key(1)) is None and not s.contains(key(1))
        assert s.gc().expired == 0
        s.close()
    st = s.stats()
    assert (st.enabled, st.puts, st.dropped_puts, st.misses) == (False, 1, 1, 1)
    assert len(warnings_of(caplog)) == 1


def test_failed_write_stops_writes_with_one_warning_and_reads_go_on(tmp_path, caplog,
                                                                     monkeypatch):
    def no_space(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    with KVStore(tmp_path) as s, caplog.at_level(logging.WARNING, logger="shoal.kvstore"):
        s.put(key(1), b"kept")
        s.flush()
        monkeypatch.setattr(store_mod.os, "replace", no_space)
        s.put(key(2), b"a")
        s.put(key(3), b"b")
        s.flush()
        assert s.enabled and not s.stats().writable
        assert s.put(key(4), b"c") is False
        assert s.get(key(1)) == b"kept" and s.get(key(2)) is None  # the whole object still hits
        st = s.stats()
        assert (st.puts, st.dropped_puts) == (4, 3)
    assert len(warnings_of(caplog)) == 1
    assert "No space left" in warnings_of(caplog)[0]
    assert list(tmp_path.rglob("*.tmp")) == []  # no temp file left behind
    assert len(kvs_files(tmp_path)) == 12  # only the object written before the failure


def test_full_queue_drops_puts_without_blocking(tmp_path, monkeypatch):
    started, release = threading.Event(), threading.Event()
    write = KVStore._write_object

    def blocked_write(self, k, data):
        started.set()
        assert release.wait(10)
        write(self, k, data)

    monkeypatch.setattr(KVStore, "_write_object", blocked_write)
    with KVStore(tmp_path, max_queue=2) as s:
        assert s.put(key(0), b"0")
        assert started.wait(10)  # the writer holds key 0; the queue is empty
        assert s.put(key(1), b"1") and s.put(key(2), b"2")
        t0 = time.perf_counter()
        assert s.put(key(3), b"3") is False
        assert s.put(key(4), b"4") is False
        assert time.perf_counter() - t0 < 0.5
        assert s.stats().dropped_puts == 2
        release.set()
        s.flush()
        assert [s.get(key(i)) for i in range(5)] == [b"0", b"1", b"2", None, None]
        assert s.stats().puts == 5


def test_bad_settings_and_keys_raise_value_error(tmp_path):
    for kwargs, name in [({"ttl_s": 0}, "ttl_s"), ({"max_queue": 0}, "max_queue"),
                         ({"num_dirs": 10}, "num_dirs"), ({"data_shards": 0}, "data_shards")]:
        with pytest.raises(ValueError, match=name):
            KVStore(tmp_path, **kwargs)
    with pytest.raises(ValueError, match="distinct"):
        KVStore([tmp_path / "a"] * 12)
    with KVStore(tmp_path) as s:
        with pytest.raises(ValueError, match="key must be 32 bytes"):
            s.put(b"short", b"x")
        with pytest.raises(ValueError, match="key must be 32 bytes"):
            s.get("0" * 32)  # type: ignore[arg-type]


def test_shards_of_two_writes_of_one_key_are_never_mixed(tmp_path):
    """Two processes putting one key with different bytes at once can leave shards of both
    writes: the object is rebuilt from one write's shards (whichever has k), never a mix."""
    a, b = tmp_path / "a", tmp_path / "b"
    for root, seed in ((a, 1), (b, 2)):
        with KVStore(root) as s:
            s.put(key(1), blob(6000, seed))
            s.flush()
    with KVStore(a) as s:
        paths = [s.shard_path(i, key(1)) for i in range(12)]
    mixed = tmp_path / "m"
    for mix in ((0,), (3, 7), (0, 1, 2, 3, 4, 5)):  # shards i of write b over write a's
        shutil.rmtree(mixed, ignore_errors=True)
        for i, path in enumerate(paths):
            rel = path.relative_to(a)
            (mixed / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy((b if i in mix else a) / rel, mixed / rel)
        with KVStore(mixed) as s:  # 11 or 10 of write a: a; 6 and 6: lost, a miss
            assert s.get(key(1)) == (blob(6000, 1) if len(mix) <= 2 else None), mix


def test_another_process_writes_in_flight_are_left_alone(tmp_path):
    """A young temp file or incomplete object (a live writer's) survives an open; once stale it
    is removed."""
    hexkey = key(2).hex()
    temp = tmp_path / "d00" / hexkey[:2] / f"{hexkey}.deadbeef.tmp"
    temp.parent.mkdir(parents=True, exist_ok=True)
    temp.write_bytes(b"half a shard")
    partial = tmp_path / "d01" / hexkey[:2] / f"{hexkey}.kvs"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(b"x" * 100)
    with KVStore(tmp_path) as s:  # default age: both are young
        assert s.stats().orphans_removed == 0 and temp.exists() and partial.exists()
        assert not s.contains(key(2))
    with KVStore(tmp_path, orphan_age_s=0) as s:
        assert s.stats().orphans_removed == 2 and not temp.exists() and not partial.exists()


def test_a_hit_restarts_the_time_to_live(tmp_path):
    clock = FakeClock()
    with KVStore(tmp_path, ttl_s=100, clock=clock) as s:
        s.put(key(1), b"used")
        s.flush()
        clock.t += 80
        s.touch(key(1))
        s.flush()
        clock.t += 80  # 160 s after the write, 80 after the touch
        assert s.get(key(1)) == b"used"
        s.touch(key(3))  # absent: nothing queued, nothing written
        s.flush()
        assert not s.contains(key(3))


def test_store_settings_are_checked_and_name_what_changes_the_kv(tmp_path, monkeypatch):
    """Bad tier settings fail at once, naming the option; the hash salt separates exact from
    bounded resumes and does not depend on how the checkpoint's path was written."""
    from shoal import LLM
    from shoal.checkpoint import write_checkpoint
    from shoal.config import EngineConfig, ShoalError
    from shoal.model.presets import TINY

    (tmp_path / "file").write_bytes(b"")
    for options, message in (
            ({"kv_store_path": str(tmp_path / "kv")}, "needs enable_prefix_caching"),
            ({"enable_prefix_caching": True, "kv_store_path": str(tmp_path / "file")},
             "expected a directory"),
            ({"enable_prefix_caching": True, "kv_host_memory_gb": float("nan")},
             "kv_host_memory_gb"),
            ({"enable_prefix_caching": True, "kv_host_memory_gb": float("inf")},
             "kv_host_memory_gb"),
            ({"enable_prefix_caching": True, "kv_store_ttl_days": float("nan")},
             "kv_store_ttl_days")):
        with pytest.raises(ShoalError, match=message):
            EngineConfig.create("tiny", device="cpu", **options)
    ckpt = write_checkpoint(TINY, tmp_path / "ck", seed=0)

    def salt(model: str, resume: str) -> bytes:
        llm = LLM(model, device="cpu", enable_prefix_caching=True, prefix_resume=resume,
                  max_model_len=64)
        return llm.engine.executor.prefix_cache_spec().salt

    exact = salt(str(ckpt), "exact")
    assert salt(str(ckpt), "bounded") != exact
    monkeypatch.chdir(tmp_path)
    assert salt("ck", "exact") == exact
