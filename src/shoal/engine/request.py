"""EngineRequest: what the engine keeps of one sequence: its output as the user sees it (text,
detokenizer, stop strings, logprobs, structured-output matcher, finish). The scheduler's
`Request` owns the request itself (tokens, progress, KV).

Invariant: `output_token_ids` are exactly the tokens of the scheduler's `RequestDelta`s, each
turned into text once (incremental detokenisation + stop strings), cut at a stop string.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from shoal.engine.outputs import CompletionOutput, Logprob, RequestMetrics
from shoal.sampling import SamplingParams, StopStringMatcher
from shoal.tokenizer.tokenizer import IncrementalDetokenizer


@dataclass
class EngineRequest:
    request_id: str
    group_id: str  # the user's request (n > 1 fans out into several sequences)
    index: int  # completion index inside the group
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer | None
    matcher: Any = None
    # the matcher applies after this token in the output (the end of the reasoning, when the
    # prompt opened it: the answer is constrained, not the thinking); None: from the start
    grammar_after: int | None = None
    stop: StopStringMatcher | None = None
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    failure: str | None = None  # why the constraint failed mid-sequence (append_token)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def grammar_active(self) -> bool:
        """Structured output constrains the next token."""
        return self.matcher is not None and self.grammar_after is None

    def append_token(self, token: int) -> str | None:
        """Record a sampled token; returns how it ends the sequence: "stop" (a stop string
        completed, or the constraint is complete), "error" (the constraint failed at this
        token: `failure` says why) or None."""
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.time()
        self.output_token_ids.append(token)
        if self.grammar_active:
            if not self.matcher.accept(token) or self.matcher.error:
                self.failure = self.matcher.error or \
                    f"structured output failed: token {token} is not allowed here"
                return "error"
        elif token == self.grammar_after:
            self.grammar_after = None
        done = "stop" if self.grammar_active and self.matcher.is_finished() else None
        if self.detokenizer is None:
            return done
        delta = self.detokenizer.step(token)
        if self.stop is None:
            self.text += delta
            return done
        check = self.stop.feed(delta)
        self.text += check.emit
        if check.stopped:
            self.stop_reason = check.stop_str
            return "stop"
        return done

    def finish(self, reason: str, error: str | None = None,
               stop_token: int | None = None) -> None:
        if self.finished:
            return
        self.finish_reason = reason
        self.error = error
        if stop_token in self.params.stop_token_ids and self.stop_reason is None:
            self.stop_reason = stop_token  # (EOS leaves it None, as vLLM)
        stopped_by_string = isinstance(self.stop_reason, str)
        if self.detokenizer is not None and reason != "error" and not stopped_by_string:
            tail = self.detokenizer.flush()
            if self.stop is None:
                self.text += tail
            else:  # release held-back text (or find a stop string completed by the tail)
                check = self.stop.feed(tail, final=True)
                self.text += check.emit
                if check.stopped:
                    self.stop_reason = check.stop_str
        self.metrics.finished_time = time.time()

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None)
