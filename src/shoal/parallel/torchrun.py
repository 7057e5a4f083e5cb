"""Data parallelism under `torchrun` (one node or several): every process runs the same script,
holds one engine replica (GPU `LOCAL_RANK`, or the CPU with gloo) and takes its share of each
call's requests; the outputs are gathered so that every rank returns all of them, in input
order, as one engine would.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 \\
        -m shoal.cli generate --model flash --expert-parallel -i in.jsonl -o out.jsonl

Invariants (shared with `parallel/data_parallel.py`): each rank splits a call's requests by the
same rule (`split_by_load`) and gives request i of the call the global index its position and
the earlier calls imply, so seeds and request ids do not depend on the number of ranks; a rank
with no requests still takes part (with expert parallelism it serves its experts until no rank
is busy). Only rank 0 writes the CLI's output file. An interrupt ends the job (torchrun stops
every worker); the output file keeps what was written, and `--resume` continues it.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.config import RunnerConfig, ShoalError
from shoal.engine.outputs import RequestOutput
from shoal.parallel.placement import split_by_load


def launched_world() -> int:
    """The number of processes torchrun started (1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "TORCHELASTIC_RUN_ID" in os.environ else 1


class TorchrunRank:
    """This process's place in a torchrun job; `device` is where its engine goes."""

    def __init__(self, data_parallel_size: int, device: str,
                 timeout_s: float = RunnerConfig.collective_timeout_s) -> None:
        self.world = launched_world()
        if data_parallel_size not in (1, self.world):
            raise ShoalError(f"under torchrun the data-parallel size is the number of processes "
                             f"({self.world}); got data_parallel_size={data_parallel_size}")
        if device not in ("auto", "cuda", "cpu"):
            raise ShoalError(f"under torchrun each rank takes GPU LOCAL_RANK: use device 'auto', "
                             f"'cuda' or 'cpu', not {device!r}")
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = device != "cpu" and torch.cuda.is_available()
        self.device = f"cuda:{self.local_rank}" if use_cuda else "cpu"
        if not dist.is_initialized():
            if use_cuda:
                torch.cuda.set_device(self.local_rank)
            dist.init_process_group("nccl" if use_cuda else "gloo",
                                    timeout=timedelta(seconds=timeout_s))
            # torn down before the interpreter: live gloo threads at exit abort the process,
            # and torchrun would report a finished job as failed
            atexit.register(dist.destroy_process_group)
        self.rank = dist.get_rank()
        # outputs travel as Python objects on the CPU
        self.group = dist.new_group(backend="gloo",
                                    timeout=timedelta(seconds=timeout_s))
        self._next_index = 0

    @property
    def primary(self) -> bool:
        """Rank 0: the one that writes files and prints summaries."""
        return self.rank == 0

    def run(self, items: Sequence[dict],
            run_local: Callable[[list[dict]], Iterator[tuple[int, RequestOutput]]],
            serve_until_idle: Callable[[], None]) -> Iterator[tuple[int, RequestOutput]]:
        """This rank's share through `run_local` (yielded as they finish), then the other
        ranks' outputs once every rank is done."""
        base, self._next_index = self._next_index, self._next_index + len(items)
        share = split_by_load(items, self.world)[self.rank]
        mine: list[tuple[int, RequestOutput]] = []
        for position, out in run_local([{"request_index": base + p, **items[p]} for p in share]):
            mine.append((share[position], out))
            yield share[position], out
        serve_until_idle()
        everyone: list[list[tuple[int, RequestOutput]] | None] = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        for rank, outs in enumerate(everyone):
            if rank != self.rank:
                yield from outs

    def summed(self, counts: dict[str, list[int]]) -> dict[str, list[int]]:
        """Per-key element-wise sums over the ranks (e.g. expert loads)."""
        everyone: list[dict[str, list[int]] | None] = [None] * self.world
        dist.all_gather_object(everyone, counts, group=self.group)
        return {key: [sum(c) for c in zip(*(d[key] for d in everyone), strict=True)]
                for key in counts}
