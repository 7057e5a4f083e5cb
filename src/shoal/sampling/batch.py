"""Per-row sampling parameters of one step as device tensors (`SamplingBatch`, built once per
step from `SamplingParams`), and the structured-output bitmask unpacking (`bitmask_to_bool`).

Invariant: built on the host from the rows' own parameters (no device sync: host uploads are
pinned and asynchronous); every tensor has one entry per row, in row order, token-id lists padded
with -1; the host flags (`any_*`) let the sampler skip whole stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from shoal.sampling.params import GREEDY_TEMPERATURE, SamplingParams
from shoal.sampling.rng import seed_to_int64


def _pad(rows: Sequence[Sequence[int]], fill: int) -> Tensor:
    """[len(rows), max_len] int64 padded with `fill` (max_len may be 0)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), fill, dtype=torch.int64)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out


def _pad_float(rows: Sequence[Sequence[float]]) -> Tensor:
    """[len(rows), max_len] f32 padded with 0 (max_len may be 0)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out


def _upload(host: Tensor, device: torch.device | str) -> Tensor:
    """`host` on `device` without waiting for the device: a CUDA copy from pageable memory may
    synchronise with the stream (and a step queued before it), one from pinned memory never."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling state for one step; all tensors on the sampling device.

    Token-id tensors are padded with -1. Build with `from_params`; the host flags let the sampler
    skip whole stages without a device sync.
    """

    temperature: Tensor  # [B] f32; 1.0 on greedy rows
    greedy: Tensor  # [B] bool
    top_k: Tensor  # [B] int64 in [1, V]; V = off
    top_p: Tensor  # [B] f32 in (0, 1]; 1 = off
    min_p: Tensor  # [B] f32 in [0, 1]; 0 = off
    repetition_penalty: Tensor  # [B] f32
    presence_penalty: Tensor  # [B] f32
    frequency_penalty: Tensor  # [B] f32
    seeds: Tensor  # [B] int64
    positions: Tensor  # [B] int64, position of the token being sampled
    output_token_ids: Tensor  # [B, L] int64 (-1 pad); rows without penalties are empty
    prompt_token_ids: Tensor  # [B, P] int64 (-1 pad); rows without repetition penalty empty
    suppressed_token_ids: Tensor  # [B, S] int64 (-1 pad): banned this step (min_tokens, bad words)
    # logit_bias: [B, L] int64 ids (-1 pad) and [B, L] f32 biases added to the logits
    bias_token_ids: Tensor
    bias_values: Tensor
    # allowed_token_ids: [B, A] int64 (-1 pad); a row with none is unrestricted
    allowed_token_ids: Tensor
    allowed_mask: Tensor | None  # [B, V] bool, True = allowed (structured output)
    # rejection-sampled verification: [B] int64, the draft each row's sample is checked
    # against (-1: none), and [B, V] f32, the distribution q it was drawn from; None: no row
    draft_token_ids: Tensor | None
    draft_probs: Tensor | None
    num_logprobs: tuple[int, ...]  # per row, -1 = off
    vocab_size: int
    all_greedy: bool
    any_greedy: bool
    any_penalties: bool
    any_min_p: bool
    any_top_k_or_p: bool

    @property
    def max_num_logprobs(self) -> int:
        """Largest requested top-N in the batch, -1 when no row asks for logprobs."""
        return max(self.num_logprobs, default=-1)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        seeds: Sequence[int],
        positions: Sequence[int],
        output_token_ids: Sequence[Sequence[int]],
        num_output_tokens: Sequence[int] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        allowed_mask: Tensor | None = None,
        draft_token_ids: Sequence[int] | None = None,
        draft_probs: Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Build the batch for one step.

        Args:
            params: one `SamplingParams` per row (already validated).
            seeds: per-row resolved seed (`rng.request_seed`), any int in [-2**63, 2**64).
            positions: per-row position of the token being sampled (prompt_len + num_output).
            output_token_ids: per-row tokens generated so far (penalties and bad words;
                min_tokens unless `num_output_tokens` is given, and then rows that read no
                outputs may be empty).
            num_output_tokens: per-row count of tokens generated so far (min_tokens).
            prompt_token_ids: per-row prompt tokens; needed only for repetition_penalty rows.
            vocab_size: V, the logits width.
            eos_token_ids: the model's EOS ids; banned below min_tokens unless ignore_eos.
            allowed_mask: optional [B, V] bool (True = allowed); see `bitmask_to_bool`.
            draft_token_ids, draft_probs: rejection-sampled verification: per row the draft
                its sample is checked against (-1: none) and [B, V] the distribution q the
                draft was drawn from (rows without a draft: anything); None otherwise.
            device: where the tensors live (the logits' device).
        """
        num_rows = len(params)
        if not (len(seeds) == len(positions) == len(output_token_ids) == num_rows):
            raise ValueError(
                f"SamplingBatch: seeds ({len(seeds)}), positions ({len(positions)}) and "
                f"output_token_ids ({len(output_token_ids)}) must have one entry per row "
                f"({num_rows})"
            )
        if prompt_token_ids is not None and len(prompt_token_ids) != num_rows:
            raise ValueError(
                f"SamplingBatch: prompt_token_ids has {len(prompt_token_ids)} rows, "
                f"expected {num_rows}"
            )
        if (draft_token_ids is None) != (draft_probs is None) or (
                draft_probs is not None and tuple(draft_probs.shape) != (num_rows, vocab_size)):
            raise ValueError("SamplingBatch: draft_token_ids and draft_probs [B, V] go "
                             "together")
        if allowed_mask is not None and (
            allowed_mask.dtype != torch.bool or tuple(allowed_mask.shape) != (num_rows, vocab_size)
        ):
            raise ValueError(
                f"SamplingBatch: allowed_mask must be bool [{num_rows}, {vocab_size}], got "
                f"{allowed_mask.dtype} {tuple(allowed_mask.shape)}"
            )
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        penalised = [p.has_penalties for p in params]
        repeated = [p.repetition_penalty != 1.0 for p in params]
        if any(repeated) and prompt_token_ids is None:
            raise ValueError("SamplingBatch: repetition_penalty needs prompt_token_ids")
        if num_output_tokens is None:
            num_output_tokens = [len(out) for out in output_token_ids]
        elif len(num_output_tokens) != num_rows:
            raise ValueError(f"SamplingBatch: num_output_tokens has {len(num_output_tokens)} "
                             f"rows, expected {num_rows}")
        suppressed: list[Sequence[int]] = []
        for p, count, out in zip(params, num_output_tokens, output_token_ids, strict=True):
            banned = p.banned_after(out) if p.bad_words_token_ids else ()
            if count < p.min_tokens:
                eos = () if p.ignore_eos else tuple(eos_token_ids)
                banned += tuple(p.stop_token_ids) + eos  # type: ignore[operator]
            suppressed.append(banned)

        # one host tensor per dtype, so a step uploads 2 small tensors (plus the padded id
        # lists when a row needs them) instead of one per field
        floats = torch.tensor(
            [
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [p.repetition_penalty for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
            ],
            dtype=torch.float32,
        ).reshape(6, num_rows)
        ints = torch.tensor(
            [
                [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                [seed_to_int64(s) for s in seeds],
                list(positions),
                [int(g) for g in greedy],
            ],
            dtype=torch.int64,
        ).reshape(4, num_rows)

        def ids(rows: list[Sequence[int]]) -> Tensor:
            padded = _pad(rows, -1)
            if padded.shape[1] == 0:  # nothing to upload
                return torch.empty(padded.shape, dtype=torch.int64, device=device)
            return _upload(padded, device)

        floats, ints = _upload(floats, device), _upload(ints, device)
        biases = _pad_float([[b for _, b in p.logit_bias] for p in params])
        bias_values = _upload(biases, device) if biases.shape[1] else \
            torch.empty(biases.shape, dtype=torch.float32, device=device)  # (no upload)

        on_device = {
            "temperature": floats[0], "top_p": floats[1], "min_p": floats[2],
            "repetition_penalty": floats[3], "presence_penalty": floats[4],
            "frequency_penalty": floats[5],
            "top_k": ints[0], "seeds": ints[1], "positions": ints[2], "greedy": ints[3] != 0,
            "output_token_ids": ids(
                [o if pen else () for o, pen in zip(output_token_ids, penalised, strict=True)]
            ),
            "prompt_token_ids": ids(
                [
                    q if rep else ()
                    for q, rep in zip(prompt_token_ids or [()] * num_rows, repeated, strict=True)
                ]
            ),
            "suppressed_token_ids": ids(suppressed),
            "bias_token_ids": ids([[t for t, _ in p.logit_bias] for p in params]),
            "bias_values": bias_values,
            "allowed_token_ids": ids([p.allowed_token_ids or () for p in params]),
        }
        return cls(
            **on_device,
            allowed_mask=None if allowed_mask is None else allowed_mask.to(device),
            draft_token_ids=None if draft_token_ids is None
            else _upload(torch.tensor(list(draft_token_ids), dtype=torch.int64), device),
            draft_probs=None if draft_token_ids is None else draft_probs.to(device),
            num_logprobs=tuple(-1 if p.logprobs is None else p.logprobs for p in params),
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_penalties=any(penalised),
            any_min_p=any(p.min_p > 0.0 and not g for p, g in zip(params, greedy, strict=True)),
            any_top_k_or_p=any(
                (0 < p.top_k < vocab_size or p.top_p < 1.0) and not g
                for p, g in zip(params, greedy, strict=True)
            ),
        )


def bitmask_to_bool(bitmask: Tensor, vocab_size: int) -> Tensor:
    """Unpack an int32 token bitmask [B, ceil(V/32)] (bit j of word w = token 32w+j, 1 = allowed,
    the llguidance/xgrammar layout) to a bool mask [B, V]."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.flatten(1)[:, :vocab_size].to(torch.bool)
