"""The per-step input of the model: `ForwardBatch` (flat token rows plus per-request metadata)
and `build_forward_batch`, which turns plain per-request chunks into it.

Owns the decoder tail-only prefill plan (model.md §3): for every decoder layer, which rows run in
full, which only produce their SWA kv, and the SWA floor of `bounded` replay. Invariant: row sets
shrink monotonically through the decoder (full(L+1) and kv(L+1) are inside full(L)); the last
row of every prefill and every decode row run in full everywhere, so `full` and `staircase`
produce exactly the reference's logits and caches, and `bounded` only changes what the floor
hides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shoal.model.config import ModelConfig

PREFILL_MODES = ("full", "staircase", "bounded")


@dataclass(frozen=True)
class RequestChunk:
    """What one request contributes to a step (plain data, built by the runner or a test).

    token_ids: the tokens at positions start .. start + len - 1 (computed in this step);
    history: the ids just before `start` (up to max_ngram - 1, oldest first) for the Engram
    n-grams. prefill_len: tokens known when this (re)prefill began (the tail-only plan is
    relative to it). logits: which rows need logits: "last" (the chunk reaches the end of the
    known tokens), "all" (prompt logprobs: forces every decoder row) or "none".
    """

    token_ids: Sequence[int]
    start: int
    slot: int
    block_ids: Sequence[int]
    prefill_len: int
    logits: str = "last"
    history: Sequence[int] = ()

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


@dataclass(frozen=True)
class LayerRows:
    """Rows (indices into the step's tokens) of one decoder layer: `prod` need the layer input
    (all rows at the first decoder layer, whose compressor runs everywhere), `kv` write SWA kv,
    `full` run the whole layer. None means every row."""

    prod: torch.Tensor | None
    kv: torch.Tensor | None
    full: torch.Tensor | None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_index: torch.Tensor  # [T] int64, request of each row (0 .. R-1)
    slots: torch.Tensor  # [R] int64, request slot (SWA ring, compressor state)
    chunk_start: torch.Tensor  # [R] int64, first position computed in this step
    block_table: torch.Tensor  # [R, max_blocks] int32 (-1 padded)
    engram_history: torch.Tensor  # [T, max_ngram - 1] int64 ids at p-1.. (-1 before start)
    logits_rows: torch.Tensor  # [T'] int64 rows whose logits are returned
    decoder_floor: torch.Tensor  # [T] int64, lowest SWA key position for decoder layers
    layer_rows: dict[int, LayerRows] = field(default_factory=dict)  # decoder layers only
    num_rows_max: int = 0  # max compressed rows visible to any row (r = 1 bound)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.slots.shape[0])

    def rows(self, layer: int) -> LayerRows:
        return self.layer_rows.get(layer, _ALL)


_ALL = LayerRows(None, None, None)


def decoder_thresholds(config: ModelConfig, prefill_len: int, mode: str,
                       replay_window: int) -> tuple[list[tuple[int, int]], int]:
    """Per decoder layer (in order): (full_start, kv_start) positions, and the SWA floor.

    full: every position runs every layer. staircase (exact): the last decoder layer runs in
    full on the last row and writes kv on the last `window` rows; each layer below runs in full
    where the layer above needs kv: full_start(k) = N - (W + (m - 2 - k) * (W - 1)).
    bounded(W_b): every decoder layer runs in full on the last W_b rows, and decoder SWA reads
    are floored at N - W_b (approximate).
    """
    n = prefill_len
    dec = list(range(config.decoder_start, config.num_layers))
    m = len(dec)
    w = config.sliding_window
    if mode == "full" or n == 0:
        return [(0, 0)] * m, 0
    if mode == "staircase":
        out = []
        for k in range(m):
            full_start = max(0, n - (w + (m - 2 - k) * (w - 1)))
            out.append((full_start, max(0, full_start - (w - 1))))
        return out, 0
    if mode == "bounded":
        start = max(0, n - replay_window)
        return [(start, start)] * m, start
    raise ValueError(f"prefill_mode: got {mode!r}, expected one of {PREFILL_MODES}")


def build_forward_batch(config: ModelConfig, chunks: Sequence[RequestChunk], *,
                        device: torch.device | str = "cpu", prefill_mode: str = "full",
                        replay_window: int = 140) -> ForwardBatch:
    """Flatten request chunks into a ForwardBatch. The bounded-mode SWA floor derives from
    prefill_len, so later decode steps of the same request keep the floor of its prefill."""
    if replay_window < config.sliding_window:
        raise ValueError(f"replay_window: got {replay_window}, expected >= sliding_window "
                         f"({config.sliding_window})")
    n_hist = max(config.engram_max_ngram_size - 1, 0)
    dec_layers = list(range(config.decoder_start, config.num_layers))
    ids, pos, req, hist, logit_rows, floors = [], [], [], [], [], []
    full_mask: list[list[torch.Tensor]] = [[] for _ in dec_layers]
    kv_mask: list[list[torch.Tensor]] = [[] for _ in dec_layers]
    row = 0
    for r, ch in enumerate(chunks):
        if ch.num_new <= 0:
            raise ValueError(f"request chunk {r}: no tokens to compute")
        mode = "full" if ch.logits == "all" else prefill_mode
        thresholds, floor = decoder_thresholds(config, ch.prefill_len, mode, replay_window)
        hist_ids = list(ch.history)[-n_hist:] if n_hist else []
        lo = ch.start - len(hist_ids)
        if lo < 0 or (lo > 0 and len(hist_ids) < n_hist):
            raise ValueError(f"request chunk {r}: history has {len(hist_ids)} ids before "
                             f"position {ch.start}, expected {min(ch.start, n_hist)}")
        known = torch.tensor(hist_ids + list(ch.token_ids), dtype=torch.int64)
        p = torch.arange(ch.start, ch.start + ch.num_new)
        ids.append(known[ch.start - lo:])
        pos.append(p)
        req.append(torch.full((ch.num_new,), r, dtype=torch.int64))
        floors.append(torch.full((ch.num_new,), floor, dtype=torch.int64))
        back = p.unsqueeze(1) - torch.arange(1, n_hist + 1)  # [n, n_hist] positions p - s
        hist.append(torch.where(back >= 0, known[(back - lo).clamp_min(0)], -1))
        for k, (full_start, kv_start) in enumerate(thresholds):
            full_mask[k].append(p >= full_start)
            kv_mask[k].append(p >= kv_start)
        row += ch.num_new
        if ch.logits == "all":
            logit_rows.extend(range(row - ch.num_new, row))
        elif ch.logits == "last":
            logit_rows.append(row - 1)
    max_blocks = max((len(c.block_ids) for c in chunks), default=0)
    table = torch.full((len(chunks), max(max_blocks, 1)), -1, dtype=torch.int32)
    for r, ch in enumerate(chunks):
        table[r, : len(ch.block_ids)] = torch.tensor(list(ch.block_ids), dtype=torch.int32)
    layer_rows: dict[int, LayerRows] = {}
    for k, layer in enumerate(dec_layers):
        full = torch.cat(full_mask[k]) if chunks else torch.zeros(0, dtype=torch.bool)
        kv = torch.cat(kv_mask[k]) if chunks else torch.zeros(0, dtype=torch.bool)
        if bool(full.all()):
            continue
        prod = None if k == 0 else torch.nonzero(kv).flatten().to(device)
        layer_rows[layer] = LayerRows(prod, torch.nonzero(kv).flatten().to(device),
                                      torch.nonzero(full).flatten().to(device))
    def cat(parts: list[torch.Tensor], *shape: int) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.zeros(0, *shape, dtype=torch.int64)

    positions = cat(pos)
    ratios = [r for r in config.compress_ratios[: config.num_layers] if r > 0]
    rmin = min(ratios) if ratios else 1
    return ForwardBatch(
        input_ids=cat(ids).to(device),
        positions=positions.to(device),
        req_index=cat(req).to(device),
        slots=torch.tensor([c.slot for c in chunks], dtype=torch.int64, device=device),
        chunk_start=torch.tensor([c.start for c in chunks], dtype=torch.int64, device=device),
        block_table=table.to(device),
        engram_history=cat(hist, n_hist).to(device),
        logits_rows=torch.tensor(logit_rows, dtype=torch.int64, device=device),
        decoder_floor=cat(floors).to(device),
        layer_rows=layer_rows,
        num_rows_max=int((positions.max() + 1) // rmin) if positions.numel() else 0,
    )
