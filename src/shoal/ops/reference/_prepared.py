"""Inputs the reference ops prepare once per resolved op table (the registry's `state`): weights
dequantised into the form their products read, and other values that depend only on a layer's
constants. A CPU decode step otherwise dequantised every FP8 and MXFP4 weight again.

Invariant: a prepared value is exactly what the op computes without the memo (the same function
builds it), and it is used only while its sources are the same live tensors, unchanged since
(`_version`, shared by every view of their storage); an entry dies with its first source
(weakref finalizer) or with the table. Only CPU tensors are kept (on a GPU the reference is a
debugging path and the memory plan leaves no room for copies), within a byte budget.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

import torch

BUDGET_BYTES = 1 << 30  # beyond it (a large model on the CPU) values are built per call


class Prepared:
    """Memo of prepared tensors keyed by (source tensor identity, tag)."""

    def __init__(self, budget_bytes: int = BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        # key -> (weakref to the first source, the other sources, their versions, value)
        self._map: dict[tuple[int, Hashable], tuple] = {}

    def get(self, sources: tuple[torch.Tensor, ...], tag: Hashable,
            build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`build()`, memoised for these source tensors (the first one keys and owns the entry)
        and `tag` (what is built from them)."""
        first = sources[0]
        if first.device.type != "cpu" or any(s.is_inference() for s in sources):
            return build()  # inference tensors keep no version counter
        key = (id(first), tag)
        versions = tuple(s._version for s in sources)
        hit = self._map.get(key)
        live = hit is not None and hit[0]() is first
        if live and hit[2] == versions and all(a is b for a, b in zip(hit[1], sources[1:],
                                                                       strict=True)):
            return hit[3]
        value = build()
        self._drop(key)
        size = value.numel() * value.element_size()
        if self.bytes + size <= self.budget_bytes:
            self._map[key] = (weakref.ref(first), sources[1:], versions, value)
            self.bytes += size
            if not live:  # the memo itself stays collectable: the finalizer holds a weakref
                weakref.finalize(first, _drop_from, weakref.ref(self), key)
        return value

    def value(self, key: Hashable, device: torch.device,
              build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`build()` (a small tensor on `device` from a layer's constants, no source tensor)
        memoised under `key`."""
        if device.type != "cpu":
            return build()
        hit = self._map.get(("const", key))
        if hit is None:
            hit = self._map[("const", key)] = (None, (), (), build())
        return hit[3]

    def _drop(self, key: tuple) -> None:
        old = self._map.pop(key, None)
        if old is not None:
            self.bytes -= old[3].numel() * old[3].element_size()


def _drop_from(memo: weakref.ref, key: tuple) -> None:
    target = memo()
    if target is not None:
        target._drop(key)
