"""ModelRunner: owns the device side (weights, op table, KV caches, sampler) and executes one
`StepPlan` in two halves: `launch` (build the ForwardBatch, run the model, gather logits where
needed, sample; the tokens stay on the device) and `finish` (read them back into a
`RunnerOutput`). Between the two the host may launch the next step (async scheduling), whose
decode rows then take their input ids from this step's tokens on the device.

Pure-decode steps replay CUDA graphs captured at start-up (`runner/cuda_graphs.py`, on CUDA
with `cuda_graphs=True`, the default); every other step runs eagerly. The caches hold one slot
and one block beyond the memory plan, which the scheduler never sees: the padded rows of a
graph step (and the warm-up) compute there.

Invariant: the runner keeps no per-request state beyond the caches (slots and blocks come from
the plan); what it needs about a request's sampling arrives with each step (`SampleRow`), and
what a launched step leaves for the host and for the next step is in its `LaunchedStep`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from shoal.checkpoint.reader import CheckpointReader
from shoal.checkpoint.writer import generate_weights
from shoal.config import EngineConfig, ShoalError
from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.deepseek_v41 import DeepseekV41, ForwardOutput
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams, WeightError
from shoal.model.state import KVCaches
from shoal.ops.registry import resolve_ops
from shoal.runner.cache_memory import CacheLayout, MemoryPlan, plan_memory
from shoal.runner.cuda_graphs import DecodeGraphs, prefill_warmup_chunks
from shoal.runner.inflight import HostReadback, TokenPatch, batch_to_device, to_device, upload
from shoal.runner.speculative import accept_drafts, propose_drafts
from shoal.runner.step_io import LaunchedStep, RunnerOutput, SampleRow
from shoal.sampling import Sampler, SamplingBatch, compute_prompt_logprobs
from shoal.scheduler.request import UNRESOLVED
from shoal.scheduler.step_plan import StepPlan

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_GB = 0.5
GPU_ACTIVATION_RESERVE_GB = 8.0


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ShoalError(f"device: {name!r} requested but CUDA is not available")
    return device


def iter_weights(config: EngineConfig, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    fmt = config.runner.load_format
    if fmt == "dummy" or (fmt == "auto" and config.is_preset):
        yield from generate_weights(config.model_config, seed=config.runner.seed, device=device)
        return
    if config.is_preset:
        raise ShoalError(f"load_format={fmt!r} needs a checkpoint directory, got the preset "
                         f"{config.model!r}")
    with CheckpointReader(config.model) as reader:
        reader.check(config.model_config)
        for name in reader.names():
            yield name, reader.get(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, tokenizer: Any | None) -> None:
        self.config = config
        cfg = config.model_config
        self.device = pick_device(config.runner.device)
        self.ops = resolve_ops(self.device, list(config.runner.backends)
                               if config.runner.backends else None)
        logger.info("op table:\n%s", self.ops.report())
        try:
            params = ModelParams.load(cfg, iter_weights(config, self.device), self.device)
        except WeightError as exc:
            raise ShoalError(f"model {config.model!r}: {exc}") from None
        backend = getattr(tokenizer, "backend", None)
        token_map = token_map_for(cfg, backend) if cfg.engram_layer_ids else None
        self.model = DeepseekV41(cfg, params, self.ops, token_map)
        self.layout = CacheLayout.from_model_config(cfg, block_size=config.cache.block_size)
        self.memory = self._plan_memory()
        # one slot and one block beyond the plan (the scheduler never hands them out): the
        # padded rows of a CUDA-graph step compute there
        self.caches = KVCaches.allocate(
            cfg, num_blocks=self.memory.num_blocks + 1, num_slots=self.memory.num_slots + 1,
            max_tokens=config.scheduler.max_num_batched_tokens,
            block_size=config.cache.block_size,
            ring_slack=self.layout.swa_ring_len - cfg.sliding_window, device=self.device)
        self.sampler = Sampler()
        self.speculative = config.runner.speculative
        if self.speculative and not cfg.num_draft_layers:
            raise ShoalError(f"speculative=True needs DSpark draft layers; model {config.model!r} "
                             "has none")
        self.warmup_seconds = 0.0  # prefill warm-up before graph capture (CUDA graphs only)
        self.graphs = self._decode_graphs()

    def decode_graphs(self, *, use_graphs: bool) -> DecodeGraphs:
        """Static padded decode path over this runner's model and caches (captured on CUDA
        when `use_graphs`; tests run it eagerly on the CPU)."""
        sched = self.config.scheduler
        max_batch = min(sched.max_num_seqs, self.memory.num_slots, sched.max_num_batched_tokens,
                        256)
        block = self.config.cache.block_size
        return DecodeGraphs(self.model, self.caches, max_batch=max_batch,
                            max_context=sched.max_model_len,
                            max_blocks=-(-sched.max_model_len // block),
                            pad_slot=self.memory.num_slots, pad_block=self.memory.num_blocks,
                            use_graphs=use_graphs,
                            sizes=self.config.runner.cuda_graph_batch_sizes)

    def _warm_up_prefill(self) -> None:
        """Run prefill-shaped steps on the pad slot / block so that their Triton kernels compile
        now rather than during a run (decode shapes compile in DecodeGraphs.capture)."""
        t0 = time.perf_counter()
        sched, cfg = self.config.scheduler, self.config.model_config
        chunks = prefill_warmup_chunks(
            cfg, max_tokens=sched.max_num_batched_tokens, max_context=sched.max_model_len,
            block_size=self.config.cache.block_size, pad_slot=self.memory.num_slots,
            pad_block=self.memory.num_blocks)
        with torch.inference_mode():
            for chunk in chunks:
                batch = build_forward_batch(cfg, [chunk], device=self.device,
                                            prefill_mode=self.config.runner.prefill_mode,
                                            replay_window=self.config.runner.replay_window)
                self.model.forward(batch, self.caches)
        torch.cuda.synchronize()
        self.warmup_seconds = time.perf_counter() - t0
        logger.info("warm-up: %d prefill shapes in %.1f s", len(chunks), self.warmup_seconds)

    def _decode_graphs(self) -> DecodeGraphs | None:
        if not self.config.runner.cuda_graphs:
            logger.info("CUDA graphs: off (cuda_graphs=False)")
            return None
        if self.device.type != "cuda":
            logger.info("CUDA graphs: off (device %s)", self.device)
            return None
        if self.speculative:
            logger.info("CUDA graphs: off (speculative decoding runs eagerly)")
            return None
        graphs = self.decode_graphs(use_graphs=True)
        self._warm_up_prefill()
        try:
            graphs.capture()
        except RuntimeError:  # e.g. an op syncing with the host: run eagerly, loudly
            logger.exception("CUDA graphs: capture failed, every step runs eagerly")
            torch.cuda.synchronize()
            return None
        return graphs

    def _plan_memory(self) -> MemoryPlan:
        cache, sched = self.config.cache, self.config.scheduler
        if cache.kv_cache_memory_gb is not None:
            budget = cache.kv_cache_memory_gb * 1e9
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * cache.gpu_memory_utilization - GPU_ACTIVATION_RESERVE_GB * 1e9
        else:
            budget = CPU_KV_BUDGET_GB * 1e9
        try:
            return plan_memory(self.layout, int(budget), sched.max_num_seqs, sched.max_model_len)
        except ValueError as exc:
            raise ShoalError(f"KV cache: {exc}") from None

    # ---- one step ---------------------------------------------------------------------------
    def execute(self, plan: StepPlan, rows: Mapping[str, SampleRow]) -> RunnerOutput:
        """Run one step to the end: `finish(launch(plan, rows))`."""
        return self.finish(self.launch(plan, rows))

    def launch(self, plan: StepPlan, rows: Mapping[str, SampleRow],
               previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's device work: inputs, forward, prompt logprobs, sampling; the sampled
        tokens stay on the device (copies to the host are queued, not waited for).

        A decode row whose input token is `UNRESOLVED` (sampled by `previous`, still in
        flight) takes it from `previous.token_ids` on the device, after the upload of the
        step's inputs and before its forward (into the graph's static ids when it replays).
        Nothing else of the plan depends on that token: its Engram history holds earlier,
        resolved ids. Prompt-logprob chunks still read their logprobs back here (a host sync).
        """
        t0 = time.perf_counter()
        out = RunnerOutput()
        chunks, prompt_lp, unresolved = [], [], []
        row = 0  # flat row of the next chunk's first token
        for item in plan.scheduled:
            sample_row = rows.get(item.request_id)
            want_prompt = (sample_row is not None
                           and sample_row.params.prompt_logprobs is not None
                           and item.start_position < item.num_prompt_tokens)
            # verifying drafts needs every row's logits; prompt logprobs too
            logits = ("all" if want_prompt or item.num_spec_tokens else
                      "last" if item.sample else "none")
            ids = item.token_ids
            if ids[0] == UNRESOLVED:  # (only ever a one-token decode chunk)
                unresolved.append((row, item.request_id))
                ids = (0,)  # a valid id until the patch overwrites it on the device
            chunks.append(RequestChunk(ids, item.start_position, item.slot,
                                       item.block_ids, item.prefill_len, logits,
                                       item.history_token_ids))
            row += item.num_new_tokens
            if want_prompt:
                prompt_lp.append((item, len(chunks) - 1))
        patch = self._token_patch(unresolved, previous)
        graphed = self.graphs is not None and self.graphs.fits(chunks)
        cuda = self.device.type == "cuda"
        batch = build_forward_batch(self.config.model_config, chunks,
                                    device="cpu" if graphed or cuda else self.device,
                                    prefill_mode=self.config.runner.prefill_mode,
                                    replay_window=self.config.runner.replay_window)
        out.decoder_rows_skipped = sum(
            batch.num_tokens - (r.full.numel() if r.full is not None else batch.num_tokens)
            for r in batch.layer_rows.values())
        if cuda and not graphed:  # built on the host: pinned, non-blocking uploads (no sync)
            batch = batch_to_device(batch, self.device)
        t1 = time.perf_counter()
        span = None
        if cuda:
            span = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            span[0].record()
        with torch.inference_mode():
            if graphed:  # pure decode: static inputs, graph replay (speculative is eager)
                assert self.graphs is not None
                result = ForwardOutput(self.graphs.forward(batch, patch))
            else:
                if patch is not None:
                    patch.apply(batch.input_ids)
                result = self.model.forward(batch, self.caches, capture=self.speculative)
        logits = result.logits
        out.forward_time = time.perf_counter() - t1
        out.prepare_time = t1 - t0
        # rows of `logits` follow the chunks: "all" chunks give every row, "last" one row
        offsets, at = [], 0
        for ch in chunks:
            offsets.append(at)
            at += ch.num_new if ch.logits == "all" else (1 if ch.logits == "last" else 0)
        for item, index in prompt_lp:
            self._prompt_logprobs(item, rows[item.request_id], chunks[index],
                                  logits[offsets[index]: offsets[index] + chunks[index].num_new],
                                  out)
        sample_rows, draws = [], []  # logits row -> (request, sampling row, draft index)
        for i, (ch, item) in enumerate(zip(chunks, plan.scheduled, strict=True)):
            if not item.sample:
                continue
            sample_row, k = rows[item.request_id], item.num_spec_tokens
            drafts = list(item.token_ids[len(item.token_ids) - k:]) if k else []
            first = offsets[i] + (ch.num_new - 1 - k if ch.logits == "all" else 0)
            for j in range(k + 1):  # row j samples the token after anchor + drafts[:j]
                sample_rows.append(first + j)
                draws.append((item.request_id, sample_row, drafts[:j]))
        step = LaunchedStep(plan=plan, rows=rows, out=out, draws=draws, span=span,
                            batch=batch, captures=result.captures)
        if draws:
            every = sample_rows == list(range(logits.shape[0]))  # (decode): no index upload
            self._sample(logits if every else logits[upload([sample_rows], logits.device)[0]],
                         step)
        return step

    def _token_patch(self, unresolved: list[tuple[int, str]],
                     previous: LaunchedStep | None) -> TokenPatch | None:
        """Rows whose input id is the previous step's sample, and where it is in its tokens."""
        if not unresolved:
            return None
        missing = [rid for _, rid in unresolved
                   if previous is None or rid not in previous.draw_index]
        if missing or previous is None or previous.token_ids is None:
            raise RuntimeError(f"requests {missing[:5]} have an unresolved input token that "
                               "the previous launched step did not sample")
        return TokenPatch(tuple(r for r, _ in unresolved),
                          tuple(previous.draw_index[rid] for _, rid in unresolved),
                          previous.token_ids)

    def finish(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for the step's sampled tokens (only for them: work queued after the step keeps
        running) and turn them into the RunnerOutput; then accept drafts and propose new ones
        (speculative decoding, which therefore never overlaps steps)."""
        out = step.out
        if step.readback is not None:
            self._read_samples(step)
            accept_drafts(step.plan, out)
            if step.span is not None:  # both events are complete once the readback is
                out.device_time = step.span[0].elapsed_time(step.span[1]) * 1e-3
        if self.speculative:
            with torch.inference_mode():
                propose_drafts(self.model, self.caches, step.batch, step.captures, step.plan,
                               step.rows, out)
        return out

    def _sample(self, logits: torch.Tensor, step: LaunchedStep) -> None:
        """Sample every draw; a row verifying drafts sees them as already generated (positions,
        penalties), so the target's sample there is exactly what plain decoding would draw."""
        vocab = self.config.model_config.vocab_size
        draws = step.draws
        rows = [r for _, r, _ in draws]
        mask = None
        if any(r.matcher is not None for r in rows):
            mask = torch.ones(len(rows), vocab, dtype=torch.bool)
            for i, r in enumerate(rows):
                if r.matcher is not None:
                    r.matcher.fill_mask(mask[i])
            mask = to_device(mask, logits.device)
        history = [list(r.output_token_ids) + d if d else r.output_token_ids
                   for _, r, d in draws]
        for r, h in zip(rows, history, strict=True):
            if r.params.has_penalties and UNRESOLVED in h[-1:]:
                raise RuntimeError("a row with penalties was launched before its previous "
                                   "token was resolved")
        batch = SamplingBatch.from_params(
            [r.params for r in rows], seeds=[r.seed for r in rows],
            positions=[len(r.prompt_token_ids) + len(h) for r, h in zip(rows, history,
                                                                         strict=True)],
            output_token_ids=history, prompt_token_ids=[r.prompt_token_ids for r in rows],
            vocab_size=vocab, eos_token_ids=(self.config.model_config.eos_token_id,),
            allowed_mask=mask, device=logits.device)
        result = self.sampler.sample(logits, batch)
        if step.span is not None:  # the step's device work ends here (before the host waits)
            step.span[1].record()
        step.token_ids = result.token_ids
        if not any(item.num_spec_tokens for item in step.plan.scheduled):  # one draw each
            step.draw_index = {rid: i for i, (rid, _, _) in enumerate(draws)}
        lp = result.logprobs
        step.readback = HostReadback([result.token_ids, result.valid] + (
            [lp.token_ids, lp.logprobs, lp.ranks] if lp is not None else []))

    def _read_samples(self, step: LaunchedStep) -> None:
        assert step.readback is not None
        host = step.readback.wait()
        tokens, valid = host[0].tolist(), host[1].tolist()
        lp_ids, lp_values, ranks = ([t.tolist() for t in host[2:]] if len(host) > 2
                                    else (None, None, None))
        out = step.out
        for i, (request_id, row, _) in enumerate(step.draws):
            if request_id in out.invalid:
                continue
            if not valid[i]:
                out.invalid.append(request_id)
                out.sampled.pop(request_id, None)
                continue
            out.sampled.setdefault(request_id, []).append(tokens[i])
            n = row.params.logprobs
            if n is not None and lp_ids is not None:
                top = list(zip(lp_ids[i][1:n + 1], lp_values[i][1:n + 1], strict=True))
                out.logprobs.setdefault(request_id, []).append(
                    (lp_values[i][0], ranks[i], top))

    def _prompt_logprobs(self, item, row: SampleRow, chunk: RequestChunk, logits: torch.Tensor,
                         out: RunnerOutput) -> None:
        """Logprob of each next prompt token (position p predicts p + 1)."""
        prompt = row.prompt_token_ids
        n = min(chunk.num_new, len(prompt) - 1 - chunk.start)
        if n <= 0:
            return
        targets = torch.tensor(prompt[chunk.start + 1: chunk.start + 1 + n], device=logits.device)
        lp = compute_prompt_logprobs(logits[:n], targets, row.params.prompt_logprobs)
        k = row.params.prompt_logprobs
        entries = out.prompt_logprobs.setdefault(item.request_id, [])
        for i in range(n):
            top = list(zip(lp.token_ids[i, 1:k + 1].tolist(), lp.logprobs[i, 1:k + 1].tolist(),
                           strict=True))
            entries.append((chunk.start + i + 1, int(targets[i]), float(lp.logprobs[i, 0]),
                            int(lp.ranks[i]), top))
