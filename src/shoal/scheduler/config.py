"""`SchedulerConfig`: the scheduler's limits (a frozen dataclass, validated on creation)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits.

    - `max_num_batched_tokens`: token budget per step (sum of new tokens over requests).
    - `max_num_seqs`: most requests running at once (also capped by the number of slots).
    - `max_model_len`: most tokens (prompt + output) per request.
    - `enable_chunked_prefill`: split prompts over steps; when False a prompt is admitted only
      whole, so `max_num_batched_tokens >= max_model_len` is required.
    - `long_prefill_token_threshold`: with chunked prefill, at most this many tokens per request
      per step (0 = no cap), so long prompts share steps with decodes.
    - `num_history_tokens`: tokens before each chunk passed along for Engram (max n-gram - 1).
    - `scheduling_policy`: 'fcfs' (arrival order) or 'priority' (vLLM's: waiting requests in
      (priority, arrival) order, lower values first; the running request preempted when
      blocks run out is the one with the largest (priority, arrival)).
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    max_model_len: int = 65536
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    num_history_tokens: int = 3
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name}={getattr(self, name)}: expected >= 1")
        for name in ("long_prefill_token_threshold", "num_history_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"SchedulerConfig.{name}={getattr(self, name)}: expected >= 0")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"SchedulerConfig.scheduling_policy={self.scheduling_policy!r}: "
                             "expected 'fcfs' or 'priority'")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"SchedulerConfig.max_num_batched_tokens={self.max_num_batched_tokens}"
                             f" must be >= max_num_seqs={self.max_num_seqs} so that every "
                             "running request can decode each step")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"SchedulerConfig.max_num_batched_tokens={self.max_num_batched_tokens}"
                             f" must be >= max_model_len={self.max_model_len} when "
                             "enable_chunked_prefill=False (a prompt is prefilled whole); "
                             "enable chunked prefill or raise the budget")
