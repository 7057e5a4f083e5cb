"""Speculative decoding with the DSpark draft block: exact-match verification.

A step that verifies k drafts runs the target on [anchor, d_1..d_k] and samples every row with
the request's own counter-based RNG at that row's position, as if the drafts had been
generated. Draft d_j is accepted while it equals the target's sample at its position, and the
first mismatching sample (or the bonus sample after all k) ends the step. Because samples are
keyed by (seed, position) and each row sees the same history as plain decoding would, the
output is token-for-token identical to decoding without drafts, for any sampling parameters.

Nothing is rolled back: rejected rows wrote SWA/compressed/index rows and compressor state at
positions that are recomputed before anything reads them (state slot p % r, position-indexed
rings and pages); the scheduler counts only anchor + accepted drafts as computed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from shoal.model.batch import ForwardBatch
from shoal.model.dspark import dspark_context, dspark_draft, greedy
from shoal.sampling.params import GREEDY_TEMPERATURE
from shoal.sampling.rng import STREAM_DRAFT, gumbel_noise, seed_to_int64
from shoal.scheduler.step_plan import StepPlan

if TYPE_CHECKING:
    from shoal.runner.draft_graphs import DraftGraphs


def accept_drafts(plan: StepPlan, out) -> None:
    """Cut each verifying request's samples at the first one that differs from its draft."""
    for item in plan.scheduled:
        k = item.num_spec_tokens
        samples = out.sampled_token_ids.get(item.request_id)
        if not k or samples is None:
            continue
        drafts = item.token_ids[len(item.token_ids) - k:]
        accepted = 0
        while accepted < k and samples[accepted] == drafts[accepted]:
            accepted += 1
        out.sampled_token_ids[item.request_id] = samples[:accepted + 1]
        if item.request_id in out.logprobs:
            out.logprobs[item.request_id] = out.logprobs[item.request_id][:accepted + 1]


def drafts_worth_verifying(confidence: torch.Tensor, threshold: float,
                           budget: int = 0) -> list[int]:
    """Per request, how many leading drafts to verify. A draft's expected gain is the chance
    that it and the drafts before it are all accepted (the product of sigmoid(confidence));
    draft i is kept while that is at least `threshold` (0 keeps every draft), and with a
    `budget` (> 0) only the `budget` drafts of the batch with the largest gains are (ties: the
    earlier draft, then the earlier request). A request's chances only fall along its block,
    so what is kept is always a prefix."""
    b, k = confidence.shape
    if threshold <= 0.0 and (budget <= 0 or budget >= b * k):
        return [k] * b
    chance = torch.sigmoid(confidence.float()).cumprod(dim=1)
    keep = (chance >= threshold).int().cumprod(dim=1).bool()  # the threshold's prefixes
    if 0 < budget < int(keep.sum()):
        gain = torch.where(keep, chance, torch.full_like(chance, -1.0))
        order = torch.argsort(-gain.t().flatten(), stable=True)[:budget]  # draft-major ties
        chosen = torch.zeros(k * b, dtype=torch.bool, device=confidence.device)
        chosen[order] = True
        keep = chosen.view(k, b).t() & keep
        keep = keep.int().cumprod(dim=1).bool()
    return keep.sum(dim=1).tolist()


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
        greedy, temps, seeds = draft_sampling(states)
        return cls(torch.tensor(greedy, device=device),
                   torch.tensor(temps, dtype=torch.float32, device=device),
                   torch.tensor(seeds, dtype=torch.int64, device=device))

    def __call__(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        z = logits.float() / self.temperature.unsqueeze(1)
        noise = gumbel_noise(self.seeds, positions, logits.shape[1], STREAM_DRAFT)
        return torch.where(self.greedy, logits.argmax(dim=-1), (z + noise).argmax(dim=-1))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """q [B, k, V] of drafts drawn from `logits` [B, k, V]."""
        return torch.softmax(logits.float() / self.temperature.view(-1, 1, 1), dim=-1)


def propose_drafts(model, caches, batch: ForwardBatch, captures: torch.Tensor | None,
                   plan: StepPlan, states: Mapping, out, confidence_threshold: float = 0.0,
                   rejection: bool = False, drafter: DraftGraphs | None = None,
                   verify_budget: int = 0) -> bool:
    """Write the draft context of this step's valid rows, then draft the next block for every
    request that sampled (structured-output requests excluded: their matcher would have to
    follow the drafts), keeping the drafts the confidence rule finds worth verifying (at most
    `verify_budget` in all when > 0).
    `rejection`: drafts are sampled (`DraftSampler`) and their q kept for verification. The
    draft block goes through `drafter` (its CUDA graphs) when it fits.
    Returns whether a draft block ran (no request to draft for: False)."""
    cfg = model.config
    keep, at = [], 0
    anchors, positions, slots, ids = [], [], [], []
    for item in plan.scheduled:
        n = item.num_new_tokens
        tokens = out.sampled_token_ids.get(item.request_id)
        computed = len(tokens) if (item.num_spec_tokens and tokens) else n
        if item.num_spec_tokens and not tokens:
            computed = 0  # invalid row: the request ends
        lo = max(item.start_position, item.prefill_len - cfg.sliding_window)
        hi = item.start_position + computed  # exclusive
        keep.extend(range(at + lo - item.start_position, at + hi - item.start_position))
        at += n
        state = states.get(item.request_id)
        if item.sample and tokens and state is not None and not state.structured:
            anchors.append(tokens[-1])
            positions.append(hi - 1)
            slots.append(item.slot)
            ids.append(item.request_id)
    device = batch.positions.device
    if keep and captures is not None:
        dspark_context(model, batch, caches, captures,
                       torch.tensor(keep, dtype=torch.int64, device=device))
    if not ids:
        return False
    sampler = DraftSampler.of_states([states[r] for r in ids], device) if rejection else None
    if drafter is not None and drafter.fits(len(ids), sampled=rejection):
        draft = drafter.draft(anchors, positions, slots, sampling=draft_sampling(
            [states[r] for r in ids]) if rejection else None)
    else:
        draft = dspark_draft(model, caches, torch.tensor(anchors, device=device),
                             torch.tensor(positions, dtype=torch.int64, device=device),
                             torch.tensor(slots, dtype=torch.int64, device=device),
                             sample_fn=sampler or greedy)
    k = cfg.dspark_draft_len
    keep_counts = drafts_worth_verifying(draft.confidence[:, :k], confidence_threshold,
                                         verify_budget)
    q = sampler.probs(draft.logits[:, :k]) if sampler is not None else None
    for b, (rid, drafted, n) in enumerate(zip(ids, draft.draft_ids.tolist(), keep_counts,
                                              strict=True)):
        out.spec_token_ids[rid] = drafted[:n]
        out.drafts_skipped += k - n
        state = states[rid]
        state.draft_probs = None if q is None or state.params.temperature < \
            GREEDY_TEMPERATURE else q[b, :n]
    return True
