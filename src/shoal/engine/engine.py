"""The engine: requests in, outputs out, one step at a time.

One step (`Engine.step`, synchronous form):
1. `Scheduler.schedule() -> StepPlan`: every request's num_computed_tokens catches up with its
   known tokens under a token budget (chunked prefill, continuous batching, preemption by
   recompute, block and slot allocation); requests new to the runner come with their
   sampling parameters (`plan.new_requests`).
2. `Executor.execute(plan, grammar_masks) -> RunnerOutput`: one ForwardBatch, the model
   through the op table, logits only for sampled rows (and prompt-logprob rows), sampling.
3. `Scheduler.update(plan, output) -> StepOutcome`: tokens appended, eos / stop ids /
   max_tokens checked, finished requests freed; one plain `RequestDelta` per request.
4. `Engine.report`: the deltas detokenised incrementally, stop strings and matchers checked,
   logprobs and finishes recorded.

Async scheduling (`RunnerConfig.async_scheduling`, default on): `engine/overlap.py`.

Invariant: a bad request never reaches the runner (it finishes with `error` set), every request
added ends with exactly one output, and only plain data crosses engine, scheduler and executor.
"""

from __future__ import annotations

import itertools
import logging
import numbers
from collections.abc import Callable, Sequence

import torch

from shoal.config import EngineConfig
from shoal.engine.outputs import Logprob, RequestOutput
from shoal.engine.overlap import OverlappedSteps
from shoal.engine.request import EngineRequest
from shoal.engine.stats import EngineStats
from shoal.runner.executor import Executor
from shoal.runner.step_io import RunnerOutput
from shoal.sampling import SamplingParams, StopStringMatcher, request_seed
from shoal.scheduler.request import Request
from shoal.scheduler.scheduler import Scheduler
from shoal.scheduler.step_plan import StepOutcome, StepPlan
from shoal.tokenizer.special import THINK_END, THINK_START
from shoal.tokenizer.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def token_id_list(value: object, name: str) -> list[int]:
    """`value` as a list of token ids; ValueError unless it is a sequence of integers (bools and
    floats are refused: 1.7 is not a token id)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name}: got {type(value).__name__}, expected a list of integer "
                         "token ids")
    for i, t in enumerate(value):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(f"{name}[{i}]: got {t!r} ({type(t).__name__}), expected an "
                             "integer token id")
    return [int(t) for t in value]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.executor = Executor(config, self.tokenizer)
        self.runner = self.executor.runner  # in-process introspection (bench, tests)
        self.scheduler = Scheduler(config.scheduler, self.executor.num_blocks,
                                   self.executor.num_slots, self.executor.block_size,
                                   self.executor.prefix_cache_spec())
        self.requests: dict[str, EngineRequest] = {}
        self.groups: dict[str, list[str]] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._structured = None
        # drafts each sampled request gets on the device (speculative decoding)
        self.draft_len = config.model_config.dspark_draft_len if self.executor.speculative \
            else 0
        # speculative steps overlap only with spec_overlap, and never with the prefix cache
        # (a step planned before its drafts are known would hash unknown tokens) or a
        # confidence rule (whose counts must be known to plan fewer verify rows)
        run = config.runner
        self.overlap = OverlappedSteps(self) if run.async_scheduling and not (
            self.draft_len and (not run.spec_overlap or config.cache.enable_prefix_caching
                                or run.spec_confidence > 0 or run.spec_verify_budget > 0)
        ) else None
        # expert parallelism: every rank steps while any has work (parallel/expert_parallel.py);
        # `cancel_asked` is the front end's stop, seen by every rank at the same step
        self.ep = self.runner.ep
        self.cancel_asked: Callable[[], bool] = lambda: False

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
                    error: str | None = None, request_index: int | None = None,
                    priority: int = 0) -> str:
        """Queue one user request (n sequences); returns its id. Invalid input does not raise:
        the request finishes at once with `error` set. `request_index` (default: the next of
        this engine's counter) names the request and, for requests without a seed, derives its
        sampling seed: a data-parallel front end passes its own, so that any number of
        engines samples what one would. `priority`: lower runs sooner under
        scheduling_policy='priority' (ignored otherwise)."""
        index = next(self._ids) if request_index is None else request_index
        group = str(index)
        if group in self.groups:
            raise ValueError(f"request index {index} is already in use")
        if params is not None and not isinstance(params, SamplingParams):
            error = error or (f"sampling_params: got {type(params).__name__}, expected "
                              "SamplingParams")
            params = None
        params = params or SamplingParams()
        if not isinstance(priority, int) or isinstance(priority, bool):
            error = error or f"priority: got {priority!r}, expected an integer"
            priority = 0
        self.stats.num_requests += 1
        ids: list[int] = []
        text = prompt if isinstance(prompt, str) else None
        matchers: list = []
        if error is None:
            try:
                ids, matcher_spec = self._validate(prompt, params, prompt_token_ids)
                params = self._with_bad_words(params)
                if matcher_spec is not None:  # (building one can fail where checking did not)
                    matchers = [self.structured_backend().matcher(matcher_spec)
                                for _ in range(params.n)]
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
            if matchers:
                req.matcher = matchers[i]
                if ids[-1] == self.tokenizer.token_to_id(THINK_START):  # reasoning first
                    req.grammar_after = self.tokenizer.token_to_id(THINK_END)
            self.scheduler.add_request(Request(
                rid, ids, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                eos_token_id=self.config.model_config.eos_token_id,
                ignore_eos=params.ignore_eos, stop_token_ids=tuple(params.stop_token_ids),
                sampling=params, seed=seed, priority=priority,
                # prompt logprobs need every prompt row's logits: no cached rows
                cache_prefix=params.prompt_logprobs is None))
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
            ids = token_id_list(prompt_token_ids, "prompt_token_ids")
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: a prompt needs at least one token")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, Sequence):
            ids = token_id_list(prompt, "prompt")
        else:
            raise ValueError(f"prompt: got {type(prompt).__name__}, expected a string or a "
                             "list of token ids")
        if not ids:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
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

    def _with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """`params` with its bad_words tokenized into bad_words_token_ids (each word as given
        and after a space, as it reads mid-text)."""
        if not params.bad_words:
            return params
        seqs = list(params.bad_words_token_ids)  # type: ignore[arg-type]
        for word in params.bad_words:
            for text in dict.fromkeys((word, word if word.startswith(" ") else " " + word)):
                seq = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if seq and seq not in seqs:
                    seqs.append(seq)
        return params.replace(bad_words_token_ids=seqs)

    def abort(self, group: str) -> None:
        for rid in self.groups.get(group, []):
            self.scheduler.abort_request(rid)

    def cancel(self, groups: Sequence[str]) -> None:
        """After an exception inside a step (an interrupt, say): abort `groups`, settle the
        steps scheduled or in flight without their results (every request in them is aborted:
        their tokens were not read), and release the groups, so the engine can go on."""
        for group in groups:
            self.abort(group)
        if self.overlap is not None:
            self.overlap.inflight = None
        self.executor.discard()
        self._apply(self.scheduler.settle(), RunnerOutput())
        for group in groups:
            self.release(group)

    # ---- the loop ---------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """True while a request waits, runs or is not yet reported, or a step is in flight."""
        return self.in_flight or self.scheduler.has_unfinished()

    @property
    def in_flight(self) -> bool:
        """A submitted step's results are not yet reported (async scheduling)."""
        return self.overlap is not None and self.overlap.inflight is not None

    def flush(self) -> list[str]:
        """Finish the step in flight, if any, without launching another; return the user
        requests it completed (`LLM` calls it once all of its requests are done, so no device
        work or unread result outlives a generate call)."""
        return self.overlap.flush() if self.overlap is not None else []

    def step(self) -> list[str]:
        """Run one step; return the ids of user requests that completed in it (async
        scheduling: `engine/overlap.py`). Under expert parallelism every rank joins first; a
        cancel asked on any rank raises KeyboardInterrupt on every busy rank at this step."""
        if self.ep is not None and self.ep.join(True, self.cancel_asked())[1]:
            raise KeyboardInterrupt("cancelled by the data-parallel front end")
        return self._step()

    def serve_until_idle(self) -> None:
        """Expert parallelism, once this rank's requests are done: keep stepping (nothing
        scheduled here: its experts serve the other ranks' tokens) until no rank has work."""
        while self.ep is not None:
            busy, cancel = self.ep.join(False)
            if not busy:
                return
            if not cancel:
                self._step()

    def step_or_serve(self, stop: bool = False) -> tuple[bool, bool]:
        """Expert parallelism, for a loop that never waits on its own (a server's): one join
        saying whether this rank has work and wants to stop, then a step when any rank has
        work (this one's experts serve the others). Returns (stepped, any rank stopping);
        nothing runs once a rank stops, so every rank leaves at the same step."""
        busy, stopping = self.ep.join(self.has_unfinished(), stop)
        if stopping or not busy:
            return False, stopping
        self._step()
        return True, False

    def _step(self) -> list[str]:
        if self.overlap is not None:
            return self.overlap.step()
        plan = self.scheduler.schedule()
        output = self.executor.execute(plan, self.grammar_masks(plan))
        outcome = self.scheduler.update(plan, output)
        return self.completed_groups(self.report(plan, output, outcome))

    def grammar_masks(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """[V] bool per sampled structured-output request: the tokens its matcher allows."""
        masks = {}
        for item in plan.scheduled:
            req = self.requests.get(item.request_id)
            if item.sample and req is not None and req.grammar_active:
                mask = torch.ones(self.config.model_config.vocab_size, dtype=torch.bool)
                req.matcher.fill_mask(mask)
                masks[item.request_id] = mask
        return masks

    def needs_tokens_on_host(self, plan: StepPlan) -> bool:
        """A live request sampled in `plan` reads its outputs' values when it is sampled next
        (penalties over the output ids; a matcher that must accept the token first), or, under
        speculative decoding, their number (min_tokens not yet met: the next plan would count
        the drafts in flight as accepted)."""
        for item in plan.scheduled:
            req = self.requests.get(item.request_id)
            if item.sample and req is not None and not req.finished and (
                    req.params.reads_outputs or req.matcher is not None or (
                        self.draft_len and req.params.min_tokens > len(req.output_token_ids) + 1)):
                return True
        return False

    def report(self, plan: StepPlan, output: RunnerOutput, outcome: StepOutcome) -> set[str]:
        """The engine's side of a step: statistics, prompt logprobs, then per request delta its
        tokens (logprobs, detokenising, stop strings, the matcher) and its finish. Returns the
        sequences that finished."""
        self.stats.preemptions += len(plan.preempted_ids)  # as they happen (live metrics)
        if plan.scheduled:
            cfg = self.config.model_config
            self.stats.account(plan, output, cfg.num_layers - cfg.decoder_start)
        for rid, entries in output.prompt_logprobs.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.prompt_logprobs is None:  # position 0 has none (nothing predicts it)
                req.prompt_logprobs = [None] * len(req.prompt_token_ids)
            for position, target, logprob, rank, top in entries:  # by position: a recompute
                req.prompt_logprobs[position] = self._logprobs(  # after preemption rewrites
                    target, logprob, rank, top)
        return self._apply(outcome, output)

    def _apply(self, outcome: StepOutcome, output: RunnerOutput) -> set[str]:
        """Per request delta: its tokens (logprobs, detokenising, stop strings, the matcher),
        then its finish. Returns the sequences that finished."""
        newly: set[str] = set()
        for delta in outcome.deltas:
            rid = delta.request_id
            req = self.requests.get(rid)
            if req is None or req.finished:  # released, or ended by a stop string / matcher
                continue
            for index, token in enumerate(delta.new_token_ids):
                self._record_logprobs(req, token, output, index)
                self.stats.output_tokens += 1
                if (reason := req.append_token(token)) is not None:
                    self.scheduler.finish_request(rid, reason)
                    req.finish(reason, req.failure)
                    newly.add(rid)
                    break
            if delta.finished and not req.finished:
                req.metrics.num_preemptions = delta.num_preemptions
                req.metrics.num_cached_tokens = delta.num_cached_tokens
                req.finish(delta.finish_reason or "stop", delta.error, delta.stop_token_id)
                newly.add(rid)
        return newly

    def completed_groups(self, newly: set[str]) -> list[str]:
        groups = {self.requests[r].group_id for r in newly if r in self.requests}
        return sorted(g for g in groups if all(self.requests[c].finished
                                                for c in self.groups[g]))

    def _record_logprobs(self, req: EngineRequest, token: int, result: RunnerOutput,
                         index: int) -> None:
        if req.logprobs is None or req.request_id not in result.logprobs:
            return
        logprob, rank, top = result.logprobs[req.request_id][index]
        req.logprobs.append(self._logprobs(token, logprob, rank, top))
        req.cumulative_logprob += logprob

    def _logprobs(self, token: int, logprob: float, rank: int, top) -> dict[int, Logprob]:
        """A position's logprobs: the top ones by rank, and the chosen token's."""
        text = self.tokenizer.token_text
        entry = {t: Logprob(v, i + 1, text(t)) for i, (t, v) in enumerate(top)}
        entry[token] = Logprob(logprob, rank, text(token))
        return entry

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
