"""What one engine step computes (`StepPlan`) and what the runner hands back (`StepResult`).

Owns: the plain-data contract between `Scheduler` and `ModelRunner`. Everything here is a
dataclass of ints, strings, tuples, lists and dicts, so a plan can be pickled and broadcast to
other ranks.

Invariant (per scheduled request r): `r.token_ids` are the tokens at positions
`[r.start_position, r.start_position + r.num_new_tokens)`; `r.block_ids` cover at least
`r.start_position + r.num_new_tokens` positions; `r.sample` is True iff that end equals the
number of tokens known for the request, i.e. this chunk produces the next token. With async
scheduling a token may be known by position only (`UNRESOLVED`, sampled by the step still in
flight): it is then the single token of a decode chunk, never a history id.

A request reaches the runner once, as a `NewRequest` in the first plan that schedules it (its
prompt, sampling parameters and seed); later plans name it by id, and `finished_ids` tell the
runner when to forget it. `Scheduler.update` answers a `StepResult` with one `RequestDelta` per
request that gained tokens or finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

# An output token that a step sampled on the device and the host has not read yet (async
# scheduling): `Scheduler.advance` appends it, `Scheduler.resolve` replaces it by the real id.
UNRESOLVED = -1


@dataclass(frozen=True)
class NewRequest:
    """What the runner keeps about a request for as long as it lives: sent once, in the first
    plan that schedules it. `sampling` is the request's `SamplingParams` (plain data; the
    scheduler does not read it) and `seed` its resolved sampling seed."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Any
    seed: int


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
    - `restore_snapshot`: a prefix-cache hit resumes here: before the forward, copy ring
      snapshot `restore_snapshot` into the slot's rings (the window below `start_position`).
    - `save_snapshots`: (boundary, snapshot id) pairs: after computing the chunk, save the slot's
      rings over the window below each block boundary into that snapshot.
    - `replay`: (first, boundary) while a prefix-cache hit is resumed by a bounded replay:
      positions below `boundary` rebuild the SWA rings only (their paged KV is the cache's), and
      SWA reads are floored at `first`.
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
    restore_snapshot: int = -1
    save_snapshots: tuple[tuple[int, int], ...] = ()
    replay: tuple[int, int] | None = None

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
    - `new_requests`: the scheduled requests that no earlier plan scheduled.
    - `transfers`: prefix caching's host tier: copies between device blocks / snapshots and
      host slots, applied in order before the step's forward (`scheduler/host_tier.py`).
    """

    step_id: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...] = ()
    finished_ids: tuple[str, ...] = ()
    num_scheduled_tokens: int = 0
    new_requests: tuple[NewRequest, ...] = ()
    transfers: tuple[Any, ...] = ()

    @property
    def is_empty(self) -> bool:
        """Nothing to run (the engine can skip the runner, but must still call `update`)."""
        return not self.scheduled

    @property
    def num_sampled_requests(self) -> int:
        return sum(1 for r in self.scheduled if r.sample)


@dataclass
class StepResult:
    """The runner's answer for one plan, as the scheduler reads it.

    - `sampled_token_ids[request_id]`: the tokens produced for each scheduled request with
      `sample=True`: one normally, several when speculative decoding accepts drafts. A request
      absent from the dict gets no tokens (legal only for `sample=False` or an invalid row).
    - `invalid_ids`: sampled rows without a valid token (NaN logits, every token masked); the
      scheduler finishes them with `error`.
    - `spec_token_ids[request_id]`: drafts proposed for the positions after the new tokens.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    invalid_ids: list[str] = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


class RequestDelta(NamedTuple):
    """What one update changed about a request: the output tokens it appended (already cut at a
    stop token or the length limit) and, when it finished, why. (A NamedTuple: one per request
    per step, so it is built cheaply.)"""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    stop_token_id: int | None = None  # the eos / stop id that ended it
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens computed by an earlier request (prefix cache)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutcome:
    """`Scheduler.update` / `resolve`: the per-request deltas, and the scheduler's records of
    the requests finished since the previous update (in finishing order; it forgets them)."""

    deltas: list[RequestDelta] = field(default_factory=list)
    finished: list[Any] = field(default_factory=list)
