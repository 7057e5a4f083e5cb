"""The sampling half of a step: the runner's per-request sampling state, the draws of a step
(one per sampled logits row), their `SamplingBatch`, the readback of the sampled tokens into a
`RunnerOutput`, and prompt logprobs.

Invariant: a request's `RequestState` is built once, from the `NewRequest` of the first plan
that schedules it, and dropped when a plan lists it as finished; its outputs grow by what
`read_samples` returns for it. Positions and min_tokens counts come from the plan (they count
a token still in flight); only rows with penalties read the output values, and the engine
never launches such a row before its previous token is back (`RuntimeError` otherwise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from shoal.runner.inflight import to_device
from shoal.runner.step_io import LaunchedStep, RunnerOutput
from shoal.sampling import Sampler, SamplingBatch, SamplingParams, compute_prompt_logprobs
from shoal.scheduler.step_plan import NewRequest, ScheduledRequest


@dataclass
class RequestState:
    """A live request's sampling inputs and the outputs the runner has read back for it."""

    params: SamplingParams
    seed: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: list[int] = field(default_factory=list)
    # rejection-sampled verification: [n, V] f32 on the device, the distributions the pending
    # drafts were drawn from (None: greedy drafts, checked by exact match)
    draft_probs: torch.Tensor | None = None

    @classmethod
    def from_new(cls, new: NewRequest) -> RequestState:
        return cls(new.sampling, new.seed, new.prompt_token_ids)

    @property
    def structured(self) -> bool:
        return self.params.structured is not None


class Draw(NamedTuple):
    """One sampled logits row: `request`'s token at `position`, after `drafts` (the drafts
    verified before this row, seen as already generated; `UNRESOLVED` while on the device);
    `draft`: its sample is checked against the next draft (not the row after the last)."""

    request_id: str
    state: RequestState
    position: int
    num_outputs: int  # outputs before this row's token (min_tokens)
    drafts: tuple[int, ...] = ()
    draft: bool = False


def draws_of(item: ScheduledRequest, state: RequestState) -> list[Draw]:
    """Row j of a chunk verifying k drafts samples the token after anchor + drafts[:j]."""
    k = item.num_spec_tokens
    if not k:
        position = item.end_position
        return [Draw(item.request_id, state, position, position - item.num_prompt_tokens)]
    drafts = tuple(item.token_ids[len(item.token_ids) - k:])
    position = item.end_position - k
    return [Draw(item.request_id, state, position + j, position + j - item.num_prompt_tokens,
                 drafts[:j], j < k) for j in range(k + 1)]


def sample(sampler: Sampler, logits: torch.Tensor, step: LaunchedStep, *, vocab_size: int,
           eos_token_id: int | None, grammar_masks: Mapping[str, torch.Tensor],
           checks: torch.Tensor | None = None, shift: torch.Tensor | None = None
           ) -> list[torch.Tensor]:
    """Sample every draw of `step` from `logits` (one row per draw); the tokens stay on the
    device in `step.token_ids`. Returns the tensors to read back (tokens, validity, logprobs).
    Speculative decoding: `checks` [D] (the draft each row is checked against, -1: none)
    feed the rejection rule of rows whose drafts were sampled; `shift` [D] moves the rows'
    positions (a verify step planned before its drafts' acceptance was known)."""
    draws = step.draws
    mask = None
    if any(d.request_id in grammar_masks for d in draws):
        mask = torch.ones(len(draws), vocab_size, dtype=torch.bool)
        for i, d in enumerate(draws):
            if d.request_id in grammar_masks:
                mask[i] = grammar_masks[d.request_id]
        mask = to_device(mask, logits.device)
    history = []
    for d in draws:
        if not d.state.params.reads_outputs:
            history.append(())
            continue
        known = d.state.output_token_ids
        if len(known) != d.num_outputs - len(d.drafts):
            raise RuntimeError(f"request {d.request_id!r}: a row that reads its outputs "
                               "(penalties, bad words) was launched before its previous token "
                               "was read back")
        history.append(known + list(d.drafts) if d.drafts else known)
    batch = SamplingBatch.from_params(
        [d.state.params for d in draws], seeds=[d.state.seed for d in draws],
        positions=[d.position for d in draws], output_token_ids=history,
        num_output_tokens=[d.num_outputs for d in draws],
        prompt_token_ids=[d.state.prompt_token_ids for d in draws], vocab_size=vocab_size,
        eos_token_ids=() if eos_token_id is None else (eos_token_id,), allowed_mask=mask,
        device=logits.device)
    if shift is not None:
        batch = dataclasses.replace(batch, positions=batch.positions + shift)
    if checks is not None:
        batch = _sampled_drafts(batch, draws, checks)
    result = sampler.sample(logits, batch)
    step.token_ids = result.token_ids
    if not any(item.num_spec_tokens for item in step.plan.scheduled):  # one draw each
        step.draw_index = {d.request_id: i for i, d in enumerate(draws)}
    lp = result.logprobs
    return [result.token_ids, result.valid] + (
        [lp.token_ids, lp.logprobs, lp.ranks] if lp is not None else [])


def _sampled_drafts(batch: SamplingBatch, draws: list[Draw],
                    checks: torch.Tensor) -> SamplingBatch:
    """`batch` with the drafts of the rows checked against a draft drawn from a distribution q
    (rejection-sampled verification): per row its draft (-1: none) and [B, V] q (zeros
    elsewhere)."""
    rows = [(i, d) for i, d in enumerate(draws) if d.draft and
            d.state.draft_probs is not None]
    if not rows:
        return batch
    device = checks.device
    sampled = torch.zeros(len(draws), dtype=torch.bool)
    probs = torch.zeros(len(draws), batch.vocab_size, dtype=torch.float32, device=device)
    for i, d in rows:
        sampled[i] = True
        probs[i] = d.state.draft_probs[len(d.drafts)]
    ids = torch.where(to_device(sampled, device), checks, -1)
    return dataclasses.replace(batch, draft_token_ids=ids, draft_probs=probs)


def read_samples(step: LaunchedStep) -> None:
    """Wait for `step`'s sampled tokens (only for them) and fill its output: tokens per
    request, invalid rows, per-token logprobs."""
    assert step.readback is not None
    host = step.readback.wait()
    host = host[:len(host) - len(step.spec_tensors)]  # (speculative results follow)
    tokens, valid = host[0].tolist(), host[1].tolist()
    lp_ids, lp_values, ranks = ([t.tolist() for t in host[2:]] if len(host) > 2
                                else (None, None, None))
    out = step.out
    for i, d in enumerate(step.draws):
        rid = d.request_id
        if rid in out.invalid_ids:
            continue
        if not valid[i]:
            out.invalid_ids.append(rid)
            out.sampled_token_ids.pop(rid, None)
            continue
        out.sampled_token_ids.setdefault(rid, []).append(tokens[i])
        n = d.state.params.logprobs
        if n is not None and lp_ids is not None:
            top = list(zip(lp_ids[i][1:n + 1], lp_values[i][1:n + 1], strict=True))
            out.logprobs.setdefault(rid, []).append((lp_values[i][0], ranks[i], top))


def record_outputs(out: RunnerOutput, states: Mapping[str, RequestState]) -> None:
    """Append the step's (accepted) tokens to the live requests' outputs."""
    for rid, tokens in out.sampled_token_ids.items():
        state = states.get(rid)
        if state is not None:
            state.output_token_ids.extend(tokens)


def prompt_logprobs(item: ScheduledRequest, state: RequestState, logits: torch.Tensor,
                    out: RunnerOutput) -> None:
    """Logprob of each next prompt token of the chunk (position p predicts p + 1); `logits`
    holds one row per chunk token."""
    prompt = state.prompt_token_ids
    start = item.start_position
    n = min(item.num_new_tokens, len(prompt) - 1 - start)
    if n <= 0:
        return
    targets = torch.tensor(prompt[start + 1: start + 1 + n], device=logits.device)
    k = state.params.prompt_logprobs
    lp = compute_prompt_logprobs(logits[:n], targets, k)
    entries = out.prompt_logprobs.setdefault(item.request_id, [])
    for i in range(n):
        top = list(zip(lp.token_ids[i, 1:k + 1].tolist(), lp.logprobs[i, 1:k + 1].tolist(),
                       strict=True))
        entries.append((start + i + 1, int(targets[i]), float(lp.logprobs[i, 0]),
                        int(lp.ranks[i]), top))
