"""Engine configuration: `EngineConfig` = model + cache + scheduler + runner configs, each a
frozen dataclass owning one concern. `LLM(**kwargs)` and the CLI flags come from their fields;
an unknown keyword raises with the list of valid ones.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.model.config import ModelConfig
from shoal.model.presets import PRESETS
from shoal.model.tail_prefill import PREFILL_MODES
from shoal.scheduler.config import SchedulerConfig


class ShoalError(ValueError):
    """A user-facing configuration or input error (the message names the culprit)."""


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizing. block_size: context tokens per paged block (multiple of 128).
    kv_cache_memory_gb: bytes for KV + request slots (None: 0.5 GB on CPU, or
    gpu_memory_utilization of the free device memory after weights).
    enable_prefix_caching: a new request resumes after the longest cached prefix of its tokens
    (full blocks, shared by reference count, evicted least recently used): its logits equal a
    run without the cache. prefix_resume: how the per-request SWA rings are rebuilt at the
    resume point: 'exact' (restore a ring snapshot saved at that block boundary) or 'bounded'
    (recompute the last replay_window rows before it through every layer, their SWA reads
    floored there, as the bounded prefill does: no snapshots, approximate).
    num_prefix_snapshots: ring snapshots kept (each the backbone's window rows, 2.6 MiB for
    Flash, taken from the KV budget). kv_host_memory_gb: the prefix cache's host tier (pinned
    memory): cached blocks and snapshots evicted from the device move there, and a hit copies
    them back (0: no host tier). kv_store_path: the persistent tier: a directory where blocks
    and prompt-end ring snapshots are written as they are made (10 + 2 erasure-coded shards
    over 12 subdirectories, checksummed, `kv_store_ttl_days` to live), read back by later runs
    and processes of the same model and settings (None: no store). kv_store_max_gb: the store's
    size bound in GB (1e9 bytes) of shard files; least recently used objects are evicted past
    it (None: unbounded)."""

    block_size: int = 256
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = False
    prefix_resume: str = "exact"
    num_prefix_snapshots: int = 64
    kv_host_memory_gb: float = 0.0
    kv_store_path: str | None = None
    kv_store_ttl_days: float = 3.0
    kv_store_max_gb: float | None = None

    @property
    def device_snapshots(self) -> int:
        """Ring snapshots the device pool holds: only exact prefix resumes keep them."""
        exact = self.enable_prefix_caching and self.prefix_resume == "exact"
        return self.num_prefix_snapshots if exact else 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 128:
            raise ShoalError(f"block_size: got {self.block_size}, expected a multiple of 128")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ShoalError(f"kv_cache_memory_gb: got {self.kv_cache_memory_gb}, expected > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ShoalError(f"gpu_memory_utilization: got {self.gpu_memory_utilization}, "
                             "expected in (0, 1]")
        if self.prefix_resume not in ("exact", "bounded"):
            raise ShoalError(f"prefix_resume: got {self.prefix_resume!r}, expected 'exact' "
                             "or 'bounded'")
        if not 0 <= self.kv_host_memory_gb < 1e5:  # (NaN and inf fail too)
            raise ShoalError(f"kv_host_memory_gb: got {self.kv_host_memory_gb}, expected a "
                             "size in GB >= 0")
        if not 0 < self.kv_store_ttl_days < 1e5:
            raise ShoalError(f"kv_store_ttl_days: got {self.kv_store_ttl_days}, expected a "
                             "number of days > 0")
        if self.kv_store_max_gb is not None:
            if not 0 < self.kv_store_max_gb < math.inf:  # (NaN fails too)
                raise ShoalError(f"kv_store_max_gb: got {self.kv_store_max_gb}, expected a "
                                 "size in GB > 0 (None: unbounded)")
            if self.kv_store_path is None:
                raise ShoalError("kv_store_max_gb: bounds the persistent tier; it needs "
                                 "kv_store_path")
        if self.kv_store_path is not None:
            if not self.enable_prefix_caching:
                raise ShoalError("kv_store_path: the store is the prefix cache's persistent "
                                 "tier; it needs enable_prefix_caching")
            if not self.kv_store_path or os.path.isfile(self.kv_store_path):
                raise ShoalError(f"kv_store_path: got {self.kv_store_path!r}, expected a "
                                 "directory (made if missing)")
        if self.kv_host_memory_gb and not self.enable_prefix_caching:
            raise ShoalError("kv_host_memory_gb: the host tier is the prefix cache's; it needs "
                             "enable_prefix_caching")
        if self.num_prefix_snapshots < 1:
            raise ShoalError(f"num_prefix_snapshots: got {self.num_prefix_snapshots}, "
                             "expected >= 1")


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runs. device: 'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1'.
    backends: op backend priority (None: triton on sm_90+, else the reference;
    ('triton_exact', 'triton'): the FP8 GEMM with the official kernel's rounding).
    prefill_mode: decoder tail-only prefill, 'full' | 'staircase' (both exact) | 'bounded'
    (approximate, replay_window rows). load_format: 'auto' (checkpoint weights; random for a
    preset), 'dummy' (random weights created on the device), 'safetensors'.
    seed: engine seed for weights of presets and for requests without a seed.
    speculative: draft with the DSpark block and verify by exact match (outputs identical to
    plain decoding; fewer steps when drafts are accepted). spec_confidence: verify a draft only
    while the DSpark confidence head puts the chance that it and the drafts before it are all
    accepted at or above this (0: verify every draft); outputs stay identical, only the verify
    rows change. spec_verify_budget: at most this many drafts verified per step across the
    batch, those with the largest chance of acceptance (0: no cap); outputs stay identical.
    spec_verify: 'exact' (greedy drafts, accepted while the target's own sample
    equals them: outputs identical to plain decoding) or 'rejection' (drafts sampled from the
    draft head's distribution q at the request's temperature, kept with probability
    min(1, p / q), else the token comes from the residual max(0, p - q): the output
    distribution is plain decoding's, and sampled requests accept more drafts).
    cuda_graphs: capture pure-decode
    steps (and, with speculative, verify steps padded to 1 + draft length rows per request) as
    CUDA graphs at start-up and replay them (CUDA only, ignored on the CPU). On by default: replay equals eager bitwise, nothing compiles after warm-up,
    and decode is several times faster; start-up pays a prefill warm-up that compiles the
    prefill kernels up front (numbers: docs/perf/cuda_graphs.md).
    cuda_graph_batch_sizes: the padded batch sizes to capture (each step pads to the next one;
    a step with more requests than the largest runs eagerly); empty: the powers of two below
    min(max_num_seqs, 256), then that bound. Fewer sizes capture faster.
    async_scheduling: overlap the host work of a step (scheduling, input preparation, output
    processing of the previous step: detokenising, stops) with the device work of the step
    before it; outputs are identical to the synchronous loop. A step is launched ahead only
    when no request whose token is in flight needs its value on the host (penalties,
    structured output; with speculative, min_tokens not yet met).
    spec_overlap: with speculative and async_scheduling, plan each verify step while the
    previous one runs (as if its drafts were all accepted; corrected on the device). Off by
    default: on the H200 (mini) it measured slower than synchronous speculative steps, whose
    host work already overlaps the device (docs in ARCHITECTURE.md). Ignored with prefix
    caching or a confidence rule (spec_confidence, spec_verify_budget), whose counts must be
    known to plan fewer verify rows.
    batch_invariant: on CUDA, ops whose bits depend on the rows in a call take a fixed tiling
    instead (backend 'triton_invariant' first): the MoE stays on its mma.sync tiles at every
    size, the FP8 GEMM and sparse attention keep their decode K / key partitions at every size,
    the grouped wo_a GEMM its wide tiles (`scripts/probe_row_invariance.py` finds such ops).
    expert_parallel: with data_parallel_size=N (or under torchrun), shard each layer's routed
    experts over the N ranks (each reads only its own from the checkpoint) and exchange tokens
    by all-to-all; the ranks step in lockstep (`parallel/expert_parallel.py`).
    expert_placement: an EPLB placement
    file (`shoal eplb`: busy experts copied on several ranks) instead of contiguous slices.
    collective_timeout_s: a collective of the ranks (several GPUs, torchrun) that has not
    completed after this many seconds (a rank hangs or died) ends the run with an error.
    record_expert_loads: count the tokens routed to each expert of each MoE layer
    (`LLM.expert_loads()`, `--record-expert-loads FILE`; eager steps: no CUDA graphs).
    engram_placement: where the Engram tables live on CUDA: 'device', 'host' (pinned host
    memory, its rows read in place by the gather kernel over the bus: same results, no GPU
    memory) or 'auto' (host when the GPU plan leaves no room for them: `shoal info --gpus`)."""

    device: str = "auto"
    backends: tuple[str, ...] | None = None
    prefill_mode: str = "bounded"
    replay_window: int = 140
    load_format: str = "auto"
    seed: int = 0
    speculative: bool = False
    spec_confidence: float = 0.0
    spec_verify_budget: int = 0
    spec_verify: str = "exact"
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    async_scheduling: bool = True
    spec_overlap: bool = False
    batch_invariant: bool = False
    expert_parallel: bool = False
    expert_placement: str | None = None
    collective_timeout_s: float = 600.0
    record_expert_loads: bool = False
    engram_placement: str = "auto"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ShoalError(f"device: got {self.device!r}, expected 'auto', 'cpu', 'cuda' or "
                             "'cuda:N'")
        if self.prefill_mode not in PREFILL_MODES:
            raise ShoalError(f"prefill_mode: got {self.prefill_mode!r}, expected one of "
                             f"{PREFILL_MODES}")
        if self.load_format not in ("auto", "dummy", "safetensors"):
            raise ShoalError(f"load_format: got {self.load_format!r}, expected 'auto', "
                             "'dummy' or 'safetensors'")
        if self.engram_placement not in ("auto", "device", "host"):
            raise ShoalError(f"engram_placement: got {self.engram_placement!r}, expected "
                             "'auto', 'device' or 'host'")
        if self.spec_verify not in ("exact", "rejection"):
            raise ShoalError(f"spec_verify: got {self.spec_verify!r}, expected 'exact' or "
                             "'rejection'")
        if not 0.0 <= self.spec_confidence <= 1.0:
            raise ShoalError(f"spec_confidence: got {self.spec_confidence}, expected in [0, 1]")
        if self.spec_verify_budget < 0:
            raise ShoalError(f"spec_verify_budget: got {self.spec_verify_budget}, expected >= 0 "
                             "(0: no cap)")
        if not self.collective_timeout_s > 0:
            raise ShoalError(f"collective_timeout_s: got {self.collective_timeout_s}, expected "
                             "> 0")
        if self.replay_window < 1:
            raise ShoalError(f"replay_window: got {self.replay_window}, expected >= 1")
        sizes = self.cuda_graph_batch_sizes
        if any(not isinstance(b, int) or b < 1 for b in sizes):
            raise ShoalError(f"cuda_graph_batch_sizes: got {sizes!r}, expected integers >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    model_config: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)

    @property
    def is_preset(self) -> bool:
        return self.model in PRESETS

    @classmethod
    def create(cls, model: str = "tiny", **kwargs: Any) -> EngineConfig:
        """Route each keyword to the config that owns the field; unknown keywords raise."""
        model_config = resolve_model_config(model)
        groups: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "runner": {}}
        owners = {"cache": CacheConfig, "scheduler": SchedulerConfig, "runner": RunnerConfig}
        valid: dict[str, list[str]] = {}
        for group, owner in owners.items():
            for f in dataclasses.fields(owner):
                valid.setdefault(f.name, []).append(group)
        for key, value in kwargs.items():
            if key not in valid:
                raise ShoalError(f"unknown engine option {key!r}; valid options: "
                                 f"{', '.join(sorted(valid))}")
            for group in valid[key]:
                groups[group][key] = value
        if "backends" in groups["runner"] and groups["runner"]["backends"] is not None:
            groups["runner"]["backends"] = tuple(groups["runner"]["backends"])
        sched = groups["scheduler"]
        positions = model_config.max_position_embeddings
        sched.setdefault("max_model_len", min(positions, 65536))
        if sched["max_model_len"] > positions:
            raise ShoalError(f"max_model_len: got {sched['max_model_len']}, but model {model!r} "
                             f"has {positions} positions")
        try:
            return cls(model, model_config, CacheConfig(**groups["cache"]),
                       SchedulerConfig(**sched), RunnerConfig(**groups["runner"]))
        except ShoalError:
            raise
        except (TypeError, ValueError) as exc:
            raise ShoalError(str(exc)) from None


def resolve_model_config(model: str) -> ModelConfig:
    """A preset name or a checkpoint directory with config.json (a name that is both is
    refused: which one was meant cannot be told)."""
    if model in PRESETS:
        if Path(model).is_dir():
            raise ShoalError(f"model: {model!r} is both a preset and a folder here; give the "
                             f"folder as ./{model} (or its absolute path) to load it")
        return PRESETS[model]
    path = Path(model)
    if not path.exists():
        raise ShoalError(f"model: {model!r} is neither a preset ({', '.join(PRESETS)}) nor an "
                         "existing checkpoint directory")
    if not path.is_dir():
        raise ShoalError(f"model: {model!r} is a file; give the checkpoint's folder")
    try:
        return ModelConfig.from_file(path)
    except (ValueError, OSError) as exc:
        raise ShoalError(f"model {model!r}: {exc}") from None
