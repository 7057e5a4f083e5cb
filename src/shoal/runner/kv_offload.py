"""The prefix cache's tiers beyond the device, runner side: pinned host copies of paged KV blocks
and ring snapshots, and the bytes written to and read from the persistent store; it runs the
copies a plan's `transfers` ask for (`scheduler/host_tier.py`, `scheduler/store_tier.py` decide
them).

A host block slot holds one block of every kv source's compressed-KV and index-K planes (rows
`block * rows_per_block ..` of each); a host snapshot slot one ring snapshot. A block's bytes in
the store are those planes in layout order (compressed, then index keys, per source). Copies are
queued on the current stream before the step's forward, non-blocking from / to pinned memory
(on CUDA), in the plan's order, so a block's copy out precedes the writes of its new owner and
a copy in precedes every read. A persist copies into a fresh pinned buffer and hands it, with
an event, to a writer thread that waits for the event and queues the bytes on the store (whose
own writer does the disk work); a full queue drops the write, so a step never waits for disk.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from shoal.model.cache_layout import CacheLayout
from shoal.model.state import KVCaches
from shoal.scheduler.host_tier import (
    BLOCK_IN,
    BLOCK_LOAD,
    BLOCK_OUT,
    BLOCK_PERSIST,
    SNAPSHOT_IN,
    SNAPSHOT_LOAD,
    SNAPSHOT_OUT,
    SNAPSHOT_PERSIST,
    Transfer,
)

logger = logging.getLogger(__name__)
MAX_PENDING_PERSISTS = 256


def host_slots(layout: CacheLayout, budget_bytes: int) -> tuple[int, int]:
    """(block slots, snapshot slots) of a host budget: a quarter for snapshots, the rest for
    blocks."""
    snap = layout.bytes_per_snapshot
    num_snapshots = budget_bytes // 4 // snap if snap else 0
    num_blocks = (budget_bytes - num_snapshots * snap) // layout.bytes_per_block
    return int(num_blocks), int(num_snapshots)


class KVOffload:
    """Host slots (`num_blocks`, `num_snapshots`; 0 and 0 without a host tier) and the store."""

    def __init__(self, layout: CacheLayout, num_blocks: int, num_snapshots: int,
                 device: torch.device, store: Any = None) -> None:
        self.pin = device.type == "cuda"
        self.num_blocks, self.num_snapshots = num_blocks, num_snapshots
        self.rows = {s.layer_id: s.rows_per_block for s in layout.sources}
        self.compressed = {s.layer_id: self._empty(num_blocks * s.rows_per_block,
                                                   s.compressed_record_bytes)
                           for s in layout.sources}
        self.index_k = {s.layer_id: self._empty(num_blocks * s.rows_per_block,
                                                s.index_record_bytes) for s in layout.sources}
        self.snapshots = self._empty(num_snapshots, layout.snapshot_layers,
                                     layout.snapshot_window, layout.swa_record_bytes)
        self.store = store
        self.dropped_persists = 0
        self._persists: queue.Queue = queue.Queue(maxsize=MAX_PENDING_PERSISTS)
        if store is not None:
            threading.Thread(target=self._writer, name="shoal-kv-persist", daemon=True).start()
            atexit.register(self.flush)  # the writes queued when the process ends land

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.uint8, pin_memory=self.pin)

    def _block_planes(self, caches: KVCaches, block: int) -> list[torch.Tensor]:
        """Device views of one block in every source's planes, in the store's byte order."""
        planes = []
        for source, rpb in self.rows.items():
            rows = slice(block * rpb, (block + 1) * rpb)
            planes += [caches.compressed[source][rows], caches.index_k[source][rows]]
        return planes

    def _host_planes(self, slot: int) -> list[torch.Tensor]:
        planes = []
        for source, rpb in self.rows.items():
            rows = slice(slot * rpb, (slot + 1) * rpb)
            planes += [self.compressed[source][rows], self.index_k[source][rows]]
        return planes

    def apply(self, caches: KVCaches, transfers: Sequence[Transfer]) -> None:
        for t in transfers:
            if t.kind in (BLOCK_OUT, BLOCK_IN):
                pairs = zip(self._block_planes(caches, t.device), self._host_planes(t.host),
                            strict=True)
                for dev, host in pairs:
                    if t.kind == BLOCK_OUT:
                        host.copy_(dev, non_blocking=True)
                    else:
                        dev.copy_(host, non_blocking=True)
            elif t.kind == SNAPSHOT_OUT:
                self.snapshots[t.host].copy_(caches.snapshots[t.device], non_blocking=True)
            elif t.kind == SNAPSHOT_IN:
                caches.snapshots[t.device].copy_(self.snapshots[t.host], non_blocking=True)
            elif t.kind == BLOCK_PERSIST:
                self._persist(t, self._block_planes(caches, t.device))
            elif t.kind == SNAPSHOT_PERSIST:
                self._persist(t, [caches.snapshots[t.device]])
            elif t.kind in (BLOCK_LOAD, SNAPSHOT_LOAD):
                targets = (self._block_planes(caches, t.device) if t.kind == BLOCK_LOAD
                           else [caches.snapshots[t.device]])
                self._load(t.data, targets)
            else:
                raise ValueError(f"unknown transfer kind {t.kind!r}")

    def _persist(self, t: Transfer, planes: list[torch.Tensor]) -> None:
        if self._persists.full():
            self.dropped_persists += 1
            return
        out = self._empty(sum(p.numel() for p in planes))
        at = 0
        for plane in planes:
            n = plane.numel()
            out[at:at + n].copy_(plane.reshape(-1), non_blocking=True)
            at += n
        event = None
        if self.pin:
            event = torch.cuda.Event()
            event.record()
        self._persists.put_nowait((t.key, t.data or b"", out, event))

    def _load(self, data: bytes | None, targets: list[torch.Tensor]) -> None:
        expected = sum(t.numel() for t in targets)
        if data is None or len(data) != expected:
            raise RuntimeError(f"a stored object of {0 if data is None else len(data)} B where "
                               f"{expected} B were expected (another model's store?)")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if self.pin:
            src = src.pin_memory()
        at = 0
        for target in targets:
            n = target.numel()
            target.copy_(src[at:at + n].view(target.shape), non_blocking=True)
            at += n

    def _writer(self) -> None:
        while True:
            key, header, buffer, event = self._persists.get()
            try:
                if event is not None:
                    event.synchronize()
                self.store.put(key, header + buffer.numpy().tobytes())
            except Exception:  # a write never takes the engine down
                logger.exception("kv store: persisting %s failed", key.hex()[:16])
            finally:
                self._persists.task_done()

    def flush(self) -> None:
        """Wait until every persist is handed to the store, and the store's writes are done."""
        if self.store is not None:
            self._persists.join()
            self.store.flush()
