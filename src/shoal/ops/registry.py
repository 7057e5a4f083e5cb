"""The op contract: definitions (reference functions), backends, and the resolved op table.

Owns: the catalogue of ops (model.md §7). Each op has exactly one *reference* implementation,
which is its definition (a typed PyTorch function; the docstring states shapes, dtypes, byte
layouts and in-place behaviour), a tolerance per output dtype, and a grid of cases used by the
generated conformance suite. Backends (``triton``, later others) register implementations with
the same signature plus a ``supports(**kwargs)`` predicate.

Invariant: the model never calls a backend directly. An `OpTable` is resolved **once** at
start-up for a backend priority list; the hot path then calls plain functions (no dispatch), so
CUDA graphs capture fixed functions. A backend without an op falls back to the reference, and
the table says so (``report()``).

Debugging: the environment variable ``SHOAL_REFERENCE_OPS=op1,op2`` (read only here, by
`resolve_ops`) forces those ops to the reference, to bisect a suspected kernel fault.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

REFERENCE = "reference"


@dataclass(frozen=True)
class Tolerance:
    """Allowed |a - b| <= atol + rtol * |b|, per output dtype (exact match for integer outputs)."""

    atol: float = 0.0
    rtol: float = 0.0


@dataclass(frozen=True)
class OpCase:
    """One conformance case: `make(generator, device) -> kwargs` builds fresh random inputs.

    `heavy` cases (the real Flash shapes) run only on an accelerator or with SHOAL_HEAVY=1.
    `inplace` names the kwargs an op writes into (compared after the call, poisoned before).
    """

    name: str
    make: Callable[[torch.Generator, torch.device], dict[str, Any]]
    heavy: bool = False


@dataclass(frozen=True)
class OpDef:
    name: str
    reference: Callable[..., Any]
    tolerances: dict[torch.dtype, Tolerance]
    cases: tuple[OpCase, ...]
    inplace: tuple[str, ...] = ()  # kwargs written by the op
    # Optional custom comparison (a, b, case) -> None or raise AssertionError; for outputs whose
    # equality is defined modulo ties (top-k sets) or that are byte records.
    compare: Callable[..., None] | None = None
    # state(): a fresh per-table memo the reference keeps prepared inputs in (dequantised
    # weights), passed as `state=` when a table resolves the op to the reference; direct calls
    # pass none and compute the same bits
    state: Callable[[], Any] | None = None


@dataclass(frozen=True)
class BackendImpl:
    fn: Callable[..., Any]
    supports: Callable[..., bool]
    # state(): a fresh per-table object (e.g. a cache of weights prepared on first use), passed
    # to fn as `state=` by the resolved table; direct calls of fn pass none (fn must accept that)
    state: Callable[[], Any] | None = None


class OpRegistry:
    """Catalogue of op definitions and backend implementations (filled at import time)."""

    def __init__(self) -> None:
        self._defs: dict[str, OpDef] = {}
        self._impls: dict[str, dict[str, BackendImpl]] = {}

    def define(self, name: str, *, tolerances: dict[torch.dtype, Tolerance] | None = None,
               cases: Iterable[OpCase] = (), inplace: tuple[str, ...] = (),
               compare: Callable[..., None] | None = None,
               state: Callable[[], Any] | None = None):
        """Decorator registering `fn` as the reference definition of op `name` (with `state`,
        `fn` takes a `state=None` keyword, as a backend does)."""

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._defs:
                raise ValueError(f"op {name!r} is defined twice")
            self._defs[name] = OpDef(name, fn, dict(tolerances or {}), tuple(cases), inplace,
                                     compare, state)
            return fn

        return wrap

    def implement(self, backend: str, name: str, *,
                  supports: Callable[..., bool] | None = None,
                  state: Callable[[], Any] | None = None):
        """Decorator registering a backend implementation of op `name` (same signature, plus a
        `state=None` keyword when `state` is given: each resolved table makes its own)."""

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            if backend == REFERENCE:
                raise ValueError("the reference backend is defined with define()")
            self._impls.setdefault(backend, {})[name] = BackendImpl(fn, supports or _always,
                                                                    state)
            return fn

        return wrap

    @property
    def ops(self) -> dict[str, OpDef]:
        return dict(self._defs)

    def backends(self) -> list[str]:
        return [REFERENCE, *sorted(self._impls)]

    def impl(self, backend: str, name: str) -> BackendImpl | None:
        if backend == REFERENCE:
            op = self._defs.get(name)
            return None if op is None else BackendImpl(op.reference, _always)
        return self._impls.get(backend, {}).get(name)

    def resolve(self, backends: Iterable[str], force_reference: Iterable[str] = ()) -> OpTable:
        """Pick, for every op, the first backend in priority order that implements it."""
        order = [b for b in backends if b != REFERENCE] + [REFERENCE]
        forced = set(force_reference)
        chosen: dict[str, Callable[..., Any]] = {}
        origin: dict[str, str] = {}
        declined: dict[str, int] = {}
        for name, op in sorted(self._defs.items()):
            backends = [REFERENCE] if name in forced else order
            impls = [(b, self.impl(b, name)) for b in backends if b != REFERENCE]
            impls = [(b, i) for b, i in impls if i is not None]
            if impls:
                chosen[name] = _guarded(name, [i for _, i in impls], op.reference, declined)
                origin[name] = impls[0][0]
            else:
                chosen[name] = op.reference if op.state is None else functools.partial(
                    op.reference, state=op.state())
                origin[name] = REFERENCE
        requested = order[0]
        table = OpTable(chosen, origin, requested, declined)
        fallbacks = table.fallbacks()
        if requested != REFERENCE and fallbacks:
            logger.warning("backend %r lacks %d ops, using the reference for: %s", requested,
                           len(fallbacks), ", ".join(fallbacks))
        return table


def _always(**_: Any) -> bool:
    return True


def _describe(kwargs: dict[str, Any]) -> str:
    parts = []
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            parts.append(f"{key}={tuple(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
                         f"@{value.device.type}")
        elif isinstance(value, (int, float, bool, str)) or value is None:
            parts.append(f"{key}={value!r}")
    return ", ".join(parts)


def _guarded(name: str, impls: list[BackendImpl], reference: Callable[..., Any],
             declined: dict[str, int]):
    """Call the first backend (in priority order) whose `supports(**kwargs)` holds, else the
    reference (never silently wrong; the predicates are cheap and shape-only). Each call that
    reaches the reference is counted in `declined` (`OpTable.declined`), and the first one per
    op is logged with its arguments, so a slow reference on the hot path is visible rather than
    silent. A backend with `state` gets this table's own instance on every call."""
    chain = [(impl, {} if impl.state is None else {"state": impl.state()}) for impl in impls]

    def call(*args: Any, **kwargs: Any) -> Any:
        if args:
            raise TypeError(f"op {name}: call with keyword arguments only")
        for impl, extra in chain:
            if impl.supports(**kwargs):
                return impl.fn(**kwargs, **extra)
        if name not in declined:
            logger.warning("op %s: %s declines (%s); the reference runs", name,
                           getattr(impls[0].fn, "__module__", "?"), _describe(kwargs))
        declined[name] = declined.get(name, 0) + 1
        return reference(**kwargs)

    call.__name__ = f"{name}[{getattr(impls[0].fn, '__module__', '?')}]"
    return call


@dataclass(frozen=True)
class OpTable:
    """The resolved (op -> function) table; attribute access returns the function."""

    fns: dict[str, Callable[..., Any]]
    origin: dict[str, str]
    requested: str = REFERENCE
    # op -> calls its backend's `supports` declined (so the reference ran); filled as it runs
    declined: dict[str, int] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            return self.fns[name]
        except KeyError:
            raise AttributeError(f"no op named {name!r} in the op table") from None

    def fallbacks(self) -> list[str]:
        return sorted(n for n, b in self.origin.items() if b == REFERENCE
                      and self.requested != REFERENCE)

    def report(self) -> str:
        width = max((len(n) for n in self.origin), default=4)
        lines = [f"{'op'.ljust(width)}  backend"]
        for name in sorted(self.origin):
            mark = "  (fallback)" if name in self.fallbacks() else ""
            if self.declined.get(name):
                mark += f"  (declined {self.declined[name]} calls)"
            lines.append(f"{name.ljust(width)}  {self.origin[name]}{mark}")
        return "\n".join(lines)


REGISTRY = OpRegistry()


def load_backends() -> None:
    """Import every backend module so its registrations run (reference always; triton, and the
    CUDA C++ kernels that build on it, if importable with a CUDA device)."""
    from shoal.ops import reference  # noqa: F401

    if torch.cuda.is_available():
        try:
            from shoal.ops import triton as _triton  # noqa: F401
        except ImportError as exc:  # triton missing: the reference serves
            logger.warning("triton backend unavailable: %s", exc)
        else:
            from shoal.ops import cuda as _cuda  # noqa: F401  (NVRTC is checked per call)


def default_backends(device: torch.device) -> list[str]:
    """Backend priority for a device: triton on CUDA sm_90+, else the reference."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return ["triton", REFERENCE]
    return [REFERENCE]


def resolve_ops(device: torch.device | str = "cpu", backends: list[str] | None = None) -> OpTable:
    load_backends()
    device = torch.device(device)
    forced = [n for n in os.environ.get("SHOAL_REFERENCE_OPS", "").split(",") if n]
    return REGISTRY.resolve(backends or default_backends(device), forced)
