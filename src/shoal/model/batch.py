"""The per-step input of the model: `ForwardBatch` (flat token rows plus per-request metadata)
and `build_forward_batch`, which turns plain per-request chunks into it. The decoder layers'
row sets come from the tail-only prefill plan (`model/tail_prefill.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shoal.model.config import ModelConfig
from shoal.model.tail_prefill import ALL_ROWS, LayerRows, decoder_layer_rows, decoder_thresholds


@dataclass(frozen=True)
class RequestChunk:
    """What one request contributes to a step (plain data, built by the runner or a test).

    token_ids: the tokens at positions start .. start + len - 1 (computed in this step);
    history: the ids just before `start` (up to max_ngram - 1, oldest first) for the Engram
    n-grams. prefill_len: tokens known when this (re)prefill began (the tail-only plan is
    relative to it). logits: which rows need logits: "last" (the chunk reaches the end of the
    known tokens), "all" (prompt logprobs: forces every decoder row) or "none".
    restore_snapshot: the ring snapshot to copy into the slot before the forward (a prefix-cache
    hit resuming at `start`; -1: none). save_snapshots: (block boundary, snapshot id) pairs to
    save after the chunk is computed (model/ring_snapshots.py). replay: (first, boundary) of a
    prefix-cache hit resumed by a bounded replay: positions first .. boundary - 1 are computed
    again only to rebuild the SWA rings (their paged KV is the cache's and is not written), and
    every layer's SWA reads are floored at `first` (older ring rows are not this request's).
    """

    token_ids: Sequence[int]
    start: int
    slot: int
    block_ids: Sequence[int]
    prefill_len: int
    logits: str = "last"
    history: Sequence[int] = ()
    restore_snapshot: int = -1
    save_snapshots: Sequence[tuple[int, int]] = ()
    replay: tuple[int, int] | None = None

    @classmethod
    def from_sequence(cls, ids: Sequence[int], start: int, num_new: int, slot: int,
                      block_ids: Sequence[int], prefill_len: int, logits: str = "last",
                      lookback: int = 3) -> RequestChunk:
        """Chunk of a full token list (tests and simple drivers)."""
        return cls(list(ids[start:start + num_new]), start, slot, block_ids, prefill_len,
                   logits, list(ids[max(0, start - lookback):start]))

    @property
    def num_new(self) -> int:
        return len(self.token_ids)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_index: torch.Tensor  # [T] int64, request of each row (0 .. R-1)
    slots: torch.Tensor  # [R] int64, request slot (SWA ring, compressor state)
    chunk_start: torch.Tensor  # [R] int64, first position computed in this step
    block_table: torch.Tensor  # [R, max_blocks] int32 (-1 padded)
    engram_history: torch.Tensor  # [T, max_ngram - 1] int64 ids at p-1.. (-1 before start)
    logits_rows: torch.Tensor | None  # [T'] int64 rows whose logits are returned; None: all
    decoder_floor: torch.Tensor  # [T] int64, lowest SWA key position for decoder layers
    layer_rows: dict[int, LayerRows] = field(default_factory=dict)  # decoder layers only
    max_position: int = -1  # largest position in the step (host int: no device sync)
    # ring snapshots (host data): ring_snapshots.Restore / Save tuples
    snapshot_restores: tuple[tuple[int, int, int], ...] = ()
    snapshot_saves: tuple[tuple[int, int, int, int, int], ...] = ()
    # prefix-cache bounded replay (None when no request replays): per row, the lowest SWA key
    # position of every layer; per request, the first position whose paged KV is written
    swa_floor: torch.Tensor | None = None  # [T] int64
    kv_write_start: torch.Tensor | None = None  # [R] int64

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.slots.shape[0])

    def rows(self, layer: int) -> LayerRows:
        return self.layer_rows.get(layer, ALL_ROWS)


def build_forward_batch(config: ModelConfig, chunks: Sequence[RequestChunk], *,
                        device: torch.device | str = "cpu", prefill_mode: str = "full",
                        replay_window: int = 140) -> ForwardBatch:
    """Flatten request chunks into a ForwardBatch. The bounded-mode SWA floor derives from
    prefill_len, so later decode steps of the same request keep the floor of its prefill.

    Host cost matters here (it runs every step): Python touches each request once, building
    flat lists; everything per row is tensor arithmetic."""
    if replay_window < config.sliding_window:
        raise ValueError(f"replay_window: got {replay_window}, expected >= sliding_window "
                         f"({config.sliding_window})")
    n_hist = max(config.engram_max_ngram_size - 1, 0)
    known: list[int] = []  # per request: history ids then new ids, concatenated
    known_base, lo_pos, starts, lengths, slots, floors = [], [], [], [], [], []
    thresholds, logits_mode, tables = [], [], []
    plans: dict[tuple[int, str], tuple[list[tuple[int, int]], int]] = {}
    for r, ch in enumerate(chunks):
        n = len(ch.token_ids)
        if n <= 0:
            raise ValueError(f"request chunk {r}: no tokens to compute")
        hist_ids = list(ch.history)[-n_hist:] if n_hist else []
        if len(hist_ids) != min(ch.start, n_hist):
            raise ValueError(f"request chunk {r}: history has {len(hist_ids)} ids before "
                             f"position {ch.start}, expected {min(ch.start, n_hist)}")
        mode = "full" if ch.logits == "all" else prefill_mode
        key = (ch.prefill_len, mode)
        if key not in plans:
            plans[key] = decoder_thresholds(config, ch.prefill_len, mode, replay_window)
        layer_starts, floor = plans[key]
        known_base.append(len(known))
        known.extend(hist_ids)
        known.extend(ch.token_ids)
        lo_pos.append(ch.start - len(hist_ids))
        starts.append(ch.start)
        lengths.append(n)
        slots.append(ch.slot)
        floors.append(floor)
        thresholds.append(layer_starts)
        logits_mode.append(ch.logits)
        tables.append(list(ch.block_ids))
    num_req = len(starts)
    length_t = torch.tensor(lengths, dtype=torch.int64)
    t = sum(lengths)
    # output_size spares repeat_interleave its own pass over the lengths. The H200 machine's
    # host profile (16 cores, 2026-11-29) had aten::repeat_interleave at 1.3 ms of CPU per call
    # at batch 64; a 2-core CPU shows 0.01 ms either way. Unexplained: recheck there.
    req = torch.repeat_interleave(torch.arange(num_req), length_t, output_size=t)  # [T]
    first_row = torch.cumsum(length_t, 0) - length_t  # [R]
    start_t = torch.tensor(starts, dtype=torch.int64)
    positions = start_t[req] + torch.arange(t) - first_row[req]  # [T]
    known_t = torch.tensor(known, dtype=torch.int64)
    base = torch.tensor(known_base, dtype=torch.int64)[req] - torch.tensor(
        lo_pos, dtype=torch.int64)[req]  # known index = base + position
    input_ids = known_t[base + positions] if t else torch.zeros(0, dtype=torch.int64)
    back = positions.unsqueeze(1) - torch.arange(1, n_hist + 1)  # [T, n_hist] positions p - s
    hist = torch.where(back >= 0, known_t[(base.unsqueeze(1) + back).clamp_min(0)]
                       if t else back, -1)
    layer_rows = decoder_layer_rows(config, positions, req, thresholds, device)
    last = first_row + length_t - 1
    logit_rows = [list(range(int(first_row[r]), int(last[r]) + 1)) if m == "all"
                  else [int(last[r])] if m == "last" else [] for r, m in enumerate(logits_mode)]
    width = max((len(b) for b in tables), default=0)
    table = torch.tensor([b + [-1] * (width - len(b)) for b in tables] or [[-1]],
                         dtype=torch.int32)
    if width == 0:
        table = torch.full((num_req, 1), -1, dtype=torch.int32)
    restores = tuple((ch.slot, ch.start, ch.restore_snapshot) for ch in chunks
                     if ch.restore_snapshot >= 0)
    saves = tuple((ch.slot, ch.start, int(first_row[r]), b, sid)
                  for r, ch in enumerate(chunks) for b, sid in ch.save_snapshots)
    swa_floor = kv_write_start = None
    if any(ch.replay for ch in chunks):
        firsts = torch.tensor([ch.replay[0] if ch.replay else 0 for ch in chunks])
        kv_write_start = torch.tensor([ch.replay[1] if ch.replay else 0 for ch in chunks])
        swa_floor = firsts[req]
    flat = [i for rows in logit_rows for i in rows]
    every = flat == list(range(t))  # every row, in order (decode): no gather before the head
    return ForwardBatch(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        req_index=req.to(device),
        slots=torch.tensor(slots, dtype=torch.int64, device=device),
        chunk_start=start_t.to(device),
        block_table=table.to(device),
        engram_history=hist.to(device),
        logits_rows=None if every else torch.tensor(flat, dtype=torch.int64, device=device),
        decoder_floor=torch.tensor(floors, dtype=torch.int64)[req].to(device),
        layer_rows=layer_rows,
        max_position=max((st + n - 1 for st, n in zip(starts, lengths, strict=True)),
                         default=-1),
        snapshot_restores=restores,
        snapshot_saves=saves,
        swa_floor=None if swa_floor is None else swa_floor.to(device),
        kv_write_start=None if kv_write_start is None else kv_write_start.to(device),
    )
