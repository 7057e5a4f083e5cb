"""Expert-parallel load balancing (EPLB): from recorded per-expert token counts, a placement of
each MoE layer's experts on the ranks with redundant copies of the busiest, so that every rank
serves about the same number of tokens.

A placement gives each layer N x S physical slots (S per rank); slot p holds logical expert
`slots[p]` on rank p // S. Every expert has at least one slot, none has two on one rank. The
method is the greedy one vLLM and SGLang use: give each of the R redundant slots to the expert
whose load per copy is largest, then place copies heaviest first on the least-loaded rank with
a free slot and no copy of that expert. A token routed to an expert with m copies goes to copy
(token index mod m), so each copy takes about 1/m of its load. Weights of a copy are the
expert's own: outputs do not change with the placement.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    world: int
    slots_per_rank: int
    layers: dict[str, tuple[int, ...]]  # MoE prefix ('layers.3.') -> logical expert per slot

    def slots_of(self, prefix: str, rank: int) -> tuple[int, ...]:
        """The logical experts rank `rank` holds for layer `prefix`, in local slot order."""
        s = self.slots_per_rank
        return self.layers[prefix][rank * s:(rank + 1) * s]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"world": self.world,
                                          "slots_per_rank": self.slots_per_rank,
                                          "layers": {k: list(v) for k, v in self.layers.items()}}))

    @classmethod
    def load(cls, path: str | Path) -> ExpertPlacement:
        data = json.loads(Path(path).read_text())
        return cls(int(data["world"]), int(data["slots_per_rank"]),
                   {k: tuple(int(e) for e in v) for k, v in data["layers"].items()})

    def check(self, num_experts: int, world: int) -> None:
        """Raise ValueError unless it fits `world` ranks and holds every expert, at most once
        per rank."""
        if self.world != world:
            raise ValueError(f"placement for {self.world} ranks, running {world}")
        s = self.slots_per_rank
        for prefix, slots in self.layers.items():
            if len(slots) != world * s:
                raise ValueError(f"{prefix}: {len(slots)} slots, expected {world} x {s}")
            if set(slots) != set(range(num_experts)):
                raise ValueError(f"{prefix}: not every one of the {num_experts} experts placed")
            for r in range(world):
                mine = slots[r * s:(r + 1) * s]
                if len(set(mine)) != len(mine):
                    raise ValueError(f"{prefix}: rank {r} holds an expert twice")


def copies(loads: torch.Tensor, redundant: int, world: int) -> list[int]:
    """Copies per expert: one each, then each redundant slot to the largest load per copy
    (ties: lower expert id), at most `world` copies of one expert."""
    count = [1] * loads.numel()
    heap = [(-float(x), e) for e, x in enumerate(loads.tolist())]
    heapq.heapify(heap)
    for _ in range(redundant):
        if not heap:
            raise ValueError(f"{redundant} redundant slots: more than {world} copies of every "
                             "expert")
        _, e = heapq.heappop(heap)
        count[e] += 1
        if count[e] < world:
            heapq.heappush(heap, (-float(loads[e]) / count[e], e))
    return count


def place_layer(loads: torch.Tensor, world: int, redundant: int) -> tuple[int, ...]:
    """One layer's slots: the copies of `copies`, heaviest first, each to the least-loaded rank
    with a free slot that holds no copy of the same expert (when every free rank holds one, an
    expert of another rank moves to the free one to make room)."""
    e_total = loads.numel()
    if (e_total + redundant) % world:
        raise ValueError(f"{e_total} experts + {redundant} redundant do not fill {world} ranks")
    per_rank = (e_total + redundant) // world
    count = copies(loads, redundant, world)
    items = sorted(((float(loads[e]) / count[e], e) for e in range(e_total)
                    for _ in range(count[e])), key=lambda x: (-x[0], x[1]))
    rank_load = [0.0] * world
    held: list[dict[int, float]] = [{} for _ in range(world)]  # expert -> its copy's load

    def put(r: int, e: int, load: float) -> None:
        held[r][e] = load
        rank_load[r] += load

    for load, e in items:
        free = [r for r in range(world) if len(held[r]) < per_rank]
        options = [r for r in free if e not in held[r]]
        if options:
            put(min(options, key=lambda r: (rank_load[r], r)), e, load)
            continue
        r = min(free, key=lambda r: (rank_load[r], r))  # holds e: swap one of another rank's
        r2, f = next((r2, f) for r2 in sorted(range(world), key=lambda r: (rank_load[r], r))
                     if e not in held[r2] for f in held[r2] if f not in held[r])
        moved = held[r2].pop(f)
        rank_load[r2] -= moved
        put(r, f, moved)
        put(r2, e, load)
    return tuple(e for r in range(world) for e in sorted(held[r]))


def balanced_placement(loads: dict[str, torch.Tensor], world: int, redundant: int
                       ) -> ExpertPlacement:
    """`loads[prefix]`: tokens per logical expert of that MoE layer."""
    layers = {prefix: place_layer(x.double(), world, redundant) for prefix, x in loads.items()}
    e_total = next(iter(loads.values())).numel()
    return ExpertPlacement(world, (e_total + redundant) // world, layers)


def contiguous_placement(loads: dict[str, torch.Tensor], world: int) -> ExpertPlacement:
    """Expert parallelism without EPLB: rank r holds experts [r E/N, (r+1) E/N)."""
    e_total = next(iter(loads.values())).numel()
    return ExpertPlacement(world, e_total // world,
                           {prefix: tuple(range(e_total)) for prefix in loads})


def imbalance(loads: dict[str, torch.Tensor], placement: ExpertPlacement) -> float:
    """Mean over layers of (the busiest rank's tokens / the mean rank's), each copy of an expert
    taking an equal share of its load (1.0 = balanced)."""
    ratios = []
    for prefix, x in loads.items():
        slots = placement.layers[prefix]
        count = torch.bincount(torch.tensor(slots), minlength=x.numel()).double()
        per_slot = x.double()[list(slots)] / count[list(slots)]
        per_rank = per_slot.view(placement.world, placement.slots_per_rank).sum(1)
        ratios.append(float(per_rank.max() / per_rank.mean()) if per_rank.sum() > 0 else 1.0)
    return sum(ratios) / len(ratios)


def eplb_command(args) -> int:
    """`shoal eplb --loads FILE... --world N [--redundant R] --out PLACEMENT`: sum the recorded
    loads, place, print the imbalance before (contiguous slices) and after, write the file."""
    total: dict[str, torch.Tensor] = {}
    for path in args.loads:
        try:
            recorded = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"shoal eplb: --loads {path}: {exc}") from None
        for prefix, counts in recorded.items():
            x = torch.tensor(counts, dtype=torch.float64)
            total[prefix] = total[prefix] + x if prefix in total else x
    layers = {k: v for k, v in total.items() if not k.startswith("mtp.")}
    if not layers:
        raise SystemExit("shoal eplb: no MoE layer loads in " + ", ".join(args.loads))
    try:
        placement = balanced_placement(layers, args.world, args.redundant)
    except ValueError as exc:
        raise SystemExit(f"shoal eplb: {exc}") from None
    before = imbalance(layers, contiguous_placement(layers, args.world)) \
        if next(iter(layers.values())).numel() % args.world == 0 else float("nan")
    after = imbalance(layers, placement)
    placement.save(args.out)
    tokens = int(sum(float(v.sum()) for v in layers.values()))
    print(f"{len(layers)} MoE layers, {tokens} routed tokens; {args.world} ranks x "
          f"{placement.slots_per_rank} slots ({args.redundant} redundant per layer)")
    print(f"busiest rank / mean, averaged over layers: contiguous {before:.3f} -> "
          f"placement {after:.3f}; written to {args.out}")
    return 0
