"""Fixtures of the model tests: the tiny model with synthetic weights, and a fresh seed."""

from __future__ import annotations

import os
import random

import pytest

from shoal.checkpoint.writer import generate_weights
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams
from shoal.model.presets import TINY
from shoal.ops.registry import resolve_ops


@pytest.fixture(scope="session")
def tiny_model() -> DeepseekV41:
    params = ModelParams.load(TINY, generate_weights(TINY, seed=0))
    return DeepseekV41(TINY, params, resolve_ops("cpu"), token_map_for(TINY))


@pytest.fixture
def seed() -> int:
    """A fresh seed per test run (override with SHOAL_TEST_SEED to reproduce a failure)."""
    value = int(os.environ.get("SHOAL_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed={value}")
    return value
