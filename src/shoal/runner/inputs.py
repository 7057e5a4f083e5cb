"""Input preparation: a `StepPlan` -> the step's ForwardBatch, the rows of its logits to keep,
the draws to sample, and the patch that feeds in-flight tokens to decode rows.

Invariant: one `RequestChunk` per scheduled request, in plan order; logits come back for
"all" rows of a chunk (prompt logprobs, draft verification), its last row ("last": it samples)
or none, and `offsets[i]` is chunk i's first logits row. A decode row whose input token is
`UNRESOLVED` reads it on the device from the previous launched step's samples; under
speculative decoding a whole verify chunk does (anchor and drafts, `runner/draft_patch.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shoal.config import EngineConfig
from shoal.model.batch import ForwardBatch, RequestChunk, build_forward_batch
from shoal.runner.cuda_graphs import DecodeGraphs
from shoal.runner.draft_patch import DraftPatch
from shoal.runner.inflight import TokenPatch, batch_to_device
from shoal.runner.sampling_step import Draw, RequestState, draws_of
from shoal.runner.speculative import VerifyLayout
from shoal.runner.step_io import LaunchedStep
from shoal.scheduler.step_plan import UNRESOLVED, StepPlan


@dataclass
class StepInputs:
    batch: ForwardBatch
    graphed: bool  # a decode or verify step that replays a CUDA graph
    graph_size: int  # its padded batch size (0: eager)
    patch: TokenPatch | DraftPatch | None
    offsets: list[int]  # per chunk: its first row in the logits
    prompt_chunks: list[int]  # chunks whose prompt logprobs are wanted
    draws: list[Draw]
    sample_rows: list[int]  # per draw: its row in the logits
    decoder_rows_skipped: int
    layout: VerifyLayout | None = None  # speculative decoding


def prepare_inputs(config: EngineConfig, plan: StepPlan, states: Mapping[str, RequestState],
                   previous: LaunchedStep | None, *, device: torch.device,
                   graphs: DecodeGraphs | None, speculative: bool = False) -> StepInputs:
    chunks, prompt_chunks, unresolved, draws, sample_rows, offsets = [], [], [], [], [], []
    patched: list[tuple[int, int, int, str]] = []  # (chunk, first row, rows, request)
    spec: list[tuple] = []  # per sampling request: VerifyLayout's fields
    context_rows: list[int] = []
    window = config.model_config.sliding_window
    row = at = 0  # flat row of the next chunk's first token / first logits row
    for index, item in enumerate(plan.scheduled):
        state = states[item.request_id]
        want_prompt = (state.params.prompt_logprobs is not None
                       and item.start_position < item.num_prompt_tokens)
        logits = ("all" if want_prompt or item.num_spec_tokens else
                  "last" if item.sample else "none")
        ids = item.token_ids
        if ids[0] == UNRESOLVED and speculative:  # the anchor and its drafts
            patched.append((index, row, item.num_new_tokens, item.request_id))
            ids = (0,) * len(ids)
        elif ids[0] == UNRESOLVED:  # (only ever a one-token decode chunk)
            unresolved.append((row, item.request_id))
            ids = (0,)  # a valid id until the patch overwrites it on the device
        if want_prompt:
            prompt_chunks.append(len(chunks))
        chunks.append(RequestChunk(ids, item.start_position, item.slot, item.block_ids,
                                   item.prefill_len, logits, item.history_token_ids,
                                   item.restore_snapshot, item.save_snapshots, item.replay))
        if item.sample:
            first = at + (item.num_new_tokens - 1 - item.num_spec_tokens
                          if logits == "all" else 0)
            if speculative:
                k = item.num_spec_tokens
                spec.append((item.request_id, index, len(draws),
                              row + item.num_new_tokens - 1 - k, k, not state.structured))
            for j, draw in enumerate(draws_of(item, state)):
                draws.append(draw)
                sample_rows.append(first + j)
        if speculative:  # the draft context of the last window positions (and of every draft)
            lo = max(item.start_position, item.prefill_len - window)
            context_rows.extend(range(row + lo - item.start_position, row + item.num_new_tokens))
        offsets.append(at)
        row += item.num_new_tokens
        at += item.num_new_tokens if logits == "all" else 1 if logits == "last" else 0
    patch = draft_patch(patched, previous) if patched else token_patch(unresolved, previous)
    layout = VerifyLayout(*(tuple(f) for f in zip(*spec, strict=True)) if spec
                          else ((),) * 6, tuple(context_rows)) if speculative else None
    graphed = graphs is not None and graphs.fits(chunks)
    cuda = device.type == "cuda"
    runner = config.runner
    batch = build_forward_batch(config.model_config, chunks,
                                device="cpu" if graphed or cuda else device,
                                prefill_mode=runner.prefill_mode,
                                replay_window=runner.replay_window)
    skipped = sum(batch.num_tokens - (r.full.numel() if r.full is not None else batch.num_tokens)
                  for r in batch.layer_rows.values())
    if cuda and not graphed:  # built on the host: pinned, non-blocking uploads (no sync)
        batch = batch_to_device(batch, device)
    return StepInputs(batch, graphed, graphs.padded_size(chunks) if graphed else 0, patch,
                      offsets, prompt_chunks, draws, sample_rows, skipped, layout)


def token_patch(unresolved: list[tuple[int, str]],
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


def draft_patch(patched: list[tuple[int, int, int, str]],
                previous: LaunchedStep | None) -> DraftPatch:
    """Verify chunks whose anchor and drafts are the previous step's proposal."""
    proposal = None if previous is None else previous.proposal
    missing = [rid for *_, rid in patched if proposal is None or rid not in proposal.index]
    if missing or proposal is None:
        raise RuntimeError(f"requests {missing[:5]} verify drafts that the previous launched "
                           "step did not propose")
    return DraftPatch(tuple(c for c, *_ in patched),
                      tuple(proposal.index[rid] for *_, rid in patched),
                      tuple(r for _, r, *_ in patched), tuple(n for _, _, n, _ in patched),
                      proposal)
