"""CUDA graphs for the DSpark draft block: `dspark_draft` with greedy drafts (exact
verification) captured once per padded batch size at warm-up; a step copies its anchors,
positions and slots into static buffers and replays the graph.

Owns `DraftGraphs`. Padded requests draft from position 0 of the reserved pad slot, whose draft
rings no request owns; the draft only reads the rings and writes scratch rows, and every row's
result depends on its own request only, so the real rows equal the eager draft's. Without CUDA
(or with graphs off) `draft` runs the same static padded call eagerly (the CPU tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.dspark import DraftOutput, dspark_draft, greedy
from shoal.model.state import KVCaches

logger = logging.getLogger(__name__)


class DraftGraphs:
    """Static draft inputs over `sizes` (padded batch sizes; a larger batch drafts eagerly)
    and, on CUDA with `use_graphs`, one graph per size."""

    def __init__(self, model: DeepseekV41, caches: KVCaches, *, sizes: Sequence[int],
                 pad_slot: int, use_graphs: bool) -> None:
        k = model.config.dspark_draft_len
        self.sizes = [b for b in sizes if b * k <= caches.max_tokens]
        self.model, self.caches, self.pad_slot = model, caches, pad_slot
        device = model.params["embed.weight"].device
        self.use_graphs = use_graphs and device.type == "cuda"
        full = self.sizes[-1] if self.sizes else 0
        self._host = torch.zeros(3, full, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._dev = torch.zeros(3, full, dtype=torch.int64, device=device)
        self._uploaded: torch.cuda.Event | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, DraftOutput] = {}
        self.capture_seconds = 0.0

    def fits(self, num_requests: int) -> bool:
        return bool(self.sizes) and 0 < num_requests <= self.sizes[-1]

    def _fill(self, anchors: Sequence[int], positions: Sequence[int], slots: Sequence[int],
              size: int) -> None:
        if self._uploaded is not None:  # the previous upload may still read the staging
            self._uploaded.synchronize()
        n, h = len(anchors), self._host.numpy()
        h[0, :n], h[1, :n], h[2, :n] = anchors, positions, slots
        h[0, n:size], h[1, n:size], h[2, n:size] = 0, 0, self.pad_slot
        self._dev.copy_(self._host, non_blocking=True)
        if self._dev.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def _call(self, size: int) -> DraftOutput:
        d = self._dev[:, :size]
        return dspark_draft(self.model, self.caches, d[0], d[1], d[2], sample_fn=greedy)

    def draft(self, anchors: Sequence[int], positions: Sequence[int],
              slots: Sequence[int]) -> DraftOutput:
        """Greedy drafts of len(anchors) requests (see `dspark_draft`; positions >= 0), through
        the captured graph of the next size up. The result views the graph's outputs: consume
        it before the next draft."""
        n = len(anchors)
        if not self.fits(n) or min(positions) < 0:
            raise ValueError(f"DraftGraphs.draft: {n} requests (sizes {self.sizes}) at "
                             f"positions >= {min(positions, default=0)}")
        size = next(b for b in self.sizes if b >= n)
        self._fill(anchors, positions, slots, size)
        if size in self._graphs:
            self._graphs[size].replay()
            out = self._outputs[size]
        else:
            out = self._call(size)
        return DraftOutput(out.draft_ids[:n], out.logits[:n], out.confidence[:n])

    def capture(self) -> None:
        """One eager call, then the capture, per size (largest first, one memory pool)."""
        if not self.use_graphs or not self.sizes:
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self._fill((), (), (), size)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._call(size)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[size] = self._call(size)
                self._graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        logger.info("CUDA graphs: captured %d draft graphs (batch sizes %s) in %.1f s",
                    len(self._graphs), self.sizes, self.capture_seconds)
