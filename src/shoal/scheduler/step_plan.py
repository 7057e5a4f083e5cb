"""What one engine step computes (`StepPlan`) and what the runner hands back (`StepResult`).

Owns: the plain-data contract between `Scheduler` and `ModelRunner`. Everything here is a
dataclass of ints, strings, tuples, lists and dicts, so a plan can be pickled and broadcast to
other ranks.

Invariant (per scheduled request r): `r.token_ids` are the tokens at positions
`[r.start_position, r.start_position + r.num_new_tokens)`; `r.block_ids` cover at least
`r.start_position + r.num_new_tokens` positions; `r.sample` is True iff that end equals the
number of tokens known for the request, i.e. this chunk produces the next token. With async
scheduling a token may be known by position only (`request.UNRESOLVED`, sampled by the step
still in flight): it is then the single token of a decode chunk, never a history id.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    - `slot`: the request slot holding its fixed state (SWA rings, compressor pending groups).
    - `token_ids`: the new tokens of this step (prompt tokens while prefilling; on a decode step,
      the last sampled token, or `UNRESOLVED` when the previous step is still in flight: the
      runner then takes it from that step's sampled tokens on the device).
    - `start_position`: absolute position of `token_ids[0]` (== num_computed_tokens before it).
    - `block_ids`: the request's full block table after this step's allocation; block i holds
      positions [i * block_size, (i + 1) * block_size) in every kv-source layer.
    - `prefill_len`: tokens known when the current (re)prefill started (prompt, or prompt +
      outputs after a preemption); positions < prefill_len are "prefill" rows, which is what the
      runner needs for the decoder-tail (CED) decision.
    - `num_prompt_tokens`: length of the original prompt (output index = position - this + 1).
    - `sample`: this chunk reaches the end of the known tokens, so sample one token (the runner
      gathers logits only for these rows).
    - `is_new_in_slot`: the slot's state must be reset before this chunk (first chunk after an
      admission or re-admission after preemption).
    - `history_token_ids`: up to `num_history_tokens` tokens just before `start_position`
      (Engram n-gram context), so a runner needs no per-slot id history.
    """

    request_id: str
    slot: int
    token_ids: tuple[int, ...]
    start_position: int
    num_new_tokens: int
    block_ids: tuple[int, ...]
    prefill_len: int
    num_prompt_tokens: int
    sample: bool
    is_new_in_slot: bool
    history_token_ids: tuple[int, ...] = ()
    # the last num_spec_tokens of token_ids are drafts to verify (speculative decoding): the
    # runner returns the accepted prefix + one target token, and only 1 + accepted positions
    # count as computed
    num_spec_tokens: int = 0

    @property
    def end_position(self) -> int:
        """One past the last position computed in this step."""
        return self.start_position + self.num_new_tokens

    @property
    def is_prefill(self) -> bool:
        """Some of this chunk's positions lie below prefill_len (prompt or recompute rows)."""
        return self.start_position < self.prefill_len


@dataclass(frozen=True)
class StepPlan:
    """Everything the runner needs for one step.

    - `scheduled`: running requests first (admission order), then newly admitted ones.
    - `preempted_ids`: requests preempted in this step; their slots and blocks are already free
      (the runner may drop any per-slot bookkeeping; the next user of the slot comes with
      `is_new_in_slot=True`).
    - `finished_ids`: requests that finished since the previous plan (stop, abort, error); their
      slots and blocks are already free.
    - `num_scheduled_tokens`: sum of `num_new_tokens` (<= max_num_batched_tokens).
    """

    step_id: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...] = ()
    finished_ids: tuple[str, ...] = ()
    num_scheduled_tokens: int = 0
    block_size: int = 0

    @property
    def is_empty(self) -> bool:
        """Nothing to run (the engine can skip the runner, but must still call `update`)."""
        return not self.scheduled

    @property
    def num_sampled_requests(self) -> int:
        return sum(1 for r in self.scheduled if r.sample)


@dataclass
class StepResult:
    """The runner's answer for one plan.

    `sampled_token_ids[request_id]` holds the tokens produced for each scheduled request with
    `sample=True`: one token normally, several when speculative decoding accepts drafts. A
    request absent from the dict gets no tokens (only legal for `sample=False`).
    `logprobs` is an optional, opaque per-request payload the scheduler does not read.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, object] | None = None
