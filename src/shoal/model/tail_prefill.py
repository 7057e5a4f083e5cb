"""The decoder tail-only prefill plan (model.md §3): for every decoder layer, which rows of a
step run in full, which only produce their SWA kv, and the SWA floor of `bounded` replay.

Layers before the last kv source (the encoder) run on every prompt row; the decoder layers run
on each prompt's tail. Invariant: row sets shrink monotonically through the decoder (full(L+1)
and kv(L+1) are inside full(L)); the last row of every prefill and every decode row run in full
everywhere, so `full` and `staircase` produce exactly the reference's logits and caches, and
`bounded` only changes what the floor hides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.model.config import ModelConfig

PREFILL_MODES = ("full", "staircase", "bounded")


@dataclass(frozen=True)
class LayerRows:
    """Rows (indices into the step's tokens) of one decoder layer: `prod` need the layer input
    (all rows at the first decoder layer, whose compressor runs everywhere), `kv` write SWA kv,
    `full` run the whole layer. None means every row."""

    prod: torch.Tensor | None
    kv: torch.Tensor | None
    full: torch.Tensor | None


ALL_ROWS = LayerRows(None, None, None)


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
    m = config.num_layers - config.decoder_start
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


def decoder_layer_rows(config: ModelConfig, positions: torch.Tensor, req: torch.Tensor,
                       thresholds: Sequence[Sequence[tuple[int, int]]],
                       device: torch.device | str) -> dict[int, LayerRows]:
    """Row sets of the decoder layers that do not run on every row of the step.

    positions, req: [T] host tensors (position and request of each row); thresholds: per
    request, `decoder_thresholds`' per-layer (full_start, kv_start)."""
    dec_layers = range(config.decoder_start, config.num_layers)
    out: dict[int, LayerRows] = {}
    if not len(dec_layers) or not len(thresholds):
        return out
    limits = torch.tensor(thresholds, dtype=torch.int64)[req]  # [T, m, 2]
    for k, layer in enumerate(dec_layers):
        full = positions >= limits[:, k, 0]
        if bool(full.all()):
            continue
        kv = torch.nonzero(positions >= limits[:, k, 1]).flatten().to(device)
        out[layer] = LayerRows(None if k == 0 else kv, kv,
                               torch.nonzero(full).flatten().to(device))
    return out
