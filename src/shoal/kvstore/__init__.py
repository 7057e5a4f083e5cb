"""Persistent, content-addressed KV block store with 10 + 2 erasure coding: the disk tier of the
prefix cache. Standalone (no torch): opaque byte objects under 32-byte content keys.

- erasure.py: the k + m shard codec (any k shards rebuild an object)
- store.py: layout on disk, index, reads, background writer (`KVStore`)
- shard_file.py: a shard file's header and checksum
- config.py: its settings (`KVStoreConfig`: TTL, size bound, gc period) and counters
- gc.py: TTL expiry, removal of expired objects and orphaned temp files, LRU eviction
- sharing.py: several processes over one store's directories (others' objects, one bound)
"""

from shoal.kvstore.config import KVStoreConfig, KVStoreStats
from shoal.kvstore.erasure import ErasureCodec, InsufficientShardsError, decode, encode
from shoal.kvstore.gc import GcReport
from shoal.kvstore.store import KVStore

__all__ = ["ErasureCodec", "InsufficientShardsError", "encode", "decode", "GcReport", "KVStore",
           "KVStoreConfig", "KVStoreStats"]
