"""What `LLM.generate` / `LLM.chat` return: one `RequestOutput` per input, in input order.

A request that could not run (bad prompt, bad sampling values, a failing constraint) still has
its `RequestOutput`, with `error` set and no completions, so nothing is lost and nothing shifts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "error" | "abort" | "kv_capacity"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # chat: parsed from the text by the output parser
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_cut: bool = False  # the text ended inside the last tool call
    parse_warnings: list[str] = field(default_factory=list)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (not computed)

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache served (vLLM's name)."""
        return 0 if self.metrics is None else self.metrics.num_cached_tokens

    @property
    def ok(self) -> bool:
        return self.error is None
