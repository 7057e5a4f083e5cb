"""Start-up on CUDA: prefill-shaped warm-up steps (their Triton kernels compile now rather than
during a run) and the capture of the decode / verify CUDA graphs and (speculative) the draft
block's, all on the pad slot and block the scheduler never hands out."""

from __future__ import annotations

import logging
import time

import torch

from shoal.config import EngineConfig
from shoal.model.batch import build_forward_batch
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.state import KVCaches
from shoal.runner.cache_memory import MemoryPlan
from shoal.runner.cuda_graphs import DecodeGraphs, prefill_warmup_chunks
from shoal.runner.draft_graphs import DraftGraphs

logger = logging.getLogger(__name__)


def decode_graphs(config: EngineConfig, model: DeepseekV41, caches: KVCaches,
                  memory: MemoryPlan, *, use_graphs: bool) -> DecodeGraphs:
    """The static padded decode path over `model` and `caches` (captured on CUDA when
    `use_graphs`; tests run it eagerly on the CPU)."""
    sched, spec = config.scheduler, config.runner.speculative
    max_batch = min(sched.max_num_seqs, memory.num_slots, sched.max_num_batched_tokens, 256)
    return DecodeGraphs(model, caches, max_batch=max_batch, max_context=sched.max_model_len,
                        max_blocks=-(-sched.max_model_len // memory.block_size),
                        pad_slot=memory.num_slots, pad_block=memory.num_blocks,
                        use_graphs=use_graphs, sizes=config.runner.cuda_graph_batch_sizes,
                        verify_rows=1 + config.model_config.dspark_draft_len if spec else 0,
                        hidden=spec)


def warm_up_prefill(config: EngineConfig, model: DeepseekV41, caches: KVCaches,
                    memory: MemoryPlan, device: torch.device) -> float:
    """Run prefill-shaped steps on the pad slot / block (decode shapes compile in
    DecodeGraphs.capture); returns the seconds spent."""
    t0 = time.perf_counter()
    sched, cfg = config.scheduler, config.model_config
    chunks = prefill_warmup_chunks(
        cfg, max_tokens=sched.max_num_batched_tokens, max_context=sched.max_model_len,
        block_size=memory.block_size, pad_slot=memory.num_slots, pad_block=memory.num_blocks)
    with torch.inference_mode():
        for chunk in chunks:
            batch = build_forward_batch(cfg, [chunk], device=device,
                                        prefill_mode=config.runner.prefill_mode,
                                        replay_window=config.runner.replay_window)
            model.forward(batch, caches)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    logger.info("warm-up: %d prefill shapes in %.1f s", len(chunks), seconds)
    return seconds


def start_decode_graphs(config: EngineConfig, model: DeepseekV41, caches: KVCaches,
                        memory: MemoryPlan, device: torch.device
                        ) -> tuple[DecodeGraphs | None, float]:
    """Warm up and capture the decode (and, speculative, verify) graphs when they apply (CUDA,
    `cuda_graphs`); returns them (None: every step runs eagerly) and the warm-up seconds."""
    if not config.runner.cuda_graphs:
        logger.info("CUDA graphs: off (cuda_graphs=False)")
        return None, 0.0
    if device.type != "cuda":
        logger.info("CUDA graphs: off (device %s)", device)
        return None, 0.0
    if model.ep is not None and config.runner.speculative:  # verify and draft steps' fixed
        # exchanges are not written
        logger.info("CUDA graphs: off (speculative decoding with expert parallelism)")
        return None, 0.0
    if model.expert_loads is not None:  # padded graph rows would be counted
        logger.info("CUDA graphs: off (recording expert loads)")
        return None, 0.0
    graphs = decode_graphs(config, model, caches, memory, use_graphs=True)
    seconds = warm_up_prefill(config, model, caches, memory, device)
    try:
        graphs.capture()
    except RuntimeError:  # e.g. an op syncing with the host: run eagerly, loudly
        logger.exception("CUDA graphs: capture failed, every step runs eagerly")
        torch.cuda.synchronize()
        return None, seconds
    return graphs, seconds


def start_draft_graphs(config: EngineConfig, model: DeepseekV41, caches: KVCaches,
                       memory: MemoryPlan, graphs: DecodeGraphs | None) -> DraftGraphs | None:
    """Capture the draft block's graphs at the decode graphs' batch sizes (speculative decoding
    with the decode graphs on); None: drafts run eagerly."""
    if graphs is None or not config.runner.speculative:
        return None
    drafts = DraftGraphs(model, caches, sizes=graphs.sizes, pad_slot=memory.num_slots,
                         use_graphs=True, sampled=config.runner.spec_verify == "rejection")
    try:
        drafts.capture()
    except RuntimeError:
        logger.exception("CUDA graphs: draft capture failed, drafts run eagerly")
        torch.cuda.synchronize()
        return None
    return drafts
