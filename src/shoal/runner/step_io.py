"""What flows in and out of `ModelRunner` for one step: `SampleRow` (a request's sampling inputs,
from the engine), `LaunchedStep` (a step whose device work is queued, between `launch` and
`finish`) and `RunnerOutput` (what the host reads back)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.model.batch import ForwardBatch
from shoal.runner.inflight import HostReadback
from shoal.sampling import SamplingParams
from shoal.scheduler.step_plan import StepPlan


@dataclass(frozen=True)
class SampleRow:
    """Per-request sampling inputs for a step (built by the engine for requests with
    sample=True, and for requests asking for prompt logprobs).

    output_token_ids: the scheduler's outputs so far; with async scheduling the last may be
    `UNRESOLVED` (in flight). Its length gives the sampled position and the min_tokens count;
    only rows with penalties read the values, and those are never launched unresolved."""

    params: SamplingParams
    seed: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    matcher: Any = None  # a structured-output matcher (fill_mask / accept), or None


@dataclass
class RunnerOutput:
    # request -> tokens to append: one, or (verifying drafts) the accepted drafts + one more
    sampled: dict[str, list[int]] = field(default_factory=dict)
    invalid: list[str] = field(default_factory=list)  # NaN logits / no allowed token
    # request -> per appended token (chosen logprob, rank, top-N)
    logprobs: dict[str, list[tuple[float, int, list[tuple[int, float]]]]] = field(
        default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts for the next step
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


@dataclass
class LaunchedStep:
    """A step whose device work is queued (`ModelRunner.launch`) and whose results the host
    has not read yet (`ModelRunner.finish`).

    draws: (request, sampling row, drafts before it) per sampled logits row, in order.
    token_ids: [len(draws)] int64 on the device, the sampled tokens (None: nothing sampled);
    the next step's decode rows read their input id there (`TokenPatch`). draw_index: request
    -> its draw, in steps without drafts. readback: the host copies of the sampler's output.
    batch / captures: what `propose_drafts` needs (speculative decoding).
    """

    plan: StepPlan
    rows: Mapping[str, SampleRow]
    out: RunnerOutput  # timings, prompt logprobs and skipped rows already filled in
    draws: list[tuple[str, SampleRow, list[int]]]
    span: tuple[torch.cuda.Event, torch.cuda.Event] | None
    batch: ForwardBatch
    captures: torch.Tensor | None
    token_ids: torch.Tensor | None = None
    draw_index: dict[str, int] = field(default_factory=dict)
    readback: HostReadback | None = None
