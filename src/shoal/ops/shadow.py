"""Shadow checking: every op call of a fast table is also run by the reference on the same
inputs, and the two are compared by the op contract (`ops/compare.py`).

Why: end-to-end logits of a model with random weights are a poor test of kernels. On `tiny`
(CPU, 2026-11-29) a relative perturbation of 1.5e-7 in one MoE output moved the prefill logits
by 0.53 of their largest magnitude: bf16 rounding turns it into 1-ulp differences, and the
router's and the indexer's top-k selections flip on them and amplify it layer by layer. Shadow
checking tests each kernel in situ instead, on the inputs the real model feeds it (real cache
layouts, block tables, positions, widths), against its definition.

Owns `shadow_table` and `ShadowLog`. The model keeps running on the fast outputs; in-place
arguments are cloned for the reference, so both write their own copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.ops.compare import check_output, op_outputs
from shoal.ops.registry import REFERENCE, REGISTRY, OpRegistry, OpTable


@dataclass
class ShadowLog:
    """What shadow checking saw: calls per op and the first mismatches (message per call)."""

    calls: dict[str, int] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    max_kept: int = 50

    def failed_ops(self) -> list[str]:
        return sorted({m.split(":", 1)[0] for m in self.mismatches})


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def shadow_table(fast: OpTable, log: ShadowLog, registry: OpRegistry = REGISTRY) -> OpTable:
    """`fast` with every non-reference op wrapped: reference on cloned inputs, then the fast op,
    then the comparison (mismatches go to `log`, the run goes on with the fast result)."""
    fns: dict[str, Callable[..., Any]] = dict(fast.fns)
    for name, backend in fast.origin.items():
        if backend == REFERENCE:
            continue
        op = registry.ops[name]

        def call(*, _op=op, _fast=fast.fns[name], **kwargs: Any) -> Any:
            ref_kwargs = {k: _clone(v) for k, v in kwargs.items()}
            want = _op.reference(**ref_kwargs)
            got = _fast(**kwargs)
            n = log.calls.get(_op.name, 0)
            log.calls[_op.name] = n + 1
            got_outs, want_outs = op_outputs(_op, got, kwargs), op_outputs(_op, want, ref_kwargs)
            for (out_name, g), (_, w) in zip(got_outs, want_outs, strict=True):
                try:
                    check_output(_op, out_name, g, w, f"call {n}")
                except AssertionError as exc:
                    if len(log.mismatches) < log.max_kept:
                        log.mismatches.append(f"{_op.name}: {str(exc).splitlines()[0]}")
            return got

        fns[name] = call
    return OpTable(fns, dict(fast.origin), fast.requested, fast.declined)
