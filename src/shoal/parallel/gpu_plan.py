"""Per-GPU memory plan of a model over N GPUs with expert parallelism (`shoal info --gpus N`):
weights each rank holds (from the checkpoint inventory: dense weights on every rank, 1/N of the
routed experts, the Engram tables on each GPU or in pinned host memory, one copy per node), the
engine's activation reserve, and the KV pool that is left, as the engine itself would size it;
with the node's host memory given, whether the Engram tables fit in it.

Numbers are derived, not measured: tensor bytes are exact; the KV pool follows
`runner/loading.kv_budget_bytes` (free memory x gpu_memory_utilization less the reserve), with
free memory taken as the GPU's memory less the weights (the CUDA context and the allocator's
slack are not subtracted: the real pool is somewhat smaller).
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.model.config import ModelConfig
from shoal.model.params import ExpertShard, owns_tensor
from shoal.model.weights import checkpoint_inventory, is_engram_table
from shoal.runner.cache_memory import (
    GPU_ACTIVATION_RESERVE_GB,
    CacheLayout,
    MemoryPlan,
    plan_memory,
)


@dataclass(frozen=True)
class GpuPlan:
    gpus: int
    gpu_memory_gb: float
    dense_gb: float  # per rank: everything but the routed experts and the Engram tables
    experts_gb: float  # per rank: its 1/N of the routed experts
    engram_gb: float  # the Engram tables (one copy)
    engram_on_gpu: bool
    reserve_gb: float
    kv_gb: float  # per rank
    kv_blocks: int
    kv_context_tokens: int
    slots: int
    fits: bool
    reason: str
    host_checked: bool = True  # False: the Engram tables are on the host, its memory unknown

    def lines(self) -> list[str]:
        where = "on each GPU" if self.engram_on_gpu else (
            "in pinned host memory, one copy shared by the ranks of a node")
        return [
            f"plan for {self.gpus} GPU(s) of {self.gpu_memory_gb:g} GB, expert parallel "
            f"over {self.gpus}:",
            f"  per GPU: dense weights {self.dense_gb:.1f} GB + routed experts "
            f"{self.experts_gb:.1f} GB" + (f" + Engram tables {self.engram_gb:.1f} GB"
                                           if self.engram_on_gpu else ""),
            f"  activations and CUDA graphs: the engine's reserve of {self.reserve_gb:g} GB",
            f"  KV pool: {self.kv_gb:.1f} GB = {self.kv_blocks} blocks "
            f"({self.kv_context_tokens} context tokens), {self.slots} request slots",
            f"  Engram tables {self.engram_gb:.1f} GB {where}",
            f"  fits: {'yes' if self.fits else 'no'}" + (f" ({self.reason})" if self.reason
                                                         else "")
            + ("" if self.host_checked or not self.fits else " on the GPUs (give "
               "--host-memory-gb to check the host)"),
        ]


def plan_gpus(config: ModelConfig, gpus: int, gpu_memory_gb: float, *, max_num_seqs: int,
              max_model_len: int, utilization: float = 0.9, block_size: int = 256,
              host_memory_gb: float | None = None, prefix_caching: bool = False,
              num_snapshots: int = 0) -> GpuPlan:
    """The plan of rank 0 (every rank holds the same bytes: the experts split evenly);
    `prefix_caching` and `num_snapshots` as in `plan_memory`."""
    if gpus < 1:
        raise ValueError(f"gpus={gpus}: expected >= 1")
    dense = experts = engram = 0
    shard = ExpertShard(0, gpus)
    for name, spec in checkpoint_inventory(config).items():
        size = spec.nbytes
        if is_engram_table(name):
            engram += size
        elif ".ffn.experts." in name:
            experts += size if owns_tensor(config, name, shard) else 0
        else:
            dense += size
    reason = ""
    for n in {config.n_routed_experts, config.dspark_n_routed_experts} - {0}:
        if n % gpus:
            reason = f"{n} experts do not split over {gpus} GPUs"
    layout = CacheLayout.from_model_config(config, block_size=block_size)

    def kv_plan(on_gpu: int) -> tuple[int, MemoryPlan | None]:
        """The KV bytes left beside `on_gpu` bytes of weights, and their memory plan (None:
        not even one request of max_model_len fits)."""
        kv = int((gpu_memory_gb * 1e9 - on_gpu) * utilization - GPU_ACTIVATION_RESERVE_GB * 1e9)
        try:
            return kv, plan_memory(layout, max(kv, 0), max_num_seqs, max_model_len,
                                   num_snapshots, prefix_caching=prefix_caching)
        except ValueError:
            return kv, None

    engram_on_gpu = kv_plan(dense + experts + engram)[1] is not None
    kv, plan = kv_plan(dense + experts + (engram if engram_on_gpu else 0))
    blocks = context = slots = 0
    if plan is not None:
        blocks, context, slots = plan.num_blocks, plan.max_context_tokens, plan.num_slots
    elif not reason:
        reason = "the weights leave no room for one request of max_model_len"
    host_need = 0 if engram_on_gpu else engram
    if host_need and host_memory_gb is not None and host_need > host_memory_gb * 1e9 \
            and not reason:
        reason = (f"the Engram tables need {host_need / 1e9:.0f} GB of pinned host memory, "
                  f"the node has {host_memory_gb:g} GB")
    return GpuPlan(gpus, gpu_memory_gb, dense / 1e9, experts / 1e9, engram / 1e9,
                   engram_on_gpu, GPU_ACTIVATION_RESERVE_GB, max(kv, 0) / 1e9, blocks, context,
                   slots, not reason, reason, not host_need or host_memory_gb is not None)
