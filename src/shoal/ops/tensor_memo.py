"""Values an op derives from its input tensors once (prepared weights, row maxima of scales),
kept in the op table's state so that nothing is shared between engines.

Invariant: a memoised value is used only while its sources are the same live tensors, unchanged
since (`_version`, shared by every view of their storage); an entry dies with its first source
(weakref finalizer) or with the memo. Keyed by the first source's identity, not a
WeakKeyDictionary, whose key comparison calls Tensor.__eq__ (elementwise). Inference tensors
keep no version counter: their values are built per call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch


class TensorMemo:
    """Memo of values keyed by (the sources' identity, tag); with `budget_bytes`, tensor values
    beyond the budget are built per call instead of kept."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        # key -> (weakref to the first source, the other sources, their versions, value)
        self._map: dict[tuple[int, Hashable], tuple] = {}

    def get(self, sources: tuple[torch.Tensor, ...], tag: Hashable,
            build: Callable[[], Any]) -> Any:
        """`build()`, memoised for these source tensors (the first one keys and owns the entry)
        and `tag` (what is built from them)."""
        first = sources[0]
        if any(s.is_inference() for s in sources):
            return build()
        key = (id(first), tag)
        versions = tuple(s._version for s in sources)
        hit = self._map.get(key)
        live = hit is not None and hit[0]() is first
        if live and hit[2] == versions and all(a is b for a, b in zip(hit[1], sources[1:],
                                                                       strict=True)):
            return hit[3]
        value = build()
        self._drop(key)
        size = _size(value)
        if self.budget_bytes is None or self.bytes + size <= self.budget_bytes:
            self._map[key] = (weakref.ref(first), sources[1:], versions, value)
            self.bytes += size
            if not live:  # the memo itself stays collectable: the finalizer holds a weakref
                weakref.finalize(first, _drop_from, weakref.ref(self), key)
        return value

    def constant(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """`build()` (a value from a layer's constants, no source tensor) memoised under key."""
        hit = self._map.get(("const", key))
        if hit is None:
            hit = self._map[("const", key)] = (None, (), (), build())
        return hit[3]

    def __len__(self) -> int:
        return len(self._map)

    def _drop(self, key: tuple) -> None:
        old = self._map.pop(key, None)
        if old is not None:
            self.bytes -= _size(old[3])


def _size(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _drop_from(memo: weakref.ref, key: tuple) -> None:
    target = memo()
    if target is not None:
        target._drop(key)
