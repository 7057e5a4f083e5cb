"""Bringing the model up on a device: the device choice, the weight source (a checkpoint, or
random weights for a preset), the model over its op table, and the byte budget for KV caches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shoal.checkpoint.reader import CheckpointReader
from shoal.checkpoint.writer import generate_weights
from shoal.config import EngineConfig, RunnerConfig, ShoalError
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ExpertShard, ModelParams, WeightError, owns_tensor
from shoal.model.weights import checkpoint_inventory, is_engram_table
from shoal.ops.registry import default_backends, resolve_ops
from shoal.parallel.expert_parallel import ExpertParallel
from shoal.parallel.gpu_plan import plan_gpus
from shoal.runner.cache_memory import GPU_ACTIVATION_RESERVE_GB
from shoal.runner.host_mapped import host_mapped, node_shared

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_GB = 0.5


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ShoalError(f"device: {name!r} requested but CUDA is not available")
    return device


def engram_on_host(config: EngineConfig, device: torch.device, world: int = 1) -> bool:
    """Whether the Engram tables go to pinned host memory (`RunnerConfig.engram_placement`;
    'auto': when the GPU plan of `world` GPUs leaves no room for them)."""
    placement, mc = config.runner.engram_placement, config.model_config
    if device.type != "cuda" or not mc.engram_layer_ids or placement == "device":
        return False
    if placement == "host":
        return True
    sched, cache = config.scheduler, config.cache
    total = torch.cuda.get_device_properties(device).total_memory / 1e9
    return not plan_gpus(mc, world, total, max_num_seqs=sched.max_num_seqs,
                         max_model_len=sched.max_model_len,
                         utilization=cache.gpu_memory_utilization, block_size=cache.block_size,
                         prefix_caching=cache.enable_prefix_caching,
                         num_snapshots=cache.device_snapshots).engram_on_gpu


@dataclass(frozen=True)
class NodeShare:
    """Ranks of one node sharing the host-placed weights (`host_mapped.node_shared`)."""

    key: str
    creator: bool
    barrier: Callable[[], None]


def iter_weights(config: EngineConfig, device: torch.device, shard: ExpertShard | None = None,
                 host: Callable[[str], bool] = lambda name: False,
                 share: NodeShare | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights this rank holds (its `shard` of the routed experts under expert
    parallelism): the others are neither generated nor read. Weights named by `host` come last,
    made or read on the CPU (random ones have the same bits on every device); with `share`,
    only its creator makes or reads them, and every rank gets the node-shared mappings."""
    fmt, mc = config.runner.load_format, config.model_config
    shard = shard or ExpertShard()
    inventory = checkpoint_inventory(mc)
    names = [n for n in inventory if owns_tensor(mc, n, shard)]
    on_host = [n for n in names if host(n)]
    rest = [n for n in names if not host(n)]

    def host_part(tables: Iterator[tuple[str, torch.Tensor]], present: set[str] | None = None):
        if share is None:
            yield from tables
        else:  # only the tables the source has: a missing one stays missing (an error)
            specs = {n: (inventory[n].shape, inventory[n].dtype) for n in on_host
                     if present is None or n in present}
            yield from node_shared(tables if share.creator else None, specs, share.key,
                                   share.creator, share.barrier)

    if fmt == "dummy" or (fmt == "auto" and config.is_preset):
        yield from generate_weights(mc, seed=config.runner.seed, device=device,
                                    names=None if len(rest) == len(inventory) else rest)
        if on_host:
            yield from host_part(generate_weights(mc, seed=config.runner.seed, device="cpu",
                                                  names=on_host, work_device=device))
        return
    if config.is_preset:
        raise ShoalError(f"load_format={fmt!r} needs a checkpoint directory, got the preset "
                         f"{config.model!r}")
    with CheckpointReader(config.model) as reader:
        reader.check(config.model_config)
        wanted, present = set(rest), set(reader.names())
        for name in reader.names():
            if name in wanted or (name not in inventory and owns_tensor(mc, name, shard)):
                yield name, reader.get(name)  # (unknown names too: the loader reports them)
        if on_host:
            yield from host_part(((n, reader.get(n)) for n in on_host if n in present), present)


def op_backends(run: RunnerConfig, default: list[str]) -> list[str]:
    """The backend priority: `run.backends` or the device's default, with the batch-invariant
    variants ahead of every other backend under `batch_invariant` (an op served by two
    backends at different sizes would change bits with the batch)."""
    backends = list(run.backends) if run.backends else list(default)
    if run.batch_invariant and "triton" in backends:
        backends.insert(0, "triton_invariant")
    return backends


def load_model(config: EngineConfig, tokenizer: Any | None, device: torch.device,
               ep: ExpertParallel | None = None) -> DeepseekV41:
    """The model with its weights on `device`, over the op table resolved for it; with `ep`,
    this rank's share of the routed experts."""
    cfg = config.model_config
    ops = resolve_ops(device, op_backends(config.runner, default_backends(device)))
    logger.info("op table:\n%s", ops.report())
    shard = ExpertShard() if ep is None else ep.shard(cfg)
    on_host = engram_on_host(config, device, shard.world)
    host = is_engram_table if on_host else (lambda name: False)
    share = NodeShare(ep.shared_key(), ep.local_rank == 0, ep.barrier) \
        if on_host and ep is not None else None

    def place(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return host_mapped(tensor, device, in_place=share is not None) if host(name) else \
            tensor.to(device)

    backend = getattr(tokenizer, "backend", None)  # (checked before any weight is read)
    token_map = token_map_for(cfg, backend) if cfg.engram_layer_ids else None
    start = time.perf_counter()
    try:
        params = ModelParams.load(cfg, iter_weights(config, device, shard, host, share), device,
                                  shard, place)
    except WeightError as exc:
        raise ShoalError(f"model {config.model!r}: {exc}") from None
    logger.info("weights loaded in %.1f s%s%s", time.perf_counter() - start,
                "" if ep is None else f" (rank {ep.rank} of {ep.world}: its experts only)",
                ("; Engram tables in pinned host memory" + (", one copy per node" if share else ""))
                if on_host else "")
    return DeepseekV41(cfg, params, ops, token_map, ep)


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for KV blocks and request slots: the configured size, else a share of the free
    device memory (after the weights) less an activation reserve, else a fixed CPU budget."""
    cache = config.cache
    if cache.kv_cache_memory_gb is not None:
        return int(cache.kv_cache_memory_gb * 1e9)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # memory an engine closed in this process still holds is free
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * cache.gpu_memory_utilization - GPU_ACTIVATION_RESERVE_GB * 1e9)
    return int(CPU_KV_BUDGET_GB * 1e9)
