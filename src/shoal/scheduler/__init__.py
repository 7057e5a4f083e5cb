"""Scheduler: token budget, chunked prefill, preemption and paged-KV block accounting.

Plain Python only (no torch, nothing from shoal.model / runner / ops / engine), so it runs and is
tested on any CPU with exact block ids. Plans and results are picklable dataclasses.
"""

from shoal.scheduler.block_pool import BlockPool, BlockPoolError
from shoal.scheduler.config import SchedulerConfig
from shoal.scheduler.kv_cache_manager import KVCacheManager, KVCacheUsage
from shoal.scheduler.request import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_KV_CAPACITY,
    FINISH_LENGTH,
    FINISH_STOP,
    Request,
    RequestStatus,
)
from shoal.scheduler.scheduler import Scheduler
from shoal.scheduler.step_plan import ScheduledRequest, StepPlan, StepResult

__all__ = [
    "FINISH_ABORT", "FINISH_ERROR", "FINISH_KV_CAPACITY", "FINISH_LENGTH", "FINISH_STOP",
    "BlockPool", "BlockPoolError", "KVCacheManager", "KVCacheUsage", "Request", "RequestStatus",
    "ScheduledRequest", "Scheduler", "SchedulerConfig", "StepPlan", "StepResult",
]
