"""Bringing the model up on a device: the device choice, the weight source (a checkpoint, or
random weights for a preset), the model over its op table, and the byte budget for KV caches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from shoal.checkpoint.reader import CheckpointReader
from shoal.checkpoint.writer import generate_weights
from shoal.config import EngineConfig, ShoalError
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams, WeightError, owns_tensor
from shoal.model.weights import checkpoint_inventory
from shoal.ops.registry import resolve_ops
from shoal.parallel.expert_parallel import ExpertParallel

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_GB = 0.5
GPU_ACTIVATION_RESERVE_GB = 8.0


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ShoalError(f"device: {name!r} requested but CUDA is not available")
    return device


def iter_weights(config: EngineConfig, device: torch.device, shard: tuple[int, int] = (0, 1)
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights this rank holds (`shard` = (rank, world) of expert parallelism): the
    others are neither generated nor read."""
    fmt, mc = config.runner.load_format, config.model_config
    if fmt == "dummy" or (fmt == "auto" and config.is_preset):
        names = None if shard[1] == 1 else [
            n for n in checkpoint_inventory(mc) if owns_tensor(mc, n, shard)]
        yield from generate_weights(mc, seed=config.runner.seed, device=device, names=names)
        return
    if config.is_preset:
        raise ShoalError(f"load_format={fmt!r} needs a checkpoint directory, got the preset "
                         f"{config.model!r}")
    with CheckpointReader(config.model) as reader:
        reader.check(config.model_config)
        for name in reader.names():
            if owns_tensor(mc, name, shard):
                yield name, reader.get(name)


def load_model(config: EngineConfig, tokenizer: Any | None, device: torch.device,
               ep: ExpertParallel | None = None) -> DeepseekV41:
    """The model with its weights on `device`, over the op table resolved for it; with `ep`,
    this rank's share of the routed experts."""
    cfg = config.model_config
    ops = resolve_ops(device, list(config.runner.backends) if config.runner.backends else None)
    logger.info("op table:\n%s", ops.report())
    shard = (0, 1) if ep is None else (ep.rank, ep.world)
    if ep is not None:
        ep.local_experts(cfg.n_routed_experts)
        if cfg.num_draft_layers:
            ep.local_experts(cfg.dspark_n_routed_experts, "DSpark routed experts")
    start = time.perf_counter()
    try:
        params = ModelParams.load(cfg, iter_weights(config, device, shard), device, shard)
    except WeightError as exc:
        raise ShoalError(f"model {config.model!r}: {exc}") from None
    backend = getattr(tokenizer, "backend", None)
    token_map = token_map_for(cfg, backend) if cfg.engram_layer_ids else None
    logger.info("weights loaded in %.1f s%s", time.perf_counter() - start,
                "" if ep is None else f" (rank {ep.rank} of {ep.world}: its experts only)")
    return DeepseekV41(cfg, params, ops, token_map, ep)


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for KV blocks and request slots: the configured size, else a share of the free
    device memory (after the weights) less an activation reserve, else a fixed CPU budget."""
    cache = config.cache
    if cache.kv_cache_memory_gb is not None:
        return int(cache.kv_cache_memory_gb * 1e9)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * cache.gpu_memory_utilization - GPU_ACTIVATION_RESERVE_GB * 1e9)
    return int(CPU_KV_BUDGET_GB * 1e9)
