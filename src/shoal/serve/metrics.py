"""Prometheus metrics of one server (its own registry: no global state): the engine loop's
snapshot as gauges and counters read at scrape time, and latency histograms observed as
requests stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

GAUGES = {"running": "requests running", "waiting": "requests waiting for admission",
          "queued_requests": "requests without a first token yet",
          "kv_blocks_used": "KV blocks in use", "kv_blocks_total": "KV blocks in the pool",
          "kv_blocks_cached_idle": "cached KV blocks no request holds (evictable)"}
COUNTERS = {"prompt_tokens": "prompt tokens", "output_tokens": "output tokens",
            "preemptions": "requests preempted (KV recomputed later)", "requests": "requests added",
            "errors": "requests rejected", "drafts_proposed": "speculative drafts verified",
            "drafts_accepted": "speculative drafts accepted", "steps": "engine steps",
            "prefix_query_tokens": "prompt tokens of admissions that looked up the prefix cache",
            "prefix_hit_tokens": "prompt tokens resumed from the prefix cache",
            "prefix_host_hit_tokens": "of those, in blocks copied back from host memory",
            "prefix_store_hit_tokens": "of those, in blocks read from the KV store",
            "prefix_snapshots_saved": "ring snapshots saved", "prefix_snapshot_evictions":
            "ring snapshots evicted", "kv_block_evictions": "cached KV blocks evicted",
            "spec_verify_rows": "rows that verified speculative drafts (mean accepted length: "
            "1 + drafts_accepted / spec_verify_rows)",
            "kv_store_puts": "objects handed to the KV store", "kv_store_dropped_puts":
            "of those, not written (queue full, write failed, disk full, over the bound)",
            "kv_store_hits": "KV store reads served", "kv_store_misses": "KV store reads missed",
            "kv_store_lost_reads": "KV store objects found with too few good shards (removed)",
            "kv_store_evicted": "KV store objects evicted by its size bound",
            "affinity_matched": "--dp requests placed on a replica sent a prefix of theirs",
            "affinity_busy": "--dp requests whose prefix replicas were too busy (placed by load)",
            "affinity_unmatched": "--dp requests with no replica sent a prefix of theirs"}
PER_POSITION = {"drafts_proposed_at": "speculative drafts verified at this draft position",
                "drafts_accepted_at": "speculative drafts accepted at this draft position"}


class _Snapshot:
    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self.read = read

    def collect(self) -> Iterator:
        snap = self.read()
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(f"shoal_{name}", doc, value=snap.get(name, 0))
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(f"shoal_{name}", doc, value=snap.get(name, 0))
        for name, doc in PER_POSITION.items():  # speculative decoding, by draft position
            family = CounterMetricFamily(f"shoal_{name}", doc, labels=["position"])
            for position, value in enumerate(snap.get(name, ())):
                family.add_metric([str(position)], value)
            yield family


class Metrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Snapshot(snapshot))
        self.ttft = Histogram("shoal_time_to_first_token_seconds", "time to first token",
                              registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.itl = Histogram("shoal_inter_token_latency_seconds", "time between output tokens",
                             registry=self.registry,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
        self.e2e = Histogram("shoal_request_latency_seconds", "request latency",
                             registry=self.registry,
                             buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))

    def text(self) -> bytes:
        return generate_latest(self.registry)
