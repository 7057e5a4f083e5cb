"""CUDA graphs for decode and verify steps: the model forward (embedding -> logits of every row)
is captured once per (padded batch size, context bound, rows per request) at warm-up; a step
then copies its inputs into static buffers and replays the graph. Sampling stays eager, after
the graph.

Owns `DecodeGraphs`. A step fits (`DecodeGraphs.width`) when every request computes one token
and wants its logits (pure decode), or, with speculative decoding, when every request computes
its anchor and up to draft-length drafts past its prompt with their logits (a verify step,
padded to 1 + draft length rows per request); there are at most `max_batch` requests and every
position is below the largest context bound. It is padded to the next captured batch size:
padded requests compute positions of a reserved pad slot whose block table points only at a
reserved pad block, so they read and write nothing a real request owns; a verify step's padding
rows inside a request continue its positions, like drafts that get rejected (whatever they
write is recomputed before anything reads it). The indexer width comes from the context bound
(`ForwardBatch.max_position`), not from the step, so every shape in the graph is static; columns
past a row's visible count score -inf and the top-k breaks ties by index, so the logits equal
those of the plain eager path.

Under expert parallelism every rank captures the same graphs in the same order, and a step
replays the size the ranks agreed on (`ExpertParallel.agree`), with the MoE exchanging fixed
sizes.

Invariant: `forward` runs exactly the computation that is captured; without CUDA (or with
graphs off) it runs the same static padded batch eagerly, which is what the CPU tests compare
with the plain eager path. The inputs reach the device in two non-blocking copies from pinned
staging buffers, and nothing between them and the logits reads device data on the host.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from shoal.model.batch import ForwardBatch, RequestChunk
from shoal.model.config import ModelConfig
from shoal.model.deepseek_v41 import DeepseekV41, ForwardOutput
from shoal.model.state import KVCaches
from shoal.runner.inflight import TokenPatch, to_device

if TYPE_CHECKING:
    from shoal.runner.draft_patch import DraftPatch

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_CONTEXT_BOUND = 512  # smallest captured indexer bound (tokens of context)
PREFILL_WARMUP_CAP = 2048  # largest prefill chunk run at warm-up (memory of reference ops)
NUM_INT64_FIELDS = 5  # input_ids, positions, slots, chunk_start, decoder_floor (+ history)


def batch_sizes(max_batch: int, wanted: Sequence[int] = ()) -> list[int]:
    """Captured batch sizes: `wanted` (sorted, those above `max_batch` dropped), or by default
    the powers of two below `max_batch`, then `max_batch` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch: got {max_batch}, expected >= 1")
    if wanted:
        return sorted({b for b in wanted if b <= max_batch} or {max_batch})
    return [b for b in GRAPH_BATCH_SIZES if b < max_batch] + [max_batch]


def context_bounds(max_context: int, min_bound: int = MIN_CONTEXT_BOUND) -> list[int]:
    """Captured context bounds (positions + 1): min_bound doubling, then `max_context`."""
    out, bound = [], min_bound
    while bound < max_context:
        out.append(bound)
        bound *= 2
    return [*out, max_context]


def is_pure_decode(chunks: Sequence[RequestChunk]) -> bool:
    """Every request computes exactly one token and samples from it (the captured step)."""
    return bool(chunks) and all(ch.num_new == 1 and ch.logits == "last" and ch.replay is None
                                for ch in chunks)


class DecodeGraphs:
    """Static decode inputs, and (on CUDA with `use_graphs`) one graph per (size, bound,
    rows per request).

    model / caches: the runner's; the caches must hold `pad_slot` and `pad_block`, which no
    request ever owns. max_blocks: block-table width of a request at max_context. sizes: the
    batch sizes to capture (`batch_sizes`; default powers of two up to max_batch).
    verify_rows: with speculative decoding, 1 + the draft length: verify steps (each request
    its anchor and up to that many drafts) are padded to it. hidden: also keep the forward's
    DSpark captures (speculative decoding).
    """

    def __init__(self, model: DeepseekV41, caches: KVCaches, *, max_batch: int,
                 max_context: int, max_blocks: int, pad_slot: int, pad_block: int,
                 use_graphs: bool, min_bound: int = MIN_CONTEXT_BOUND,
                 sizes: Sequence[int] = (), verify_rows: int = 0, hidden: bool = False) -> None:
        if max_batch > caches.max_tokens:
            raise ValueError(f"max_batch: got {max_batch}, more than the caches' scratch rows "
                             f"({caches.max_tokens})")
        self.model, self.caches, self.hidden = model, caches, hidden
        self.sizes = batch_sizes(max_batch, sizes)
        # verify steps: the sizes whose padded rows fit the scratch rows
        self.verify_sizes = [b for b in self.sizes if b * verify_rows <= caches.max_tokens]
        self.widths = (1, verify_rows) if verify_rows > 1 and self.verify_sizes else (1,)
        self.bounds = context_bounds(max_context, min(min_bound, max_context))
        self.pad_slot, self.pad_block = pad_slot, pad_block
        device = model.params["embed.weight"].device
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        cfg = model.config
        self.n_hist = max(cfg.engram_max_ngram_size - 1, 0)
        self._cap = self.sizes[-1] * self.widths[-1]  # rows of every static field
        pin = device.type == "cuda"
        self._host64 = torch.zeros(self._cap * (NUM_INT64_FIELDS + self.n_hist),
                                   dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(self.sizes[-1], max_blocks, dtype=torch.int32,
                                   pin_memory=pin)
        self._dev64 = torch.zeros_like(self._host64, device=device)
        self._dev32 = torch.full((self.sizes[-1], max_blocks), pad_block, dtype=torch.int32,
                                 device=device)
        self._req_index = {q: torch.arange(self._cap, device=device) // q for q in self.widths}
        self._uploaded: torch.cuda.Event | None = None
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int, int], ForwardOutput] = {}
        self._pool = None
        self.capture_seconds = 0.0

    # ---- static inputs ------------------------------------------------------------------
    def static_batch(self, size: int, bound: int, q: int = 1) -> ForwardBatch:
        """The ForwardBatch over the static buffers for `size` requests of `q` rows each and
        context `bound`."""
        cap, rows = self._cap, size * q

        def field(i: int, n: int) -> torch.Tensor:
            return self._dev64[i * cap: i * cap + n]

        hist = self._dev64[NUM_INT64_FIELDS * cap:].view(cap, self.n_hist)[:rows]
        return ForwardBatch(
            input_ids=field(0, rows), positions=field(1, rows),
            req_index=self._req_index[q][:rows], slots=field(2, size),
            chunk_start=field(3, size), block_table=self._dev32[:size],
            engram_history=hist, logits_rows=None, decoder_floor=field(4, rows),
            layer_rows={}, max_position=bound - 1)

    def width(self, chunks: Sequence[RequestChunk]) -> int:
        """Rows per request of the graph that runs `chunks`; 0: none (eager). 1: pure decode;
        the verify width: every request a decode row (or several) past its prompt with its
        logits, no replay or ring snapshot."""
        if not chunks or len(chunks) > self.sizes[-1] or \
                max(len(ch.block_ids) for ch in chunks) > self._host32.shape[1]:
            return 0
        if is_pure_decode(chunks):
            q = 1
        elif self.widths[-1] > 1 and len(chunks) <= self.verify_sizes[-1] and all(
                ch.replay is None and ch.restore_snapshot < 0 and not ch.save_snapshots
                and ch.start >= ch.prefill_len and ch.num_new <= self.widths[-1]
                and (ch.logits == "all" or (ch.logits == "last" and ch.num_new == 1))
                for ch in chunks):
            q = self.widths[-1]
        else:
            return 0
        return q if max(ch.start for ch in chunks) + q - 1 < self.bounds[-1] else 0

    def fits(self, chunks: Sequence[RequestChunk]) -> bool:
        return self.width(chunks) > 0

    def bucket(self, num_requests: int, max_position: int, q: int = 1) -> tuple[int, int]:
        size = next(b for b in (self.sizes if q == 1 else self.verify_sizes)
                    if b >= num_requests)
        bound = next(c for c in self.bounds if c > max_position)
        return size, bound

    def _fill(self, batch: ForwardBatch | None, size: int, q: int = 1) -> torch.Tensor | None:
        """Stage a host (CPU) batch, padded to `size` requests of `q` rows, and upload it.
        Returns each real row's static row (None when q is 1: row r is request r)."""
        if self._uploaded is not None:  # the previous upload may still read the staging
            self._uploaded.synchronize()
        cap, n = self._cap, 0 if batch is None else batch.num_requests
        h, h32 = self._host64.numpy(), self._host32.numpy()  # views: cheap host writes
        hist = h[NUM_INT64_FIELDS * cap:].reshape(cap, self.n_hist)
        dst = None
        if q == 1:
            pads = (0, 0, self.pad_slot, 0, 0)
            values = (() if batch is None else
                      (batch.input_ids, batch.positions, batch.slots, batch.chunk_start,
                       batch.decoder_floor))
            for i, pad in enumerate(pads):
                if n:
                    h[i * cap: i * cap + n] = values[i].numpy()
                h[i * cap + n: i * cap + size] = pad
            if n and self.n_hist:
                hist[:n] = batch.engram_history.numpy()
            hist[n:size] = -1
        else:
            dst = self._stage_verify(batch, size, q, h, hist)
        if n:
            width = batch.block_table.shape[1]
            h32[:n, :width] = batch.block_table.numpy()
            h32[:n, width:] = -1
        h32[n:size] = self.pad_block
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32[:size].copy_(self._host32[:size], non_blocking=True)
        if self._dev64.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return dst

    def _stage_verify(self, batch: ForwardBatch | None, size: int, q: int, h, hist
                      ) -> torch.Tensor | None:
        """The int64 fields of a verify batch: request r's rows go to static rows r*q.. and
        its padding rows continue its positions (like drafts that will be rejected: what
        they write is recomputed before it is read); pad requests compute positions 0.. of
        the pad slot. Returns each real row's static row."""
        cap, rows = self._cap, size * q
        n = 0 if batch is None else batch.num_requests
        req, offset = torch.arange(rows) // q, torch.arange(rows) % q
        start, floor = torch.zeros(size, dtype=torch.int64), torch.zeros(size, dtype=torch.int64)
        ids = torch.zeros(rows, dtype=torch.int64)
        hist[:rows] = -1
        h[2 * cap: 2 * cap + size] = self.pad_slot
        dst = None
        if n:  # (a real row's position is its request's start + its offset already)
            start[:n] = batch.chunk_start
            dst = batch.req_index * q + batch.positions - batch.chunk_start[batch.req_index]
            floor[batch.req_index] = batch.decoder_floor  # one floor per decode request
            ids[dst] = batch.input_ids
            if self.n_hist:
                hist[dst.numpy()] = batch.engram_history.numpy()
            h[2 * cap: 2 * cap + n] = batch.slots.numpy()
        positions = torch.where(req < n, start[req] + offset, offset)
        h[0: rows] = ids.numpy()
        h[cap: cap + rows] = positions.numpy()
        h[3 * cap: 3 * cap + size] = start.numpy()
        h[4 * cap: 4 * cap + rows] = floor[req].numpy()
        return dst

    # ---- one step -----------------------------------------------------------------------
    def padded_size(self, chunks: Sequence[RequestChunk]) -> int:
        """The batch size whose graph runs `chunks` (they must fit)."""
        q = self.width(chunks)
        return next(b for b in (self.sizes if q == 1 else self.verify_sizes) if b >= len(chunks))

    def forward(self, batch: ForwardBatch, patch: TokenPatch | DraftPatch | None = None,
                min_size: int = 0) -> ForwardOutput:
        """The forward of a decode or verify ForwardBatch built on the host (CPU tensors,
        `layer_rows` empty; see `width`) through the captured graph when there is one: logits
        for `batch.logits_rows` (every row when None) and, with `hidden`, the DSpark captures
        of every row, as the eager forward returns them. `patch` writes inputs still on the
        device (async scheduling) into the static batch after the upload. A
        decode step's result is a view of the graph's output: consume it (in stream order:
        work queued before the next step's replay) before the next step. `min_size`: pad to at
        least this captured size (expert parallelism: the size every rank agreed on)."""
        if batch.layer_rows:
            raise ValueError("DecodeGraphs.forward: a batch with tail-only layer rows")
        n, t = batch.num_requests, batch.num_tokens
        q = 1 if t == n else self.widths[-1]
        if t > n * q or batch.req_index.device.type != "cpu":
            raise ValueError("DecodeGraphs.forward: not a decode or verify batch on the host")
        size, bound = self.bucket(max(n, min_size), int(batch.chunk_start.max()) + q - 1, q)
        dst = self._fill(batch, size, q)
        if patch is not None:
            patch.apply_static(self.static_batch(size, bound, q), dst, q)
        key = (size, bound, q)
        if key in self._graphs:
            self._graphs[key].replay()
            out = self._outputs[key]
        else:
            with self._exchange(size * q):
                out = self.model.forward(self.static_batch(size, bound, q), self.caches,
                                         capture=self.hidden)
        if dst is None:  # decode: static row r is request r, each its logits row
            return ForwardOutput(out.logits[:n],
                                 None if out.captures is None else out.captures[:n])
        rows = dst if batch.logits_rows is None else dst[batch.logits_rows]  # (host tensors)
        rows, dst = (to_device(r, self.device) for r in (rows, dst))
        return ForwardOutput(out.logits.index_select(0, rows),
                             None if out.captures is None else out.captures.index_select(0, dst))

    # ---- warm-up ------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every (size, bound) of each width, largest first, sharing one memory pool.
        Each size runs once eagerly before its first capture, at the largest bound: Triton compiles and
        autotunes there (the autotuned GEMMs' keys depend on the rows, not on the bound). A
        smaller bound may still compile (or load from the disk cache) a kernel variant inside
        its capture, which is legal there; the log counts them. Only the pad slot and pad
        block are written."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        warmed: set[tuple[int, int]] = set()
        in_capture = 0
        with torch.inference_mode(), count_triton_compilations() as compiled:
            for q in self.widths:
                for bound in reversed(self.bounds):
                    for size in reversed(self.sizes if q == 1 else self.verify_sizes):
                        self._fill(None, size, q)
                        static = self.static_batch(size, bound, q)
                        if (size, q) not in warmed:
                            warmed.add((size, q))
                            side.wait_stream(torch.cuda.current_stream())  # after the upload
                            with torch.cuda.stream(side), self._exchange(size * q):
                                self.model.forward(static, self.caches, capture=self.hidden)
                            torch.cuda.current_stream().wait_stream(side)
                        before = len(compiled)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=self._pool), \
                                self._exchange(size * q):
                            self._outputs[(size, bound, q)] = self.model.forward(
                                static, self.caches, capture=self.hidden)
                        in_capture += len(compiled) - before
                        self._graphs[(size, bound, q)] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        logger.info("CUDA graphs: captured %d graphs (batch sizes %s x context bounds %s x rows "
                    "per request %s) in %.1f s; %d kernel variants compiled inside the "
                    "captures", len(self._graphs), self.sizes, self.bounds, self.widths,
                    self.capture_seconds, in_capture)

    def _exchange(self, rows: int) -> contextlib.AbstractContextManager:
        """Expert parallelism: the MoE exchanges fixed sizes (the same graphs on every rank)."""
        ep = self.model.ep
        return contextlib.nullcontext() if ep is None else ep.fixed_exchange(rows)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


def prefill_warmup_chunks(config: ModelConfig, *, max_tokens: int, max_context: int,
                          block_size: int, pad_slot: int, pad_block: int,
                          cap: int = PREFILL_WARMUP_CAP) -> list[RequestChunk]:
    """Chunks that make a run's prefill kernels compile at start-up, on the pad slot and pad
    block only (every block-table entry is the pad block, so all writes alias there).

    Triton specialises integer arguments on divisibility by 16 (and == 1) and some kernels
    pick constexpr tiles from the row count or the indexer width, so: T = 2^k and 2^k + 1 rows
    from position 0 (up to min(max_tokens, cap): larger chunks could compile late), and 1 and
    17 rows ending at every context bound (indexer widths up to max_context / r)."""
    n_hist = max(config.engram_max_ngram_size - 1, 0)
    limit = min(max_tokens, cap, max_context)
    shapes, t = [], 1
    while t <= limit:
        shapes += [(t, 0)] + ([(t + 1, 0)] if t + 1 <= limit and t > 1 else [])
        t *= 2
    for bound in context_bounds(max_context):
        shapes += [(n, bound - n) for n in (1, 17) if n <= min(bound, max_tokens)]
    chunks = []
    for n, start in shapes:
        blocks = [pad_block] * -(-(start + n) // block_size)
        chunks.append(RequestChunk([0] * n, start, pad_slot, blocks, start + n, "last",
                                   [0] * min(start, n_hist)))
    return chunks


@contextlib.contextmanager
def count_triton_compilations() -> Iterator[list[str]]:
    """Collect the name of every Triton kernel specialisation compiled (JIT, in this process)
    inside the block; the previous `jit_post_compile_hook` is restored afterwards. Without
    Triton: nothing to count."""
    names: list[str] = []
    try:
        from triton import knobs
    except ImportError:
        yield names
        return
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*, fn, **kwargs):  # type: ignore[no-untyped-def]
        names.append(f"{fn.module}.{fn.name}")
        if previous is not None:
            return previous(fn=fn, **kwargs)
        return None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        knobs.runtime.jit_post_compile_hook = previous
