"""ModelRunner: owns the device side (model, KV caches, decode graphs, sampler, the live
requests' sampling state) and executes one `StepPlan` in two halves: `launch` (inputs, the
model, logits where needed, sampling; the tokens stay on the device) and `finish` (read them
back into a `RunnerOutput`). Between the two the host may launch the next step (async
scheduling), whose decode rows then take their input ids from this step's tokens on the device.

The jobs live in their own modules: `loading` (device, weights, KV budget), `inputs` (plan ->
ForwardBatch), `sampling_step` (per-request state, draws, readback), `warmup` (prefill warm-up
and decode-graph capture), `speculative` (draft acceptance and proposal).

Pure-decode steps replay CUDA graphs captured at start-up; every other step runs eagerly. The
caches hold one slot and one block beyond the memory plan, which the scheduler never sees: the
padded rows of a graph step (and the warm-up) compute there.

Invariant: a request's sampling state arrives once (`plan.new_requests`) and is dropped when a
plan lists it in `finished_ids`; slots and blocks come with every plan.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from shoal.config import EngineConfig, ShoalError
from shoal.model.ring_snapshots import save as save_snapshots
from shoal.model.state import KVCaches
from shoal.parallel.expert_parallel import ExpertParallel
from shoal.runner.cache_memory import CacheLayout, MemoryPlan, plan_memory
from shoal.runner.draft_patch import DraftPatch
from shoal.runner.inflight import HostReadback, batch_to_device, upload
from shoal.runner.inputs import prepare_inputs
from shoal.runner.kv_offload import KVOffload, host_slots
from shoal.runner.loading import kv_budget_bytes, load_model, pick_device
from shoal.runner.sampling_step import (
    RequestState,
    prompt_logprobs,
    read_samples,
    record_outputs,
    sample,
)
from shoal.runner.speculative import (
    VerifyLayout,
    accept,
    accept_on_host,
    draft_checks,
    propose_drafts,
)
from shoal.runner.step_io import LaunchedStep, RunnerOutput
from shoal.runner.warmup import start_decode_graphs, start_draft_graphs
from shoal.sampling import Sampler
from shoal.sampling.params import GREEDY_TEMPERATURE
from shoal.scheduler.step_plan import StepPlan

logger = logging.getLogger(__name__)

NO_MASKS: Mapping[str, torch.Tensor] = MappingProxyType({})


class ModelRunner:
    def __init__(self, config: EngineConfig, tokenizer: Any | None) -> None:
        self.config = config
        cfg = config.model_config
        self.speculative = config.runner.speculative
        if self.speculative and not cfg.num_draft_layers:
            raise ShoalError(f"speculative=True needs DSpark draft layers; model {config.model!r} "
                             "has none")
        self.device = pick_device(config.runner.device)
        self.ep = ExpertParallel.from_process_group(
            self.device, config.runner.expert_placement, config.runner.collective_timeout_s) \
            if config.runner.expert_parallel else None
        self.layout = CacheLayout.from_model_config(cfg, block_size=config.cache.block_size)
        t0 = time.perf_counter()
        self.model = load_model(config, tokenizer, self.device, self.ep)
        self.load_seconds = time.perf_counter() - t0  # start-up phases, for benchmarks
        if config.runner.record_expert_loads:
            self.model.expert_loads = {}
        self.ops = self.model.ops
        self.memory = self._plan_memory()
        # one slot and one block beyond the plan (the scheduler never hands them out): the
        # padded rows of a CUDA-graph step compute there
        self.caches = KVCaches.from_layout(
            self.layout, num_blocks=self.memory.num_blocks + 1,
            num_slots=self.memory.num_slots + 1,
            max_tokens=config.scheduler.max_num_batched_tokens,
            num_snapshots=self.memory.num_snapshots, device=self.device)
        self.offload = self._offload()
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self._last: LaunchedStep | None = None  # the latest launched step (token patches)
        # prefill warm-up before graph capture (CUDA graphs only)
        self.graphs, self.warmup_seconds = start_decode_graphs(
            config, self.model, self.caches, self.memory, self.device)
        self.draft_graphs = start_draft_graphs(config, self.model, self.caches, self.memory,
                                               self.graphs)

    def _plan_memory(self) -> MemoryPlan:
        sched = self.config.scheduler
        try:
            cache = self.config.cache
            return plan_memory(self.layout, kv_budget_bytes(self.config, self.device),
                               sched.max_num_seqs, sched.max_model_len,
                               cache.device_snapshots,
                               prefix_caching=cache.enable_prefix_caching)
        except ValueError as exc:
            raise ShoalError(f"KV cache: {exc}") from None

    def _offload(self) -> KVOffload | None:
        """The prefix cache's host tier and store (None when it has neither)."""
        cache = self.config.cache
        if not cache.enable_prefix_caching or not (cache.kv_host_memory_gb
                                                   or cache.kv_store_path):
            return None
        blocks, snapshots = host_slots(self.layout, int(cache.kv_host_memory_gb * 1e9))
        if cache.kv_host_memory_gb and not blocks:
            raise ShoalError(f"kv_host_memory_gb={cache.kv_host_memory_gb} holds no KV block "
                             f"({self.layout.bytes_per_block} B each)")
        store = None
        if cache.kv_store_path:
            from shoal.kvstore import KVStore

            max_gb = cache.kv_store_max_gb
            store = KVStore(cache.kv_store_path, ttl_s=cache.kv_store_ttl_days * 86400,
                            max_bytes=None if max_gb is None else math.ceil(max_gb * 1e9))
        return KVOffload(self.layout, blocks, snapshots, self.device, store)

    # ---- one step ---------------------------------------------------------------------------
    def launch(self, plan: StepPlan,
               grammar_masks: Mapping[str, torch.Tensor] = NO_MASKS) -> LaunchedStep:
        """Queue the step's device work: inputs, forward, prompt logprobs, sampling; the sampled
        tokens stay on the device (copies to the host are queued, not waited for).

        `grammar_masks[request]`: [V] bool, the tokens its structured output allows next. A
        decode row whose input token is `UNRESOLVED` takes it from the previous launched
        step's tokens on the device, after the upload of the step's inputs and before its
        forward. Prompt-logprob chunks read their logprobs back here (a host sync).
        """
        for rid in plan.finished_ids:
            self.requests.pop(rid, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = RequestState.from_new(new)
        step = LaunchedStep(plan, RunnerOutput())
        if plan.transfers:  # the host tier's copies precede every read and write of the step
            assert self.offload is not None, "a plan with transfers but no host tier or store"
            self.offload.apply(self.caches, plan.transfers)
        if not plan.scheduled:
            if self.ep is not None:  # the other ranks' tokens still need this rank's experts
                rows = self.ep.agree(0) if self.graphs is not None else -1
                with torch.inference_mode(), self.ep.fixed_exchange(rows) if rows > 0 else \
                        contextlib.nullcontext():
                    self.model.serve_experts()
                if self.speculative:  # and their drafts
                    with torch.inference_mode():
                        self.model.serve_experts(draft=True)
            return step
        t0 = time.perf_counter()
        inputs = prepare_inputs(self.config, plan, self.requests, self._last,
                                device=self.device, graphs=self.graphs,
                                speculative=self.speculative)
        agreed = 0
        if self.ep is not None and self.graphs is not None:  # graphs on every rank, or none
            agreed = self.ep.agree(inputs.graph_size if inputs.graphed else -1)
            if agreed < 0 and inputs.graphed:
                inputs.graphed = False
                inputs.batch = batch_to_device(inputs.batch, self.device)
        batch, patch = inputs.batch, inputs.patch
        step.out.decoder_rows_skipped = inputs.decoder_rows_skipped
        t1 = time.perf_counter()
        if self.device.type == "cuda":
            step.span = (torch.cuda.Event(enable_timing=True),
                         torch.cuda.Event(enable_timing=True))
            step.span[0].record()
        with torch.inference_mode():
            if inputs.graphed:  # decode or verify: static inputs, graph replay
                assert self.graphs is not None
                result = self.graphs.forward(batch, patch, min_size=max(agreed, 0))
                if self.speculative:  # verification and drafts read the batch on the device
                    batch = batch_to_device(batch, self.device)
                    if patch is not None:
                        patch.apply(batch)
                # a decode row's boundary is its chunk's end: its window is in the rings now
                save_snapshots(self.caches, batch.snapshot_saves, committed=True)
            else:
                if patch is not None:
                    patch.apply(batch)
                result = self.model.forward(batch, self.caches, capture=self.speculative)
        logits = result.logits
        step.out.forward_time = time.perf_counter() - t1
        step.out.prepare_time = t1 - t0
        step.batch, step.draws = batch, inputs.draws
        for index in inputs.prompt_chunks:
            item = plan.scheduled[index]
            at = inputs.offsets[index]
            prompt_logprobs(item, self.requests[item.request_id],
                            logits[at: at + item.num_new_tokens], step.out)
        layout = inputs.layout
        checks = shift = limits = None
        if layout is not None and layout.ids:
            limits = patch.limits(layout, self.device) if isinstance(patch, DraftPatch) else \
                upload([layout.num_drafts], self.device)[0]
            checks = draft_checks(batch.input_ids, layout, limits)
            if isinstance(patch, DraftPatch):
                shift = patch.draw_shift(layout, self.device)
        readback: list[torch.Tensor] = []
        if step.draws:
            rows = inputs.sample_rows
            every = rows == list(range(logits.shape[0]))  # (decode): no index upload
            readback = sample(
                self.sampler, logits if every else logits[upload([rows], logits.device)[0]],
                step, vocab_size=self.config.model_config.vocab_size,
                eos_token_id=self.config.model_config.eos_token_id,
                grammar_masks=grammar_masks, checks=checks, shift=shift)
        if layout is not None:
            with torch.inference_mode():
                self._draft(step, layout, result.captures, checks, limits)
        if step.span is not None and step.draws:  # the step's device work ends here
            step.span[1].record()
        if readback:
            step.readback = HostReadback(readback + step.spec_tensors)
        self._last = step
        return step

    def _draft(self, step: LaunchedStep, layout: VerifyLayout, captures: torch.Tensor | None,
               checks: torch.Tensor | None, limits: torch.Tensor | None) -> None:
        """Speculative decoding after sampling: accept drafts, write the draft context, draft
        the next blocks (`runner/speculative.py`); their results join the step's readback."""
        run = self.config.runner
        rejection = run.spec_verify == "rejection"
        if layout.ids:
            assert step.token_ids is not None and checks is not None and limits is not None
            accepted, last = accept(step.token_ids, checks, layout)
        else:
            accepted = last = torch.zeros(0, dtype=torch.int64, device=self.device)
        assert step.batch is not None
        proposal = propose_drafts(self.model, self.caches, step.batch, captures, layout,
                                  accepted, last, self.requests, run.spec_confidence,
                                  rejection=rejection, drafter=self.draft_graphs,
                                  verify_budget=run.spec_verify_budget)
        if proposal is None:
            if self.ep is not None:  # the other ranks' drafts still need this rank's experts
                self.model.serve_experts(draft=True)
        else:
            for rid, b in proposal.index.items():
                state = self.requests[rid]
                state.draft_probs = None if proposal.draft_probs is None or \
                    state.params.temperature < GREEDY_TEMPERATURE else proposal.draft_probs[b]
        step.layout, step.proposal = layout, proposal
        if layout.ids:  # (the limits are the drafts each request verified)
            step.spec_tensors = [accepted, limits] + (
                [] if proposal is None else [proposal.next_ids, proposal.keep])

    def forget_last(self) -> None:
        """No later plan takes input ids from the latest launched step (it was discarded)."""
        self._last = None

    def finish(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for the step's sampled tokens (only for them: work queued after the step keeps
        running) and turn them into the RunnerOutput: under speculative decoding, each
        request's accepted tokens and its next drafts."""
        out = step.out
        if step.readback is not None:
            read_samples(step)
            if step.span is not None:  # both events are complete once the readback is
                out.device_time = step.span[0].elapsed_time(step.span[1]) * 1e-3
        if step.spec_tensors:
            assert step.layout is not None and step.readback is not None
            spec = [t.tolist() for t in step.readback.host[-len(step.spec_tensors):]]
            accept_on_host(step.layout, step.proposal, spec, out,
                           self.config.model_config.dspark_draft_len)
        record_outputs(out, self.requests)
        return out
