"""The KV store tests' shared fixture."""

from __future__ import annotations

import pytest

from kvstore.test_capacity import SIZE
from kvstore.test_store import blob, key
from shoal.kvstore import KVStore


@pytest.fixture(scope="module")
def object_bytes(tmp_path_factory) -> int:
    """Shard file bytes of one SIZE-byte object (all such objects take the same)."""
    with KVStore(tmp_path_factory.mktemp("probe")) as s:
        s.put(key(0), blob(SIZE))
        s.flush()
        return s.stats().bytes_on_disk
