"""Model parameters: the checkpoint's tensors by their official names, validated against the
inventory, with the routed experts stacked per layer for the grouped MoE op, and FP8 projections
that read the same input stored as one matrix (`fused`: wq_a + wkv, shared w1 + w3), so a step
runs one GEMM (one activation quantisation, one launch) for both.

Invariant: the name map is total (model.md §6): every inventory tensor must arrive with its
shape and dtype, unknown names are an error that names them, the vision tower is ignored. A
fused pair's official names are views of its rows (no second copy). Under expert parallelism
a rank holds, and expects, only its `ExpertShard` of each layer's routed experts (a contiguous
slice, or an EPLB placement's slots), stacked in local slot order (`owns_tensor`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from shoal.model.config import ModelConfig
from shoal.model.weights import checkpoint_inventory, is_optional, is_vision_name
from shoal.parallel.eplb import ExpertPlacement

EXPERT_PARTS = ("w13", "w13_scale", "w2", "w2_scale")
# (first, second, fused name): FP8 [N, K] weights of one input, stacked by rows
FUSED_PAIRS = (("attn.wq_a", "attn.wkv", "attn.wq_a+wkv"),
               ("ffn.shared_experts.w1", "ffn.shared_experts.w3", "ffn.shared_experts.w1+w3"))


class WeightError(ValueError):
    """A weight is missing, unknown or of the wrong shape/dtype; the message names it."""


class ModelParams:
    """name -> tensor (official names), plus `experts(prefix)` -> stacked MXFP4 experts."""

    def __init__(self, tensors: dict[str, torch.Tensor],
                 experts: dict[str, dict[str, torch.Tensor]]) -> None:
        self._tensors = tensors
        self._experts = experts
        self._fused = _fuse_pairs(tensors)

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"weight {name!r} is not loaded") from None

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> torch.Tensor | None:
        return self._tensors.get(name)

    def experts(self, prefix: str) -> dict[str, torch.Tensor]:
        """Stacked experts of a layer prefix ('layers.3.' or 'mtp.0.'): w13 [E, 2I, D/2] u8
        (w1 rows then w3 rows), w13_scale [E, 2I, D/32], w2 [E, D, I/2], w2_scale [E, D, I/32]."""
        return self._experts[prefix]

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def fused(self, name: str) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(weight [N1 + N2, K], scale, N1) of a fused pair ('layers.3.attn.wq_a+wkv'), or None
        when the pair was not fused (absent, or N1 not a whole number of 32-row blocks)."""
        return self._fused.get(name)

    @classmethod
    def load(cls, config: ModelConfig, named_tensors: Iterable[tuple[str, torch.Tensor]],
             device: torch.device | str = "cpu", shard: ExpertShard | None = None,
             place: Callable[[str, torch.Tensor], torch.Tensor] | None = None
             ) -> ModelParams:
        """`place(name, tensor)`: where a tensor goes (default: `device`)."""
        shard = shard or ExpertShard()
        inventory = {n: s for n, s in checkpoint_inventory(config).items()
                     if owns_tensor(config, n, shard)}
        tensors: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[str, torch.Tensor]] = {}
        unknown = []
        for name, tensor in named_tensors:
            spec = inventory.get(name)
            if spec is None:
                if not is_vision_name(name):
                    unknown.append(name)
                continue
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise WeightError(f"weight {name}: got {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"expected {spec.shape} {spec.dtype}")
            tensor = tensor.to(device) if place is None else place(name, tensor)
            placed = _place_expert(config, name, tensor, experts, device, shard)
            if not placed:
                tensors[name] = tensor
        if unknown:
            raise WeightError(f"{len(unknown)} unknown weight(s): {', '.join(unknown[:10])}")
        loaded = set(tensors) | _expert_names(config, experts)
        missing = sorted(n for n in set(inventory) - loaded if not is_optional(n))
        if missing:
            raise WeightError(f"{len(missing)} missing weight(s): {', '.join(missing[:10])}")
        return cls(tensors, {p: {k: v for k, v in e.items() if k != "_seen"}
                             for p, e in experts.items()})


def _split_expert(name: str) -> tuple[str, int, str] | None:
    """'layers.3.ffn.experts.7.w1.scale' -> ('layers.3.', 7, 'w1.scale')."""
    marker = "ffn.experts."
    at = name.find(marker)
    if at < 0:
        return None
    prefix = name[:at]
    rest = name[at + len(marker):]
    idx, _, part = rest.partition(".")
    return prefix, int(idx), part


def _num_experts(config: ModelConfig, prefix: str) -> int:
    return config.dspark_n_routed_experts if prefix.startswith("mtp.") else \
        config.n_routed_experts


class ExpertShard:
    """The routed experts rank `rank` of `world` holds per MoE layer, in local slot order:
    experts [r E/N, (r+1) E/N), or the slots an EPLB `placement` gives the layer."""

    def __init__(self, rank: int = 0, world: int = 1,
                 placement: ExpertPlacement | None = None) -> None:
        self.rank, self.world, self.placement = rank, world, placement
        self._local: dict[str, dict[int, int]] = {}  # prefix -> {logical expert: local slot}

    def local(self, config: ModelConfig, prefix: str) -> dict[int, int]:
        if prefix not in self._local:
            if self.placement is not None and prefix in self.placement.layers:
                experts = self.placement.slots_of(prefix, self.rank)
            else:
                per = _num_experts(config, prefix) // self.world
                experts = tuple(range(self.rank * per, (self.rank + 1) * per))
            self._local[prefix] = {e: i for i, e in enumerate(experts)}
        return self._local[prefix]


def owns_tensor(config: ModelConfig, name: str, shard: ExpertShard) -> bool:
    """Whether the rank of `shard` holds tensor `name`: every tensor but the routed experts
    outside its shard."""
    split = _split_expert(name) if shard.world > 1 else None
    return split is None or split[1] in shard.local(config, split[0])


def _place_expert(config: ModelConfig, name: str, tensor: torch.Tensor,
                  experts: dict[str, dict], device, shard: ExpertShard) -> bool:
    split = _split_expert(name)
    if split is None:
        return False
    prefix, idx, part = split
    inter = config.moe_intermediate_size
    slot = experts.setdefault(prefix, {"_seen": set()})
    local = shard.local(config, prefix)
    n, idx = len(local), local[idx]
    if part in ("w1.weight", "w3.weight", "w1.scale", "w3.scale"):
        key = "w13" if part.endswith("weight") else "w13_scale"
        if key not in slot:
            slot[key] = torch.empty(n, 2 * inter, tensor.shape[1], dtype=tensor.dtype,
                                    device=device)
        rows = slice(0, inter) if part.startswith("w1") else slice(inter, 2 * inter)
        slot[key][idx, rows] = tensor
    else:
        key = "w2" if part == "w2.weight" else "w2_scale"
        if key not in slot:
            slot[key] = torch.empty(n, *tensor.shape, dtype=tensor.dtype, device=device)
        slot[key][idx] = tensor
    slot["_seen"].add(name)
    return True


def _expert_names(config: ModelConfig, experts: dict[str, dict]) -> set[str]:
    out: set[str] = set()
    for slot in experts.values():
        out |= slot["_seen"]
    return out


def _fuse_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor,
                                                                      int]]:
    """Stack every FUSED_PAIRS pair into one weight and scale (rows of the first, then the
    second); the official names become views of the stacked rows. Pairs whose first part is not
    a whole number of 32-row scale blocks, or whose K differ, stay apart."""
    fused = {}
    for first, second, name in FUSED_PAIRS:
        suffix = first + ".weight"
        for key in [k for k in tensors if k.endswith(suffix)]:
            pre = key[:-len(suffix)]
            wa, wb = tensors[key], tensors.get(pre + second + ".weight")
            if (wb is None or wa.dim() != 2 or wa.shape[1] != wb.shape[1] or wa.shape[0] % 32
                    or wa.dtype != wb.dtype):
                continue
            sa, sb = tensors[pre + first + ".scale"], tensors[pre + second + ".scale"]
            w = torch.cat([wa.view(torch.uint8), wb.view(torch.uint8)]).view(wa.dtype)
            sc = torch.cat([sa, sb])
            n, ns = wa.shape[0], sa.shape[0]
            tensors[key], tensors[pre + second + ".weight"] = w[:n], w[n:]
            tensors[pre + first + ".scale"], tensors[pre + second + ".scale"] = sc[:ns], sc[ns:]
            fused[pre + name] = (w, sc, n)
    return fused
