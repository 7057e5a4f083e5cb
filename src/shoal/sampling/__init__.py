"""Sampling: per-request parameters, the batched sampler, the counter-based RNG and stop strings.

Invariant: a request's sampled tokens depend only on its logits, its parameters, its seed and the
positions it samples at, never on the batch it shares or the device.
"""

from shoal.sampling.batch import SamplingBatch, bitmask_to_bool
from shoal.sampling.params import GREEDY_TEMPERATURE, SamplingParams
from shoal.sampling.rng import derive_seed, request_seed
from shoal.sampling.sampler import (
    LogprobsMode,
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    compute_prompt_logprobs,
)
from shoal.sampling.stop import StopCheck, StopStringMatcher, check_stop

__all__ = [
    "GREEDY_TEMPERATURE",
    "LogprobsMode",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "StopCheck",
    "StopStringMatcher",
    "bitmask_to_bool",
    "check_stop",
    "compute_prompt_logprobs",
    "derive_seed",
    "request_seed",
]
