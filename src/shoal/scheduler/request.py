"""The scheduler's view of one request: token ids, progress, status and the resources it holds.

Owns: `Request` (plain Python, picklable), `RequestStatus` and the finish-reason strings.
Invariant: `num_computed_tokens <= num_tokens`; while a request holds resources its `block_ids`
cover at least `num_computed_tokens` positions and `slot` is not None; a finished request holds
neither blocks nor a slot. Only the scheduler and its `KVCacheManager` mutate these fields.

With async scheduling, `output_token_ids` may end with one `UNRESOLVED` entry: the token of the
step in flight, counted in `num_tokens` (positions, lengths and limits are right) but not yet
known; nothing reads its value before `Scheduler.resolve` patches it.

Stop *strings* are not checked here (they need the detokenizer); the engine calls
`Scheduler.finish_request(request_id, FINISH_STOP)` when it sees one.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# UNRESOLVED: the plan contract's sentinel, re-exported
from shoal.scheduler.step_plan import UNRESOLVED, RequestDelta  # noqa: F401

# Finish reasons (plain strings so that they travel in plans and outputs as-is).
FINISH_STOP = "stop"  # eos, a stop token id, or (via the engine) a stop string
FINISH_LENGTH = "length"  # max_tokens reached, or max_model_len reached
FINISH_ABORT = "abort"  # abort_request()
FINISH_ERROR = "error"  # rejected at add_request (invalid input); see Request.error
FINISH_KV_CAPACITY = "kv_capacity"  # needs more KV blocks than the whole pool holds

class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never admitted yet
    RUNNING = "running"  # holds a slot and blocks
    PREEMPTED = "preempted"  # back in the waiting queue; will recompute prompt + outputs
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # invalid input or kv_capacity

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


_STATUS_OF_REASON = {
    FINISH_STOP: RequestStatus.FINISHED_STOPPED,
    FINISH_LENGTH: RequestStatus.FINISHED_LENGTH,
    FINISH_ABORT: RequestStatus.FINISHED_ABORTED,
    FINISH_ERROR: RequestStatus.FINISHED_ERROR,
    FINISH_KV_CAPACITY: RequestStatus.FINISHED_ERROR,
}


def status_for_reason(reason: str) -> RequestStatus:
    """The finished status that goes with a finish reason (ValueError for an unknown reason)."""
    try:
        return _STATUS_OF_REASON[reason]
    except KeyError:
        raise ValueError(f"finish reason {reason!r} is unknown; expected one of "
                         f"{sorted(_STATUS_OF_REASON)}") from None


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it.

    The engine builds it from the user's prompt and SamplingParams: the fields that affect
    scheduling are spelled out; `sampling` (the SamplingParams) and `seed` only travel to the
    runner, once, in the first plan that schedules the request (`NewRequest`).

    `max_tokens=None` means "until eos/stop or max_model_len". `min_tokens` suppresses the eos and
    stop-id checks until that many tokens were generated (the sampler is expected to mask them too).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int | None = None
    min_tokens: int = 0
    eos_token_id: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    sampling: Any = None
    seed: int = 0
    priority: int = 0  # scheduling_policy='priority': lower is sooner

    # ---- progress (scheduler-owned) ---------------------------------------------------
    output_token_ids: list[int] = field(default_factory=list)
    # draft tokens proposed for the positions after the last output (speculative decoding);
    # set by Scheduler.set_drafts, consumed by the next schedule() of a decode step
    spec_token_ids: list[int] = field(default_factory=list)
    sent_to_runner: bool = False  # a plan has carried its NewRequest
    num_computed_tokens: int = 0  # positions whose KV has been written (== next position)
    status: RequestStatus = RequestStatus.WAITING
    arrival_index: int = -1  # order of add_request(), set by the scheduler
    admission_index: int = -1  # order of the latest admission into RUNNING
    finish_reason: str | None = None
    stop_token_id: int | None = None  # the eos / stop id that ended it, if any
    error: str | None = None  # human-readable reason for FINISHED_ERROR
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache spared at the first admission
    # Tokens known when the current (re)prefill started: the prompt on first admission,
    # prompt + outputs after a preemption (recompute). 0 before the first admission.
    prefill_len: int = 0
    needs_slot_reset: bool = False  # next scheduled chunk is the first one in a fresh slot
    # prefix caching: False opts out (prompt logprobs need every prompt row computed);
    # block_hashes: the chained hashes of the full blocks of the known tokens computed so far;
    # restore_snapshot: the ring snapshot the next chunk restores into the slot (-1: none)
    cache_prefix: bool = True
    block_hashes: list[bytes] = field(default_factory=list)
    restore_snapshot: int = -1
    replay: tuple[int, int] | None = None  # (first, boundary) of a bounded-replay resume

    # ---- resources (written only by KVCacheManager) -----------------------------------
    slot: int | None = None
    block_ids: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading block_ids registered in the prefix cache

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    # ---- derived ------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """All tokens known: prompt + generated (the last generated one is not yet computed)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def is_stop_token(self, token: int, num_outputs: int) -> bool:
        """eos (unless ignore_eos) or a stop id as output number `num_outputs`, once at least
        min_tokens outputs exist; these win over length when both hold."""
        if num_outputs < self.min_tokens:
            return False
        is_eos = (not self.ignore_eos and self.eos_token_id is not None
                  and token == self.eos_token_id)
        return is_eos or token in self.stop_token_ids

    def delta(self, tokens: Sequence[int], finished: bool) -> RequestDelta:
        """The plain record of an update: `tokens` appended and, if `finished`, how it ended."""
        if not finished:
            return RequestDelta(self.request_id, tuple(tokens))
        return RequestDelta(self.request_id, tuple(tokens), self.finish_reason,
                            self.stop_token_id, self.error, self.num_preemptions,
                            self.num_cached_tokens)

    def token_id(self, position: int) -> int:
        """The token at absolute position `position` (prompt first, then outputs)."""
        n_prompt = len(self.prompt_token_ids)
        if position < n_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - n_prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens at positions [start, stop) of prompt + outputs."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]
