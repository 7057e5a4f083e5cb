"""The engine's counters: requests, tokens, time, tail-only prefill's skipped rows, speculative
drafts (by draft position) and async scheduling's overlap."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TypeVar

from shoal.runner.step_io import RunnerOutput
from shoal.scheduler.step_plan import StepPlan

C = TypeVar("C")


def summed(counters: Sequence[C]) -> C:
    """Several engines' counters (dataclasses of numbers and per-position lists, as
    `EngineStats` and `PrefixCacheStats`) added field by field; lists by position."""
    total = counters[0]
    for other in counters[1:]:
        values = {}
        for f in fields(total):
            a, b = getattr(total, f.name), getattr(other, f.name)
            if isinstance(a, list):
                longest = max(len(a), len(b))
                a, b = a + [0] * (longest - len(a)), b + [0] * (longest - len(b))
                values[f.name] = [x + y for x, y in zip(a, b, strict=True)]
            else:
                values[f.name] = a + b
        total = replace(total, **values)
    return total


@dataclass
class EngineStats:
    num_requests: int = 0
    num_errors: int = 0
    preemptions: int = 0  # requests preempted, counted when it happens
    prompt_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0
    forward_time: float = 0.0
    prepare_time: float = 0.0
    device_time: float = 0.0
    decoder_rows_skipped: int = 0
    decoder_rows_total: int = 0
    drafts_proposed: int = 0  # speculative decoding: draft tokens verified
    drafts_accepted: int = 0
    drafts_skipped: int = 0  # drafted but not verified (the confidence rule)
    # per draft position (0 = the first draft after the anchor): verified / accepted
    drafts_proposed_at: list[int] = field(default_factory=list)
    drafts_accepted_at: list[int] = field(default_factory=list)
    verify_rows: int = 0  # rows that verified drafts (for the mean accepted length)

    # async scheduling: steps launched while the previous step's results were still unread,
    # and steps finished before the next was scheduled (a request needed its token on the host)
    overlapped_steps: int = 0
    resolved_first: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying row: the anchor's sample plus the accepted drafts."""
        return 1.0 + self.drafts_accepted / self.verify_rows if self.verify_rows else 0.0

    def account(self, plan: StepPlan, result: RunnerOutput, decoder_layers: int) -> None:
        """One step's counts (a step that scheduled something)."""
        self.steps += 1
        self.forward_time += result.forward_time
        self.prepare_time += result.prepare_time
        self.device_time += result.device_time
        self.decoder_rows_skipped += result.decoder_rows_skipped
        self.decoder_rows_total += plan.num_scheduled_tokens * decoder_layers
        for item in plan.scheduled:
            tokens = result.sampled_token_ids.get(item.request_id)
            verified = result.verified.get(item.request_id, item.num_spec_tokens)
            if verified and tokens:
                self.drafts_proposed += verified
                self.drafts_accepted += len(tokens) - 1
                self.verify_rows += 1
                grow = verified - len(self.drafts_proposed_at)
                if grow > 0:
                    self.drafts_proposed_at.extend([0] * grow)
                    self.drafts_accepted_at.extend([0] * grow)
                for i in range(verified):
                    self.drafts_proposed_at[i] += 1
                    self.drafts_accepted_at[i] += i < len(tokens) - 1
        self.drafts_skipped += result.drafts_skipped
