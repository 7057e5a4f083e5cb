"""Inputs the reference ops prepare once per resolved op table (the registry's `state`): weights
dequantised into the form their products read, and other values that depend only on a layer's
constants. A CPU decode step otherwise dequantised every FP8 and MXFP4 weight again.

A prepared value is exactly what the op computes without the memo (the same function builds
it); the memo's rules are `TensorMemo`'s. Only CPU tensors are kept (on a GPU the reference is a
debugging path and the memory plan leaves no room for copies), within a byte budget.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from shoal.ops.tensor_memo import TensorMemo

BUDGET_BYTES = 1 << 30  # beyond it (a large model on the CPU) values are built per call


class Prepared(TensorMemo):
    """Memo of prepared CPU tensors keyed by (source tensor identity, tag)."""

    def __init__(self, budget_bytes: int = BUDGET_BYTES) -> None:
        super().__init__(budget_bytes)

    def get(self, sources: tuple[torch.Tensor, ...], tag: Hashable,
            build: Callable[[], torch.Tensor]) -> torch.Tensor:
        if sources[0].device.type != "cpu":
            return build()
        return super().get(sources, tag, build)

    def value(self, key: Hashable, device: torch.device,
              build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`build()` (a small tensor on `device` from a layer's constants) memoised under
        `key` on the CPU."""
        return build() if device.type != "cpu" else self.constant(key, build)
