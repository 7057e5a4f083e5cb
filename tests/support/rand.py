"""Seeded random inputs for op tests (fresh seed per session, SHOAL_TEST_SEED to reproduce)."""

from __future__ import annotations

import os
import secrets

import numpy as np
import torch

BASE_SEED = int(os.environ.get("SHOAL_TEST_SEED", secrets.randbits(31)))


def gen(seed: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1009 + salt)


def randn(g: torch.Generator, *shape: int, scale: float = 1.0,
          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def f64(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float64).numpy()
