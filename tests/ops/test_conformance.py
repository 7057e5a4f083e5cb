"""Op conformance suite, generated from the registry (engine.md "The kernel layer").

For every registered op x every available backend x the op's case grid:
- inputs come from a fresh `torch.Generator` seeded from (op, case) — the seed is in the test id;
- a GPU backend runs on CUDA and is compared with the reference run on CPU (inputs copied;
  heavy cases: on the device);
- per output dtype: the op's tolerance, exact for dtypes without one (integer, bool, uint8,
  fp8 codes) unless the op gives `compare`; NaN and +/-inf positions must match;
- in-place kwargs are filled with the same garbage before both runs and compared whole;
- the reference backend (run against itself on CPU) is checked for determinism, stable output
  shapes/dtypes, and no NaN in outputs when no input had one;
- a strided variant (float inputs of >= 2 dims handed over as transposed-storage views) must
  give the contiguous result.
`heavy` cases (real Flash shapes) run only on CUDA or with SHOAL_HEAVY=1.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import pytest
import torch

from shoal.ops.compare import check_output, op_outputs
from shoal.ops.registry import REFERENCE, REGISTRY, OpCase, OpDef, load_backends

load_backends()

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
HEAVY = os.environ.get("SHOAL_HEAVY", "") == "1"
GPU_BACKENDS = ("triton", "triton_invariant", "triton_exact", "cuda")
STRIDED_MAX_ELEMENTS = 1 << 22  # CPU strided re-runs only where cheap


def _available_backends() -> list[str]:
    out = [REFERENCE]
    if HAS_SM90:
        out += [b for b in REGISTRY.backends() if b in GPU_BACKENDS]
    return out


def _seed(op: str, case: str) -> int:
    return zlib.crc32(f"{op}/{case}".encode()) & 0x7FFFFFFF


def _params() -> list[Any]:
    params = []
    for name, op in sorted(REGISTRY.ops.items()):
        for backend in _available_backends():
            if REGISTRY.impl(backend, name) is None:
                continue
            on_gpu = backend != REFERENCE
            for case in op.cases:
                for strided in (False, True):
                    seed = _seed(name, case.name)
                    tag = "-strided" if strided else ""
                    marks = []
                    if case.heavy and not (on_gpu or HEAVY):
                        marks.append(pytest.mark.skip(reason="heavy case: CUDA or SHOAL_HEAVY=1"))
                    if strided and case.heavy:
                        continue
                    params.append(pytest.param(name, backend, case, strided, seed, marks=marks,
                                               id=f"{name}-{backend}-{case.name}{tag}-seed{seed}"))
    return params


# ----------------------------------------------------------------------------- helpers


def _build(op: OpDef, case: OpCase, seed: int, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    kwargs = case.make(gen, device)
    poison = torch.Generator().manual_seed(seed ^ 0x5A5A5A5)
    for name in op.inplace:
        t = kwargs.get(name)
        if isinstance(t, torch.Tensor) and t.numel():
            t.copy_(_garbage(t, poison))
    return kwargs


def _garbage(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Finite, distinctive, deterministic filler of t's shape/dtype (made on CPU)."""
    if t.dtype == torch.bool:
        return torch.randint(0, 2, t.shape, generator=gen).bool()
    if t.dtype.is_floating_point:
        if t.dtype.itemsize == 1:  # fp8 codes: random finite bytes (no NaN codes)
            raw = torch.randint(0, 0x7F, t.shape, generator=gen, dtype=torch.uint8)
            return raw.view(t.dtype)
        return (torch.randn(t.shape, generator=gen) * 1e3 + 7.0).to(t.dtype)
    info = torch.iinfo(t.dtype)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, t.shape, generator=gen, dtype=torch.int64).to(t.dtype)


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device).clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _strided(x: Any, skip: tuple[str, ...]) -> Any:
    """Float tensors of >= 2 dims -> same values in transposed storage (non-contiguous view)."""
    out = {}
    for k, v in x.items():
        if (k not in skip and isinstance(v, torch.Tensor) and v.dtype.is_floating_point
                and v.dim() >= 2 and v.shape[-1] > 1 and v.shape[-2] > 1 and v.numel() > 0):
            v = v.transpose(-1, -2).contiguous().transpose(-1, -2)
            assert not v.is_contiguous()
        out[k] = v
    return out


def _tensors(kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


# ----------------------------------------------------------------------------- tests


def test_every_op_has_cases() -> None:
    ops = REGISTRY.ops
    assert ops, "no ops registered"
    empty = sorted(n for n, op in ops.items() if not op.cases)
    assert not empty, f"ops without conformance cases: {empty}"


@pytest.mark.parametrize("name,backend,case,strided,seed", _params())
def test_conformance(name: str, backend: str, case: OpCase, strided: bool, seed: int) -> None:
    op = REGISTRY.ops[name]
    msg = f"op={name} backend={backend} case={case.name} strided={strided} seed={seed}"
    cpu = torch.device("cpu")
    if backend == REFERENCE:
        _check_reference(op, case, strided, seed, msg)
        return
    impl = REGISTRY.impl(backend, name)
    assert impl is not None
    dev = torch.device("cuda")
    kwargs = _build(op, case, seed, dev)
    # heavy (Flash-shape) cases run the reference on the device too: on the CPU its fp64 sums
    # take minutes per case; small cases keep the independent CPU run
    ref_kwargs = _to(kwargs, dev if case.heavy else cpu)
    run_kwargs = _strided(kwargs, op.inplace) if strided else kwargs
    if not impl.supports(**run_kwargs):
        pytest.skip(f"{backend} does not support this case ({msg})")
    _poison_allocator(dev)
    got = impl.fn(**run_kwargs)
    torch.cuda.synchronize(dev)
    want = op.reference(**ref_kwargs)
    got_outs, want_outs = op_outputs(op, got, run_kwargs), op_outputs(op, want, ref_kwargs)
    assert len(got_outs) == len(want_outs), f"{msg}: {len(got_outs)} outputs != {len(want_outs)}"
    for (n, g), (_, w) in zip(got_outs, want_outs, strict=True):
        check_output(op, n, g, w, msg, case)


def _check_reference(op: OpDef, case: OpCase, strided: bool, seed: int, msg: str) -> None:
    cpu = torch.device("cpu")
    first_kwargs = _build(op, case, seed, cpu)
    if strided and sum(t.numel() for t in _tensors(first_kwargs)) > STRIDED_MAX_ELEMENTS:
        pytest.skip("strided variant only where cheap on CPU")
    inputs_finite = all(
        bool(torch.isfinite(t).all()) for t in _tensors(first_kwargs)
        if t.dtype.is_floating_point and t.dtype.itemsize > 1)
    first = op_outputs(op, op.reference(**first_kwargs), first_kwargs)
    second_kwargs = _build(op, case, seed, cpu)
    if strided:
        second_kwargs = _strided(second_kwargs, op.inplace)
    second = op_outputs(op, op.reference(**second_kwargs), second_kwargs)
    assert len(first) == len(second)
    for (n, a), (_, b) in zip(first, second, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{msg}: {n}: shape/dtype unstable"
            if a.dtype.is_floating_point and inputs_finite and a.dtype.itemsize > 1:
                assert not torch.isnan(a).any(), f"{msg}: {n}: NaN from finite inputs"
        if strided:
            check_output(op, n, b, a, msg, case)  # same values through strided views
        elif isinstance(a, torch.Tensor):
            same = torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(
                torch.uint8) if b.dtype.itemsize == 1 else b) or (
                a.dtype.is_floating_point and torch.equal(torch.isnan(a), torch.isnan(b))
                and torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)]))
            assert same, f"{msg}: {n}: reference is not deterministic"
        else:
            assert a == b, f"{msg}: {n}: reference is not deterministic"


def _poison_allocator(dev: torch.device) -> None:
    """Fill cached-allocator memory with NaN bytes so that outputs a backend allocates but does
    not fully write show up as NaN (or garbage) instead of lucky zeros."""
    blob = torch.full((64 << 20,), 0xFF, dtype=torch.uint8, device=dev)
    del blob
