"""CUDA graphs for the DSpark draft block: `dspark_draft` captured once per padded batch size at
warm-up, with greedy drafts (exact verification) and, for rejection-sampled verification, with
drafts sampled by `DraftSampler` over static per-request temperatures and seeds; a step copies
its anchors, positions, slots (and sampling parameters) into static buffers and replays.

Owns `DraftGraphs`. Padded requests draft greedily from position 0 of the reserved pad slot,
whose draft rings no request owns; the draft only reads the rings and writes scratch rows, and
every row's result depends on its own request only, so the real rows equal the eager draft's.
Without CUDA (or with graphs off) `draft_on_device` runs the same static padded call eagerly (the CPU
tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.dspark import DraftOutput, dspark_draft, greedy
from shoal.model.state import KVCaches
from shoal.runner.speculative import DraftSampler

logger = logging.getLogger(__name__)


class DraftGraphs:
    """Static draft inputs over `sizes` (padded batch sizes; a larger batch drafts eagerly)
    and, on CUDA with `use_graphs`, one graph per size and mode (greedy; with `sampled`, also
    sampled drafts)."""

    def __init__(self, model: DeepseekV41, caches: KVCaches, *, sizes: Sequence[int],
                 pad_slot: int, use_graphs: bool, sampled: bool = False) -> None:
        k = model.config.dspark_draft_len
        self.sizes = [b for b in sizes if b * k <= caches.max_tokens]
        self.model, self.caches, self.pad_slot = model, caches, pad_slot
        self.modes = (False, True) if sampled else (False,)
        device = model.params["embed.weight"].device
        self.use_graphs = use_graphs and device.type == "cuda"
        full = self.sizes[-1] if self.sizes else 0
        pin = device.type == "cuda"
        # rows: anchor, position, slot, greedy (0 / 1), seed; and the temperatures
        self._host = torch.zeros(5, full, dtype=torch.int64, pin_memory=pin)
        self._dev = torch.zeros(5, full, dtype=torch.int64, device=device)
        self._host_t = torch.ones(full, dtype=torch.float32, pin_memory=pin)
        self._dev_t = torch.ones(full, dtype=torch.float32, device=device)
        self._uploaded: torch.cuda.Event | None = None
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, bool], DraftOutput] = {}
        self.capture_seconds = 0.0

    def fits(self, num_requests: int, sampled: bool = False) -> bool:
        return (bool(self.sizes) and 0 < num_requests <= self.sizes[-1]
                and sampled in self.modes)

    def _fill(self, n: int, size: int,
              sampling: tuple[Sequence, Sequence, Sequence] | None) -> None:
        """Stage and upload the pad rows n .. size - 1 and the sampling rows of the first n
        (whose anchors, positions and slots the caller copies on the device)."""
        if self._uploaded is not None:  # the previous upload may still read the staging
            self._uploaded.synchronize()
        h, ht = self._host.numpy(), self._host_t.numpy()
        h[0, n:size], h[1, n:size], h[2, n:size] = 0, 0, self.pad_slot
        h[3, :size], h[4, :size], ht[:size] = 1, 0, 1.0  # pad (and greedy) rows: argmax
        if sampling is not None and n:
            greedy, temps, seeds = sampling
            h[3, :n], h[4, :n], ht[:n] = greedy, seeds, temps
        self._dev.copy_(self._host, non_blocking=True)
        self._dev_t.copy_(self._host_t, non_blocking=True)
        if self._dev.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def _call(self, size: int, sampled: bool) -> DraftOutput:
        d = self._dev[:, :size]
        sample = DraftSampler(d[3].bool(), self._dev_t[:size], d[4]) if sampled else greedy
        return dspark_draft(self.model, self.caches, d[0], d[1], d[2], sample_fn=sample)

    def _replay(self, n: int, size: int, sampled: bool) -> DraftOutput:
        key = (size, sampled)
        if key in self._graphs:
            self._graphs[key].replay()
            out = self._outputs[key]
        else:
            out = self._call(*key)
        return DraftOutput(out.draft_ids[:n], out.logits[:n], out.confidence[:n])

    def draft_on_device(self, anchors: torch.Tensor, positions: torch.Tensor,
                        slots: torch.Tensor, sampling: tuple[Sequence, Sequence, Sequence]
                        | None = None) -> DraftOutput:
        """The drafts of B requests (see `dspark_draft`; anchors, positions >= 0 and slots:
        [B] int64 on the device, copied into the static rows there, no sync): greedy, or with
        `sampling` (per request: greedy flag, temperature, seed; `draft_sampling`) drawn as
        `DraftSampler` draws them, through the captured graph of the next size up. The result
        views the graph's outputs: consume it before the next draft."""
        n = int(anchors.shape[0])
        if not self.fits(n, sampling is not None):
            raise ValueError(f"DraftGraphs.draft_on_device: {n} requests (sizes {self.sizes}, "
                             f"sampled {sampling is not None})")
        size = next(b for b in self.sizes if b >= n)
        self._fill(n, size, sampling)
        for i, values in enumerate((anchors, positions, slots)):
            self._dev[i, :n].copy_(values)
        return self._replay(n, size, sampling is not None)

    def capture(self) -> None:
        """One eager call, then the capture, per size and mode (largest first, one pool)."""
        if not self.use_graphs or not self.sizes:
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        with torch.inference_mode():
            for sampled in self.modes:
                for size in reversed(self.sizes):
                    self._fill(0, size, None)
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        self._call(size, sampled)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._outputs[(size, sampled)] = self._call(size, sampled)
                    self._graphs[(size, sampled)] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        logger.info("CUDA graphs: captured %d draft graphs (batch sizes %s, sampled %s) in "
                    "%.1f s", len(self._graphs), self.sizes, self.modes[-1],
                    self.capture_seconds)
