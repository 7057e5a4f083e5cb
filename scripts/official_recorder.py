"""Recording of the official reference's per-layer tensors, for scripts/official_goldens.py.

Patches of the reference's Block, Engram, Gate, the attention's top-k and the candidate filter
that only copy tensors out while a recording runs (`start` .. `assemble`), and the stable top-k
(exact ties lowest index first) whose sorted scores give each selection's k-th / (k+1)-th gap.
The forward computes the same bits with or without them.
"""

from __future__ import annotations

import collections

import torch

# while `run_reference(record=True)` runs: key -> one tensor per forward call; "layer" is the
# backbone layer whose block runs (its gate and indexer have no layer id of their own)
_REC: dict | None = None
_LAYER = [0]
_N_LAYERS = [0]


def start(n_layers: int) -> None:
    """Record from the next forward on (a model of `n_layers` backbone layers)."""
    global _REC
    _REC, _N_LAYERS[0] = {}, n_layers


def stop() -> None:
    global _REC
    _REC = None


def _record(key: str, value: torch.Tensor) -> None:
    if _REC is not None:
        _REC.setdefault(key, []).append(value.detach().clone())


def install(model) -> None:
    """Patches that record, per forward: each backbone layer's input stream (before its
    Engram) and pre_mix, the last layer's output stream and ffn_pre, the routed expert ids and
    the gate's k-th / (k+1)-th score gap, each index source's top-k rows (logical compressed
    rows, -1 padded) and the indexer's score gap, and the candidate source's mask. Recording
    only reads: the forward computes the same bits with or without it."""
    block_forward, engram_forward = model.Block.forward, model.Engram.forward
    gate_forward, compress_topk = model.Gate.forward, model.Attention._compress_topk_idxs
    select_blocks = model.select_candidate_blocks

    def block(self, x, start_pos, pre_mix, image_mask, *rest):
        if _REC is None:
            return block_forward(self, x, start_pos, pre_mix, image_mask, *rest)
        layer = _LAYER[0] = self.layer_id
        if layer > 0:
            if self.engram is None:  # else the Engram patch recorded the stream it was given
                _record(f"stream.{layer}", x[0])
            _record(f"pre.{layer}", pre_mix[0])
        out = block_forward(self, x, start_pos, pre_mix, image_mask, *rest)
        if layer == _N_LAYERS[0] - 1:
            _record(f"stream.{layer + 1}", out[0][0])
            _record(f"pre.{layer + 1}", out[1][0])
        return out

    def engram_fwd(self, x, hash_ids, token_mask=None):
        if self.layer_id > 0:
            _record(f"stream.{self.layer_id}", x[0])
        return engram_forward(self, x, hash_ids, token_mask)

    def gate(self, x, image_mask=None):
        weights, indices = gate_forward(self, x, image_mask)
        if _REC is not None:
            _record(f"experts.{_LAYER[0]}", indices.to(torch.uint8))
            _record(f"expert_gap.{_LAYER[0]}", _gap(self.topk))
        return weights, indices

    def topk_idxs(self, x, qr, latent, start_pos, offset, compress_len):
        idxs = compress_topk(self, x, qr, latent, start_pos, offset, compress_len)
        if _REC is not None and self.is_index_source:
            k = self.indexer.index_topk
            rows = torch.where(idxs[0] >= 0, idxs[0] - offset, -1).to(torch.int16)
            rows = torch.nn.functional.pad(rows, (0, k - rows.shape[-1]), value=-1)
            gap = _gap(idxs.shape[-1]) if compress_len and idxs.shape[-1] else \
                torch.full((x.shape[1],), torch.inf)
            _record(f"topk.{self.layer_id}", rows)
            _record(f"topk_gap.{self.layer_id}", gap)
        return idxs

    def candidates(logits, compress_lens, topk_blocks, block_size):
        keep = select_blocks(logits, compress_lens, topk_blocks, block_size)
        _record("candidates", keep[0])
        return keep

    model.Block.forward, model.Engram.forward, model.Gate.forward = block, engram_fwd, gate
    model.Attention._compress_topk_idxs = topk_idxs
    model.select_candidate_blocks = candidates


def assemble() -> dict[str, torch.Tensor]:
    """The recorded lists as fixture tensors over every row (prompt rows, then one per decode
    step): stream [n_layers, R, hc, D] bf16 and pre [n_layers, R, hc] fp32, entry j the input of
    layer j + 1 (j = n_layers - 1: the last layer's output, what the head collapses); experts
    [n_layers, R, k] uint8 and expert_gap [n_layers, R]; topk.L [R, index_topk] int16 and
    topk_gap.L [R]; candidates [R, max width] bool."""
    rec, n_layers = _REC, _N_LAYERS[0]
    out = {
        "stream": torch.stack([torch.cat(rec[f"stream.{j}"]) for j in range(1, n_layers + 1)]),
        "pre": torch.stack([torch.cat(rec[f"pre.{j}"]).float() for j in range(1, n_layers + 1)]),
        "experts": torch.stack([torch.cat(rec[f"experts.{j}"]) for j in range(n_layers)]),
        "expert_gap": torch.stack([torch.cat(rec[f"expert_gap.{j}"]) for j in range(n_layers)]),
    }
    for key in sorted(k for k in rec if k.startswith("topk")):
        out[key] = torch.cat(rec[key])
    if "candidates" in rec:
        width = max(m.shape[-1] for m in rec["candidates"])
        out["candidates"] = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[-1]))
                                       for m in rec["candidates"]])
    return {k: v.contiguous() for k, v in out.items()}




_TopK = collections.namedtuple("topk", "values indices")


# the sorted scores of the last top-k call: the recorder reads the k-th / (k+1)-th gap from it
_LAST_SORTED: list[torch.Tensor] = []


def stable_topk(self, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (torch's name)
    assert largest, "only the largest-k form is used by the reference"
    values, indices = torch.sort(self, dim=dim, descending=True, stable=True)
    _LAST_SORTED[:] = [values]
    return _TopK(values.narrow(dim, 0, k), indices.narrow(dim, 0, k))


def _gap(k: int) -> torch.Tensor:
    """Per row of the last top-k call: score k minus score k + 1 (inf where there is none or
    the (k+1)-th is -inf), fp32: how near the selection was to a tie."""
    values = _LAST_SORTED[0].float().flatten(0, -2)
    if values.shape[-1] <= k:
        return torch.full(values.shape[:1], torch.inf)
    gap = values[:, k - 1] - values[:, k]
    return torch.where(torch.isfinite(values[:, k]), gap, torch.inf)


