"""Expert parallelism: the routed experts of every MoE layer sharded over the ranks of a
torch.distributed group, each token's rows sent to its experts' ranks and the outputs sent back
(all-to-all), and the lockstep that keeps every rank in each step's collectives.

Rank r of N holds experts [r E/N, (r+1) E/N) of each MoE layer (a contiguous slice: it reads only
those tensors of the checkpoint), or the slots of an EPLB placement (`parallel/eplb.py`: busy
experts have copies on several ranks; a token goes to copy (token index mod copies)). A MoE
call routes locally, then:
1. sorts its (token, slot) pairs by owner rank and exchanges the counts;
2. sends each pair as one packed byte row: FP8 codes + UE8M0 scales (what the expert GEMM
   quantises it to anyway: the receiver's dequantised bf16 row re-quantises to the same codes;
   0.52x the bf16 bytes), its local expert id and its routing weight;
3. each rank runs its experts on the rows it received, one slot per row: each output is one
   expert's bf16 output;
4. the outputs go back (bf16) and the owner adds each token's slots in ascending expert order in
   fp32, then the shared expert's output, and rounds once: the reference op's sum, so with the
   reference ops world N equals world 1 bitwise.

Fixed exchange (`fixed_exchange(rows)`: CUDA graph steps, where sizes cannot come from the
host): every rank's call has the same `rows` tokens (the agreed padded batch), and each rank sends
every other exactly rows * k pair rows, its pairs for that rank first, then padding rows of
local id E_local (no expert: the MoE op skips them); no counts are exchanged and nothing is read
on the host. The owner's experts see the same rows as with the exchange by counts, so the
outputs are the same bits; the cost is the padding's bytes (world x the pairs).

Lockstep: every rank runs each engine step's forward, or, with nothing scheduled, serves the
other ranks' rows through every MoE layer (`serve`). `join`, one all-reduce on a CPU group per
engine step, tells each rank whether any rank still has work (then all step) and whether a
cancel was asked (then all stop the call at the same step). With decode graphs, `agree` then
tells each rank whether the step runs as graphs on every rank, and at which padded size.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.config import ShoalError
from shoal.model.params import ExpertShard
from shoal.parallel.eplb import ExpertPlacement
from shoal.quant.fp8 import dequant_fp8_act


class ExpertParallel:
    """This process's rank in the expert-parallel group. Build with `from_process_group`."""

    def __init__(self, rank: int, world: int, control=None,
                 placement: ExpertPlacement | None = None) -> None:
        """The data collectives run on the default group (NCCL on CUDA, gloo on the CPU);
        `control` is the gloo group of the per-step join (None: the default group)."""
        self.rank, self.world = rank, world
        # this rank's place on its node (torchrun sets LOCAL_RANK; one-node spawns omit it)
        self.local_rank = int(os.environ.get("LOCAL_RANK", rank))
        self.control = control
        self.placement = placement
        self._routes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # prefix -> copies
        self._fixed_rows: int | None = None  # inside `fixed_exchange`

    @classmethod
    def from_process_group(cls, device: torch.device, placement: str | None,
                           timeout_s: float) -> ExpertParallel | None:
        """The group of the initialised default process group (None when torch.distributed is
        not initialised or has one rank: the experts stay whole, no collectives)."""
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        backend = dist.get_backend()
        if device.type == "cuda" and backend != "nccl":
            raise ShoalError(f"expert parallelism on CUDA needs the NCCL backend, got {backend}")
        control = dist.new_group(backend="gloo", timeout=timedelta(
            seconds=timeout_s)) if backend != "gloo" else None
        return cls(dist.get_rank(), dist.get_world_size(), control,
                   ExpertPlacement.load(placement) if placement else None)

    def shard(self, config) -> ExpertShard:
        """The experts this rank loads (checked against the model's expert counts)."""
        if self.placement is not None:
            try:
                self.placement.check(config.n_routed_experts, self.world)
            except ValueError as exc:
                raise ShoalError(f"expert_placement: {exc}") from None
        else:
            self.local_experts(config.n_routed_experts)
        if config.num_draft_layers:
            self.local_experts(config.dspark_n_routed_experts, "DSpark routed experts")
        return ExpertShard(self.rank, self.world, self.placement)

    def local_experts(self, num_experts: int, what: str = "routed experts") -> range:
        """The experts this rank holds, of `num_experts`."""
        if num_experts % self.world:
            raise ShoalError(f"expert parallelism: {num_experts} {what} do not split evenly "
                             f"over {self.world} ranks")
        per = num_experts // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def shared_key(self) -> str:
        """A name the ranks agree on for this group's node-shared files (rank 0's pick)."""
        key = [f"{os.getpid()}-{secrets.token_hex(4)}" if self.rank == 0 else None]
        dist.broadcast_object_list(key, src=0, group=self.control)
        return key[0]

    # ---- lockstep ---------------------------------------------------------------------------
    def join(self, busy: bool, cancel: bool = False) -> tuple[bool, bool]:
        """(any rank busy, any rank cancelling): every rank calls this once per engine step."""
        flags = torch.tensor([int(busy), int(cancel)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control)
        return bool(flags[0]), bool(flags[1])

    def agree(self, rows: int) -> int:
        """Every rank, once per step with decode graphs: `rows` its graph's padded batch size
        (0: nothing to run, -1: an eager step). Returns -1 when any rank runs eagerly (then all
        do, exchanging by counts), else the largest size (0: no rank runs a forward)."""
        flags = torch.tensor([int(rows < 0), max(rows, 0)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control)
        return -1 if flags[0] else int(flags[1])

    @contextlib.contextmanager
    def fixed_exchange(self, rows: int) -> Iterator[None]:
        """MoE calls inside the block have `rows` tokens on every rank and exchange fixed sizes
        (see the module docstring)."""
        self._fixed_rows = rows
        try:
            yield
        finally:
            self._fixed_rows = None

    # ---- one MoE layer ----------------------------------------------------------------------
    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
                  ) -> torch.Tensor:
        out = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(out, send, recv_counts, send_counts)
        return out

    def _counts(self, send_counts: torch.Tensor) -> list[int]:
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts)
        return recv.tolist()

    def _slots(self, prefix: str, ids: torch.Tensor) -> torch.Tensor:
        """Physical slot of each (token, slot) pair [T * k]: the expert itself, or with a
        placement, its copy (token index mod copies)."""
        if self.placement is None or prefix not in self.placement.layers:
            return ids.reshape(-1)
        if prefix not in self._routes:
            slots = self.placement.layers[prefix]
            e_total = max(slots) + 1
            where: list[list[int]] = [[] for _ in range(e_total)]
            for p, e in enumerate(slots):
                where[e].append(p)
            table = torch.tensor([w + [w[0]] * (self.world - len(w)) for w in where])
            self._routes[prefix] = (table.to(ids.device),
                                    torch.tensor([len(w) for w in where]).to(ids.device))
        table, count = self._routes[prefix]
        token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        return table[ids, token % count[ids]].reshape(-1)

    def moe(self, ops, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            shared: torch.Tensor, experts: dict[str, torch.Tensor], limit: float,
            prefix: str = "") -> torch.Tensor:
        """The block's FFN output [T, D] bf16, like `moe_mxfp4(x, ids, weights, shared=shared)`
        over all experts; `experts` holds this rank's slots of layer `prefix`."""
        t, d = x.shape
        k = ids.shape[1]
        per = experts["w13"].shape[0]
        flat = self._slots(prefix, ids)
        owner = torch.div(flat, per, rounding_mode="floor")
        order = torch.sort(owner, stable=True).indices  # pairs grouped by owner rank
        rows = torch.div(order, k, rounding_mode="floor")
        codes, scales = ops.act_quant_fp8(x=x[rows], block=32)
        packed = self._pack(codes.view(torch.uint8), scales,
                            (flat[order] - owner[order] * per).to(torch.int32),
                            weights.reshape(-1)[order].float())
        if self._fixed_rows is None:
            send_counts = torch.bincount(owner, minlength=self.world).to(torch.int64).cpu()
            y = self._serve(ops, experts, limit, packed, send_counts)
        else:
            if t != self._fixed_rows:
                raise RuntimeError(f"fixed exchange of {self._fixed_rows} rows: a MoE call "
                                   f"has {t}")
            y = self._serve_fixed(ops, experts, limit, packed, owner[order], t * k)
        # back in (token, slot) order; each token's slots added in ascending expert order
        slots = torch.empty_like(y)
        slots[order] = y
        slots = slots.view(t, k, d).float()
        by_expert = torch.sort(ids, dim=1, stable=True).indices
        slots = torch.gather(slots, 1, by_expert.unsqueeze(-1).expand(t, k, d))
        acc = torch.zeros(t, d, dtype=torch.float32, device=x.device)
        for j in range(k):
            acc = acc + slots[:, j]
        return (acc + shared.float()).to(torch.bfloat16)

    def serve(self, ops, experts: dict[str, torch.Tensor], limit: float, device,
              top_k: int) -> None:
        """Take part in one MoE layer with no tokens of its own: run this rank's experts on the
        other ranks' rows (`top_k`: the layer's experts per token)."""
        d = experts["w2"].shape[1]
        packed = self._pack(torch.empty(0, d, dtype=torch.uint8, device=device),
                            torch.empty(0, d // 32, dtype=torch.uint8, device=device),
                            torch.empty(0, dtype=torch.int32, device=device),
                            torch.empty(0, dtype=torch.float32, device=device))
        if self._fixed_rows is None:
            self._serve(ops, experts, limit, packed, torch.zeros(self.world, dtype=torch.int64))
        else:  # every row sent is padding
            self._serve_fixed(ops, experts, limit, packed,
                              torch.empty(0, dtype=torch.int64, device=device),
                              self._fixed_rows * top_k)

    @staticmethod
    def _pack(codes, scales, local_ids, weights) -> torch.Tensor:
        """One byte row per pair: FP8 codes, UE8M0 scales, local expert id, routing weight."""
        return torch.cat([codes, scales, local_ids.view(torch.uint8).view(-1, 4),
                          weights.view(torch.uint8).view(-1, 4)], dim=1)

    def _serve(self, ops, experts, limit, packed, send_counts) -> torch.Tensor:
        """Send the packed pairs (grouped by owner, `send_counts` per rank), run the local
        experts on what arrives, send the outputs back: [sum(send_counts), D] bf16 in the sent
        order."""
        sent = send_counts.tolist()
        got = self._counts(send_counts.to(packed.device) if packed.is_cuda else send_counts)
        r = self._exchange(packed, sent, got)
        return self._exchange(self._run(ops, experts, limit, r), got, sent)

    def _serve_fixed(self, ops, experts, limit, packed, owner, capacity: int) -> torch.Tensor:
        """`_serve` with `capacity` rows to and from every rank (pairs sorted by `owner`, then
        padding rows of no expert); no host synchronisation."""
        n, width = packed.shape  # width: D + D / 32 + 8 bytes
        per = experts["w13"].shape[0]
        dev = packed.device
        total = self.world * capacity
        send = torch.cat([torch.zeros(total, width - 8, dtype=torch.uint8, device=dev),
                          torch.full((total, 1), per, dtype=torch.int32,
                                     device=dev).view(torch.uint8),
                          torch.zeros(total, 4, dtype=torch.uint8, device=dev)], dim=1)
        first = torch.searchsorted(owner, owner)  # each owner's first pair
        dest = owner * capacity + torch.arange(n, device=dev) - first
        send[dest] = packed
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        out = self._run(ops, experts, limit, recv)
        back = torch.empty_like(out)
        dist.all_to_all_single(back, out)
        return back[dest]

    @staticmethod
    def _run(ops, experts, limit, r: torch.Tensor) -> torch.Tensor:
        """The local experts on received byte rows (one slot each) -> [rows, D] bf16."""
        d = experts["w2"].shape[1]
        nb = d // 32
        x = dequant_fp8_act(r[:, :d], r[:, d:d + nb].contiguous(), 32, dtype=torch.bfloat16)
        r_ids = r[:, d + nb:d + nb + 4].flatten().clone().view(torch.int32)  # fresh: aligned
        r_weights = r[:, d + nb + 4:].flatten().clone().view(torch.float32)
        out = ops.moe_mxfp4(x=x, ids=r_ids.to(torch.int64).unsqueeze(1),
                            weights=r_weights.unsqueeze(1), limit=limit, **experts)
        return out.to(torch.bfloat16)
