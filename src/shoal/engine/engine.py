"""The engine step loop.

One step:
1. `Scheduler.schedule() -> StepPlan`: every request's num_computed_tokens catches up with its
   known tokens under a token budget (chunked prefill, continuous batching, preemption by
   recompute, block and slot allocation).
2. `ModelRunner.launch(plan, rows)`: one ForwardBatch, the model through the op table, logits
   only for sampled rows (and prompt-logprob rows), sampling; the tokens stay on the device.
   `ModelRunner.finish(launched) -> RunnerOutput` reads them back.
3. `Scheduler.update(plan, result)` (= `advance` + `resolve`): append tokens, eos / stop ids /
   max_tokens, free finished requests. The engine then detokenises incrementally and checks
   stop strings.

Async scheduling (`RunnerConfig.async_scheduling`, default on) keeps one step in flight: a call
of `step()` schedules and launches step n+1, then finishes step n (waiting only for n's
tokens while the device runs n+1) and processes its outputs, then advances n+1:
`schedule(n+1) -> launch(n+1) -> finish(n), resolve(n), outputs of n -> advance(n+1)`. Step n+1
was planned from `advance(n)`'s counts, with step n's tokens as placeholders; its decode rows
read their input ids from step n's sampled tensor on the device. Results of step n+1 for a
request that step n finished are dropped. Before scheduling, the step in flight is finished
first when a request sampled in it needs that token's value on the host to be sampled again
(penalties read the output ids, a structured-output matcher must accept the token first);
speculative decoding never overlaps. Outputs (tokens, text, finish reasons, logprobs) equal
the synchronous loop's: samples depend on (seed, position) and the forward is batch-invariant,
so the plans may differ (a request stopping at step n still occupies step n+1's batch and
blocks) without changing any output; only metrics such as preemption counts can differ.

Invariant: a bad request never reaches the runner (it finishes with `error` set), and every
request added ends with exactly one output.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.config import EngineConfig, ShoalError
from shoal.engine.outputs import Logprob, RequestOutput
from shoal.engine.request import EngineRequest
from shoal.runner.model_runner import ModelRunner
from shoal.runner.step_io import LaunchedStep, RunnerOutput, SampleRow
from shoal.sampling import SamplingParams, StopStringMatcher, request_seed
from shoal.scheduler.request import Request
from shoal.scheduler.scheduler import Scheduler
from shoal.scheduler.step_plan import StepResult
from shoal.tokenizer.synthetic import build_synthetic_tokenizer
from shoal.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_requests: int = 0
    num_errors: int = 0
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
    # async scheduling: steps launched while the previous step's results were still unread,
    # and steps finished before the next was scheduled (a request needed its token on the host)
    overlapped_steps: int = 0
    resolved_first: int = 0


def load_tokenizer(config: EngineConfig) -> Tokenizer:
    vocab = config.model_config.vocab_size
    if config.is_preset:
        return Tokenizer(build_synthetic_tokenizer(config.model_config), vocab)
    path = Path(config.model) / "tokenizer.json"
    if not path.exists():
        raise ShoalError(f"model {config.model!r}: no tokenizer.json in the checkpoint directory")
    return Tokenizer.from_file(path, vocab)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.runner = ModelRunner(config, self.tokenizer)
        self.scheduler = Scheduler(config.scheduler, self.runner.memory.num_blocks,
                                   self.runner.memory.num_slots)
        self.requests: dict[str, EngineRequest] = {}
        self.groups: dict[str, list[str]] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._structured = None
        self.overlap = config.runner.async_scheduling and not self.runner.speculative
        self._inflight: LaunchedStep | None = None  # launched and advanced, not yet finished

    # ---- requests ---------------------------------------------------------------------------
    def structured_backend(self):
        if self._structured is None:
            from shoal.sampling.structured import StructuredOutputBackend

            self._structured = StructuredOutputBackend(
                self.tokenizer.backend, eos_token_id=self.config.model_config.eos_token_id,
                vocab_size=self.config.model_config.vocab_size)
        return self._structured

    def add_request(self, prompt: str | Sequence[int] | None, params: SamplingParams | None,
                    *, prompt_token_ids: Sequence[int] | None = None,
                    error: str | None = None) -> str:
        """Queue one user request (n sequences); returns its id. Invalid input does not raise:
        the request finishes at once with `error` set."""
        index = next(self._ids)
        group = str(index)
        params = params or SamplingParams()
        self.stats.num_requests += 1
        ids: list[int] = []
        text = prompt if isinstance(prompt, str) else None
        if error is None:
            try:
                ids, matcher_spec = self._validate(prompt, params, prompt_token_ids)
            except ValueError as exc:
                error = str(exc)
        children = []
        for i in range(params.n if error is None else 1):
            rid = group if params.n == 1 else f"{group}-{i}"
            seed = request_seed(params.seed, engine_seed=self.config.runner.seed,
                                request_index=index, sample_index=i)
            detok = self.tokenizer.incremental(ids, params.skip_special_tokens) \
                if params.detokenize else None
            req = EngineRequest(rid, group, i, text, ids, params, seed, detok,
                                stop=StopStringMatcher(params.stop,
                                                       params.include_stop_str_in_output)
                                if params.stop else None,
                                logprobs=[] if params.logprobs is not None else None)
            children.append(rid)
            self.requests[rid] = req
            if error is not None:
                req.finish("error", error)
                continue
            if matcher_spec is not None:
                req.matcher = self.structured_backend().matcher(matcher_spec)
            self.scheduler.add_request(Request(
                rid, ids, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                eos_token_id=self.config.model_config.eos_token_id,
                ignore_eos=params.ignore_eos, stop_token_ids=tuple(params.stop_token_ids)))
        if error is not None:
            self.stats.num_errors += 1
        else:
            self.stats.prompt_tokens += len(ids)
        self.groups[group] = children
        return group

    def _validate(self, prompt, params: SamplingParams, prompt_token_ids):
        cfg = self.config.model_config
        params.validate(cfg.vocab_size)
        if prompt_token_ids is not None:
            ids = [int(t) for t in prompt_token_ids]
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: a prompt needs at least one token")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt: got {type(prompt).__name__}, expected a string or a "
                             "list of token ids")
        if not ids:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {len(bad)} id(s) outside the vocabulary "
                             f"[0, {cfg.vocab_size}), e.g. {bad[0]}")
        if cfg.image_token_id is not None and cfg.image_token_id in ids:
            raise ValueError("prompt contains the image token; this text engine does not take "
                             "images")
        limit = self.config.scheduler.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {limit}, which "
                             "leaves no room for an output token")
        spec = params.structured
        if spec is not None:
            self.structured_backend().compile(spec)  # raises ValueError on a bad schema
        return ids, spec

    def abort(self, group: str) -> None:
        for rid in self.groups.get(group, []):
            self.scheduler.abort_request(rid)

    # ---- the loop ---------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """True while a request waits, runs or is not yet reported, or a step is in flight."""
        return self._inflight is not None or self.scheduler.has_unfinished()

    @property
    def in_flight(self) -> bool:
        """A launched step's results are not yet processed (async scheduling)."""
        return self._inflight is not None

    def flush(self) -> list[str]:
        """Finish the step in flight, if any, without launching another; return the user
        requests it completed (`LLM` calls it once all of its requests are done, so no device
        work or unread result outlives a generate call)."""
        newly: set[str] = set()
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._complete(step, newly)
        return self._completed_groups(newly)

    def step(self) -> list[str]:
        """Run one step; return the ids of user requests that completed in it (with async
        scheduling: in the step finished here, normally the one launched by the previous call;
        when a request in that step needs its token on the host, it is finished before this
        call schedules, and the step launched here stays in flight)."""
        newly: set[str] = set()
        previous, self._inflight = self._inflight, None
        if previous is not None and self._needs_tokens_on_host(previous.plan):
            self.stats.resolved_first += 1
            self._complete(previous, newly)
            previous = None
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            if previous is not None:
                self._complete(previous, newly)
            self._report(self.scheduler.update(plan, StepResult()), newly)
            return self._completed_groups(newly)
        launched = self.runner.launch(plan, self._sample_rows(plan), previous)
        if previous is not None:
            self.stats.overlapped_steps += 1
            self._complete(previous, newly)
        if self.overlap:
            self.scheduler.advance(plan)
            self._inflight = launched
        else:
            self._complete(launched, newly, advanced=False)
        return self._completed_groups(newly)

    def _sample_rows(self, plan) -> dict[str, SampleRow]:
        rows = {}
        for item in plan.scheduled:
            req = self.requests[item.request_id]
            if item.sample or req.params.prompt_logprobs is not None:
                sreq = self.scheduler.get_request(item.request_id)
                assert sreq is not None, item.request_id
                # the scheduler's outputs: they count the token in flight (positions, min_tokens)
                rows[item.request_id] = SampleRow(req.params, req.seed, req.prompt_token_ids,
                                                  sreq.output_token_ids, req.matcher)
        return rows

    def _needs_tokens_on_host(self, plan) -> bool:
        """A live request sampled in `plan` reads its outputs' values when it is sampled next
        (penalties over the output ids; a matcher that must accept the token first)."""
        for item in plan.scheduled:
            req = self.requests.get(item.request_id)
            if item.sample and req is not None and not req.finished and (
                    req.params.has_penalties or req.matcher is not None):
                return True
        return False

    def _complete(self, step: LaunchedStep, newly: set[str], advanced: bool = True) -> None:
        """Read a launched step's results and process them: `resolve` them when the plan was
        advanced at launch (async), `update` otherwise. Rows of requests that finished while
        the step ran (they were scheduled before it was known) are dropped."""
        plan = step.plan
        result = self.runner.finish(step)
        self._account(plan, result)
        for rid in result.invalid:
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            self.scheduler.finish_request(rid, "error")
            req.finish("error", "the model produced no valid token (NaN logits or every "
                       "token masked)")
            newly.add(rid)
        if advanced:
            finished = self.scheduler.resolve(plan, result.sampled)
        else:
            finished = self.scheduler.update(plan, StepResult(sampled_token_ids=result.sampled))
        kept = {r.request_id: r for r in finished}
        for rid, tokens in result.sampled.items():
            req = self.requests.get(rid)
            if req is None:  # finished and released while the step ran
                continue
            sreq = kept.get(rid) or self.scheduler.get_request(rid)
            if len(tokens) > 1 and sreq is not None:
                # verified drafts: the scheduler keeps them up to a stop token id or the
                # length limit; what it dropped is past the request's end
                tokens = tokens[:max(0, len(sreq.output_token_ids)
                                     - len(req.output_token_ids))]
            for index, token in enumerate(tokens):
                if req.finished:
                    break
                self._record_logprobs(req, token, result, index)
                self.stats.output_tokens += 1
                if req.append_token(token) or (req.matcher is not None and
                                               req.matcher.is_finished()):
                    self.scheduler.finish_request(rid, "stop")
                    req.finish("stop")
                    newly.add(rid)
        for rid, drafts in result.spec_tokens.items():
            sreq = self.scheduler.get_request(rid)
            if sreq is not None and not sreq.is_finished and not self.requests[rid].finished:
                sreq.spec_token_ids = list(drafts)
        for rid, entries in result.prompt_logprobs.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.prompt_logprobs is None:  # position 0 has none (nothing predicts it)
                req.prompt_logprobs = [None] * len(req.prompt_token_ids)
            for position, target, logprob, rank, top in entries:  # by position: a recompute
                d = {t: Logprob(v, i + 1) for i, (t, v) in enumerate(top)}  # after preemption
                d[target] = Logprob(logprob, rank)  # rewrites, never duplicates
                req.prompt_logprobs[position] = d
        self._report(finished, newly)

    def _report(self, finished, newly: set[str]) -> None:
        """Finish the engine side of requests the scheduler returned as finished."""
        for sreq in finished:
            req = self.requests.get(sreq.request_id)
            if req is None or req.finished:  # already reported (stop string, invalid row)
                continue
            req.metrics.num_preemptions = sreq.num_preemptions
            req.finish(sreq.finish_reason or "stop", sreq.error, sreq.stop_token_id)
            newly.add(sreq.request_id)

    def _completed_groups(self, newly: set[str]) -> list[str]:
        groups = {self.requests[r].group_id for r in newly if r in self.requests}
        return sorted(g for g in groups if all(self.requests[c].finished
                                                for c in self.groups[g]))

    def _record_logprobs(self, req: EngineRequest, token: int, result: RunnerOutput,
                         index: int) -> None:
        if req.logprobs is None or req.request_id not in result.logprobs:
            return
        logprob, rank, top = result.logprobs[req.request_id][index]
        entry = {t: Logprob(v, i + 1) for i, (t, v) in enumerate(top)}
        entry[token] = Logprob(logprob, rank)
        req.logprobs.append(entry)
        req.cumulative_logprob += logprob

    def _account(self, plan, result: RunnerOutput) -> None:
        s = self.stats
        s.steps += 1
        s.forward_time += result.forward_time
        s.prepare_time += result.prepare_time
        s.device_time += result.device_time
        s.decoder_rows_skipped += result.decoder_rows_skipped
        cfg = self.config.model_config
        s.decoder_rows_total += plan.num_scheduled_tokens * (cfg.num_layers - cfg.decoder_start)
        for item in plan.scheduled:
            tokens = result.sampled.get(item.request_id)
            if item.num_spec_tokens and tokens:
                s.drafts_proposed += item.num_spec_tokens
                s.drafts_accepted += len(tokens) - 1

    # ---- outputs ----------------------------------------------------------------------------
    def output(self, group: str) -> RequestOutput:
        children = [self.requests[r] for r in self.groups[group]]
        first = children[0]
        errors = [c.error for c in children if c.error]
        return RequestOutput(
            request_id=group, prompt=first.prompt, prompt_token_ids=list(first.prompt_token_ids),
            outputs=[] if first.finish_reason == "error" and len(children) == 1 and
            not first.output_token_ids else [c.completion() for c in children],
            finished=all(c.finished for c in children), error=errors[0] if errors else None,
            prompt_logprobs=first.prompt_logprobs, metrics=first.metrics)

    def release(self, group: str) -> None:
        for rid in self.groups.pop(group, []):
            self.requests.pop(rid, None)
