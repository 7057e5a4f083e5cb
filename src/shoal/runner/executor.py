"""The seam between the engine and the device side: a plain-data plan in (`StepPlan` and the
structured-output masks), a plain-data result out (`RunnerOutput`), in submission order.

`Executor` runs one `ModelRunner` in this process. A multi-rank executor keeps the same four
calls and broadcasts what `submit` receives; nothing else crosses it (plans, masks and results
pickle, `tests/engine/test_executor.py`).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shoal.config import EngineConfig
from shoal.runner.model_runner import NO_MASKS, ModelRunner
from shoal.runner.step_io import LaunchedStep, RunnerOutput
from shoal.scheduler.prefix_cache import PrefixCacheSpec
from shoal.scheduler.step_plan import StepPlan
from shoal.scheduler.tail_rule import TailRule


class Executor:
    def __init__(self, config: EngineConfig, tokenizer: Any | None) -> None:
        self.config = config
        self.runner = ModelRunner(config, tokenizer)
        self._pending: deque[LaunchedStep] = deque()  # submitted, not yet collected

    @property
    def num_blocks(self) -> int:
        return self.runner.memory.num_blocks

    @property
    def num_slots(self) -> int:
        return self.runner.memory.num_slots

    @property
    def block_size(self) -> int:
        return self.runner.layout.block_size

    @property
    def host_slots(self) -> tuple[int, int]:
        """The host tier's (block, snapshot) slots (prefix caching; (0, 0): none)."""
        offload = self.runner.offload
        return (0, 0) if offload is None else (offload.num_blocks, offload.num_snapshots)

    @property
    def kv_store(self):
        """The prefix cache's persistent store (None: none)."""
        return None if self.runner.offload is None else self.runner.offload.store

    @property
    def num_snapshots(self) -> int:
        """Ring snapshots the caches hold (prefix caching)."""
        return self.runner.memory.num_snapshots

    def prefix_cache_spec(self) -> PrefixCacheSpec | None:
        """Prefix caching's settings for the scheduler (None when off): the KV resources this
        executor holds (snapshots, host slots, store) and the hash chain's salt, which names
        everything besides the tokens that changes the KV, so that a store shared by runs and
        processes never mixes them: model, weights (files' sizes and times), ops and device
        kind, block size, prefill mode, how a resume rebuilds the rings (a bounded replay's
        blocks are approximate: never served to an exact run)."""
        config = self.config
        if not config.cache.enable_prefix_caching:
            return None
        mc, run = config.model_config, config.runner
        rule = TailRule(run.prefill_mode, mc.sliding_window, run.replay_window,
                        mc.num_layers - mc.decoder_start)
        files = () if config.is_preset else tuple(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(Path(config.model).glob("*")) if p.suffix in (".json", ".safetensors"))
        model = config.model if config.is_preset else os.path.realpath(config.model)
        salt = repr((model, mc, files, run.load_format, run.seed, run.backends,
                     run.batch_invariant, self.runner.device.type, config.cache.block_size,
                     run.prefill_mode, run.replay_window, config.cache.prefix_resume)).encode()
        replay = run.replay_window if config.cache.prefix_resume == "bounded" else 0
        return PrefixCacheSpec(self.num_snapshots, rule, salt, *self.host_slots, self.kv_store,
                               replay)

    @property
    def num_in_flight(self) -> int:
        """Steps submitted and not yet collected."""
        return len(self._pending)

    @property
    def speculative(self) -> bool:
        return self.runner.speculative

    def submit(self, plan: StepPlan,
               grammar_masks: Mapping[str, torch.Tensor] = NO_MASKS) -> None:
        """Queue the step's device work; its result comes from a later `collect`."""
        self._pending.append(self.runner.launch(plan, grammar_masks))

    def collect(self) -> RunnerOutput:
        """The result of the oldest submitted step (waits only for that step's tokens)."""
        return self.runner.finish(self._pending.popleft())

    def discard(self) -> None:
        """Drop the submitted steps without reading them (after an exception in a step); the
        device finishes their queued work before any later step's, on the same stream."""
        self._pending.clear()
        self.runner.forget_last()

    def execute(self, plan: StepPlan,
                grammar_masks: Mapping[str, torch.Tensor] = NO_MASKS) -> RunnerOutput:
        """Submit and collect one step (nothing else may be in flight)."""
        if self._pending:
            raise RuntimeError("execute() with a step in flight: collect() it first")
        self.submit(plan, grammar_masks)
        return self.collect()
