"""What flows out of `ModelRunner` for one step: `RunnerOutput` (plain data: the scheduler's
`StepResult` plus logprobs and timings; it pickles) and `LaunchedStep` (the runner's handle on a
step whose device work is queued, between `launch` and `finish`; it never leaves the runner
process)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shoal.model.batch import ForwardBatch
from shoal.runner.inflight import HostReadback
from shoal.scheduler.step_plan import StepPlan, StepResult

if TYPE_CHECKING:
    from shoal.runner.sampling_step import Draw
    from shoal.runner.speculative import Proposal, VerifyLayout


@dataclass
class RunnerOutput(StepResult):
    """sampled_token_ids: request -> tokens to append (one, or the accepted drafts + one
    more); invalid_ids: NaN logits / no allowed token; spec_token_ids: drafts for the next
    step."""

    # request -> per appended token (chosen logprob, rank, top-N)
    logprobs: dict[str, list[tuple[float, int, list[tuple[int, float]]]]] = field(
        default_factory=dict)
    # request -> [(prompt position, target id, logprob, rank, top-N)]
    prompt_logprobs: dict[str, list[tuple[int, int, float, int, list[tuple[int, float]]]]] = (
        field(default_factory=dict))
    forward_time: float = 0.0
    prepare_time: float = 0.0
    # seconds from the step's first device work to the end of its sampling (CUDA events; 0 off
    # CUDA and in steps that sample nothing): the rest of a sampling step is host time during
    # which the device has nothing queued
    device_time: float = 0.0
    decoder_rows_skipped: int = 0  # row-layers the tail-only prefill did not run
    drafts_skipped: int = 0  # drafts the confidence rule did not send to verification
    # speculative decoding: drafts verified per request (a verify step planned before the
    # confidence rule's counts were known verifies fewer than its rows)
    verified: dict[str, int] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step whose device work is queued (`ModelRunner.launch`) and whose results the host
    has not read yet (`ModelRunner.finish`).

    draws: one per sampled logits row, in order. token_ids: [len(draws)] int64 on the device,
    the sampled tokens (None: nothing sampled); the next step's decode rows read their input id
    there (`TokenPatch`). draw_index: request -> its draw, in steps without drafts. readback:
    the host copies of the sampler's output (and of `spec_tensors`). batch: the step's batch on
    the device. Speculative decoding: layout (its sampling requests), proposal (the next
    drafts, on the device) and spec_tensors (accepted and verified drafts, next ids, keep
    counts: read back with the tokens).
    """

    plan: StepPlan
    out: RunnerOutput  # timings, prompt logprobs and skipped rows already filled in
    draws: list[Draw] = field(default_factory=list)
    span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    batch: ForwardBatch | None = None
    token_ids: torch.Tensor | None = None
    draw_index: dict[str, int] = field(default_factory=dict)
    readback: HostReadback | None = None
    layout: VerifyLayout | None = None
    proposal: Proposal | None = None
    spec_tensors: list[torch.Tensor] = field(default_factory=list)
