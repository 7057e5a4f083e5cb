"""Speculative decoding with the DSpark draft block, on the device: verification (exact match,
or the sampler's lossless rejection rule) and the next block's drafts, with nothing read back
inside the step.

A step that verifies k drafts runs the target on [anchor, d_1..d_k] and samples every row with
the request's own counter-based RNG at that row's position, as if the drafts had been
generated. Draft d_j is accepted while it equals the target's sample at its position (under
rejection sampling a rejected draft is never the residual's sample, so the same test holds),
and the first mismatching sample (or the bonus sample after all k) ends the step. Because
samples are keyed by (seed, position) and each row sees the same history as plain decoding
would, exact mode's output is token-for-token that of decoding without drafts.

After sampling, every request that sampled (structured output excepted) drafts its next block
from its last accepted sample; the drafts, the accepted counts and the confidence rule's keep
counts stay on the device in a `Proposal`, which the next step reads when it was planned before
this one's results were back (async scheduling, `runner/draft_patch.py`).

Nothing is rolled back: rejected rows wrote SWA/compressed/index rows, draft context and
compressor state at positions that are recomputed before anything reads them (rings and
compressor states have draft-length slack); the scheduler counts only anchor + accepted drafts
as computed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shoal.model.batch import ForwardBatch
from shoal.model.dspark import dspark_context, dspark_draft, greedy
from shoal.runner.inflight import to_device, upload
from shoal.sampling.params import GREEDY_TEMPERATURE
from shoal.sampling.rng import STREAM_DRAFT, gumbel_noise, seed_to_int64

if TYPE_CHECKING:
    from shoal.runner.draft_graphs import DraftGraphs


@dataclass(frozen=True)
class VerifyLayout:
    """Host layout of a speculative step's sampling requests (in draw order): request i's draws
    are first_draw[i] .. first_draw[i] + num_drafts[i]; draw j samples the token after the input
    at batch row input_row[i] + j, and is checked against the input of the next row while j is
    below its verify limit. context_rows: batch rows whose DSpark context is written."""

    ids: tuple[str, ...]
    chunks: tuple[int, ...]  # its chunk (plan order)
    first_draw: tuple[int, ...]
    input_row: tuple[int, ...]
    num_drafts: tuple[int, ...]
    drafting: tuple[bool, ...]  # drafts a next block (structured output does not)
    context_rows: tuple[int, ...]

    @property
    def max_drafts(self) -> int:
        return max(self.num_drafts, default=0)

    def draw_owner(self) -> list[int]:
        """Per draw, its request's index here."""
        return [i for i, k in enumerate(self.num_drafts) for _ in range(k + 1)]


@dataclass
class Proposal:
    """What a speculative step leaves on the device for the next one, per drafting request
    (`index`): the last accepted sample then the new drafts [B, 1 + K], the shift of the next
    anchor's position against a plan that counted every verified row as accepted (accepted -
    drafts in the chunk, <= 0) [B], the Engram ids before the next anchor (newest first)
    [B, n_hist], and the drafts the confidence rule keeps [B]."""

    index: dict[str, int]
    next_ids: torch.Tensor
    shift: torch.Tensor
    history: torch.Tensor
    keep: torch.Tensor
    positions: torch.Tensor  # [B] the last accepted input's position (the drafts' context end)
    draft_probs: torch.Tensor | None  # [B, K, V] q of sampled drafts (rejection); None: greedy


def verify_counts(confidence: torch.Tensor, threshold: float, budget: int = 0) -> torch.Tensor:
    """Per request, how many leading drafts to verify ([B] int64, on confidence's device). A
    draft's expected gain is the chance that it and the drafts before it are all accepted (the
    product of sigmoid(confidence)); draft i is kept while that is at least `threshold` (0 keeps
    every draft), and with a `budget` (> 0) only the `budget` drafts of the batch with the
    largest gains are (ties: the earlier draft, then the earlier request). A request's chances
    only fall along its block, so what is kept is always a prefix."""
    b, k = confidence.shape
    if threshold <= 0.0 and (budget <= 0 or budget >= b * k):
        return torch.full((b,), k, dtype=torch.int64, device=confidence.device)
    chance = torch.sigmoid(confidence.float()).cumprod(dim=1)
    keep = (chance >= threshold).int().cumprod(dim=1).bool()  # the threshold's prefixes
    if 0 < budget < b * k:
        gain = torch.where(keep, chance, torch.full_like(chance, -1.0))
        order = torch.argsort(-gain.t().flatten(), stable=True)[:budget]  # draft-major ties
        chosen = torch.zeros(k * b, dtype=torch.bool, device=confidence.device)
        chosen[order] = True
        keep = (chosen.view(k, b).t() & keep).int().cumprod(dim=1).bool()
    return keep.sum(dim=1)


def draft_sampling(states: list) -> tuple[list[bool], list[float], list[int]]:
    """Per request: whether it drafts greedily, its draft temperature and its RNG seed."""
    temps = [s.params.temperature for s in states]
    return ([t < GREEDY_TEMPERATURE for t in temps], [max(t, GREEDY_TEMPERATURE) for t in temps],
            [seed_to_int64(s.seed) for s in states])


class DraftSampler:
    """Drafts drawn from q = softmax(draft logits / T) with each request's temperature and the
    counter RNG (STREAM_DRAFT, at the drafted token's position); greedy requests draft the
    argmax. For rejection-sampled verification, which needs q. greedy [B] bool, temperature
    [B] fp32, seeds [B] int64 (the draft graphs pass static buffers)."""

    def __init__(self, greedy: torch.Tensor, temperature: torch.Tensor,
                 seeds: torch.Tensor) -> None:
        self.greedy, self.temperature, self.seeds = greedy, temperature, seeds

    @classmethod
    def of_states(cls, states: list, device: torch.device) -> DraftSampler:
        greedy, temps, seeds = draft_sampling(states)  # (pinned, non-blocking: no sync)
        return cls(to_device(torch.tensor(greedy), device),
                   to_device(torch.tensor(temps, dtype=torch.float32), device),
                   to_device(torch.tensor(seeds, dtype=torch.int64), device))

    def __call__(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        z = logits.float() / self.temperature.unsqueeze(1)
        noise = gumbel_noise(self.seeds, positions, logits.shape[1], STREAM_DRAFT)
        return torch.where(self.greedy, logits.argmax(dim=-1), (z + noise).argmax(dim=-1))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """q [B, k, V] of drafts drawn from `logits` [B, k, V]."""
        return torch.softmax(logits.float() / self.temperature.view(-1, 1, 1), dim=-1)


def draft_checks(input_ids: torch.Tensor, layout: VerifyLayout,
                 limits: torch.Tensor) -> torch.Tensor:
    """Per draw, the draft its sample is checked against: the input of the chunk's next row
    while the draw is below its request's verify limit (`limits` [B] int64), else -1."""
    rows, cols, owner = [], [], []
    for i, (row, k) in enumerate(zip(layout.input_row, layout.num_drafts, strict=True)):
        for j in range(k + 1):
            rows.append(row + min(j + 1, k))
            cols.append(j)
            owner.append(i)
    index = upload([rows, cols, owner], input_ids.device)
    return torch.where(index[1] < limits[index[2]], input_ids[index[0]], -1)


def accept(tokens: torch.Tensor, checks: torch.Tensor,
           layout: VerifyLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request: the drafts accepted (the leading draws whose sample equals their check)
    and the last accepted sample (the next anchor). tokens, checks [D] int64."""
    k = layout.max_drafts
    index = upload([[first + min(j, n) for j in range(k + 1)] for first, n in
                    zip(layout.first_draw, layout.num_drafts, strict=True)], tokens.device)
    sampled, checked = tokens[index], checks[index]  # [B, k + 1]
    match = (sampled[:, :k] == checked[:, :k]) & (checked[:, :k] >= 0)
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return accepted, sampled.gather(1, accepted.unsqueeze(1)).squeeze(1)


def propose_drafts(model, caches, batch: ForwardBatch, captures: torch.Tensor | None,
                   layout: VerifyLayout, accepted: torch.Tensor, last: torch.Tensor,
                   states: Mapping, confidence_threshold: float = 0.0, rejection: bool = False,
                   drafter: DraftGraphs | None = None, verify_budget: int = 0
                   ) -> Proposal | None:
    """Write the DSpark context of the step's rows (`layout.context_rows`, rejected drafts
    included: they are rewritten before they are read), then draft the next block of every
    drafting request from its last accepted sample `last` ([B] for the layout's requests, as
    `accepted`), keeping the drafts the confidence rule finds worth verifying (at most
    `verify_budget` in all when > 0). `rejection`: drafts are sampled (`DraftSampler`) and
    their q kept. The block goes through `drafter` (its CUDA graphs) when it fits.
    Returns None when no request drafts."""
    cfg = model.config
    device = batch.positions.device
    if layout.context_rows and captures is not None:
        dspark_context(model, batch, caches, captures, upload([layout.context_rows],
                                                              device)[0])
    chosen = [i for i, d in enumerate(layout.drafting) if d]
    if not chosen:
        return None
    ids = [layout.ids[i] for i in chosen]
    sel = upload([chosen, [layout.input_row[i] for i in chosen],
                  [layout.num_drafts[i] for i in chosen]], device)
    got = accepted[sel[0]]
    rows = sel[1] + got  # the last accepted input: the context ends at its position
    anchors, positions = last[sel[0]], batch.positions[rows]
    slots = batch.slots[batch.req_index[rows]]
    n_hist = batch.engram_history.shape[1]
    history = torch.cat([batch.input_ids[rows].unsqueeze(1),
                         batch.engram_history[rows, :max(n_hist - 1, 0)]], dim=1)[:, :n_hist]
    request_states = [states[r] for r in ids]
    sampler = DraftSampler.of_states(request_states, device) if rejection else None
    if drafter is not None and drafter.fits(len(ids), sampled=rejection):
        draft = drafter.draft_on_device(anchors, positions, slots, sampling=draft_sampling(
            request_states) if rejection else None)
    else:
        draft = dspark_draft(model, caches, anchors, positions, slots,
                             sample_fn=sampler or greedy)
    k = cfg.dspark_draft_len
    keep = verify_counts(draft.confidence[:, :k], confidence_threshold, verify_budget)
    q = None if sampler is None else sampler.probs(draft.logits[:, :k])
    return Proposal({r: b for b, r in enumerate(ids)},
                    torch.cat([anchors.unsqueeze(1), draft.draft_ids[:, :k]], dim=1),
                    got - sel[2], history, keep, positions, q)


def accept_on_host(layout: VerifyLayout, proposal: Proposal | None,
                   spec: Sequence[list], out, draft_len: int) -> None:
    """Fill the step's output from the host copies of its speculative results (`spec`:
    accepted and verified drafts per request, then, when some request drafted, the proposal's
    next ids and keep counts): each valid request's tokens (and logprobs) cut after its
    accepted drafts, and its kept drafts for the next step."""
    accepted, verified = spec[0], spec[1]
    for i, rid in enumerate(layout.ids):
        tokens = out.sampled_token_ids.get(rid)
        if tokens is None:  # an invalid row: the request ends
            continue
        out.sampled_token_ids[rid] = tokens[:accepted[i] + 1]
        if rid in out.logprobs:
            out.logprobs[rid] = out.logprobs[rid][:accepted[i] + 1]
        if layout.num_drafts[i]:
            out.verified[rid] = verified[i]
    if proposal is None:
        return
    next_ids, keep = spec[2], spec[3]
    for rid, b in proposal.index.items():
        if rid in out.sampled_token_ids:
            out.spec_token_ids[rid] = next_ids[b][1:1 + keep[b]]
            out.drafts_skipped += draft_len - keep[b]
