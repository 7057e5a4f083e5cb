"""How an op's outputs are compared with its reference's (the op contract's tolerance).

Owns `op_outputs` (the values an op produces: its return value(s), then the kwargs it writes in
place) and `check_output`, used by the conformance suite and by shadow checking
(`ops/shadow.py`). Per output: same shape and dtype; the op's `compare` when it has one; exact
for dtypes without a declared tolerance (integers, bool, byte records, fp8 codes); otherwise
NaN and +/-inf positions must match and every finite element must satisfy
|got - want| <= atol + rtol * |want|.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.ops.registry import OpCase, OpDef


def op_outputs(op: OpDef, result: Any, kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, value) of everything the op produced: out / out[i], then its in-place kwargs."""
    if isinstance(result, (tuple, list)):
        outs = [(f"out[{i}]", r) for i, r in enumerate(result)]
    elif result is None:
        outs = []
    else:
        outs = [("out", result)]
    return outs + [(name, kwargs[name]) for name in op.inplace if name in kwargs]


def assert_same_nonfinite(got: torch.Tensor, want: torch.Tensor, prefix: str) -> None:
    """NaN, +inf and -inf at the same positions (float tensors of one shape)."""
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{prefix}: NaN positions differ"
    for sign in (1, -1):
        gi, wi = got == sign * torch.inf, want == sign * torch.inf
        assert torch.equal(gi, wi), f"{prefix}: inf positions differ"


def check_output(op: OpDef, name: str, got: Any, want: Any, msg: str,
                 case: OpCase | None = None) -> None:
    """Raise AssertionError (starting with `msg`) unless `got` matches the reference's `want`."""
    if not isinstance(want, torch.Tensor):
        assert got == want, f"{msg}: {name}: {got!r} != {want!r}"
        return
    assert isinstance(got, torch.Tensor), f"{msg}: {name}: got {type(got)}"
    assert got.shape == want.shape, (f"{msg}: {name}: shape {tuple(got.shape)} != "
                                     f"{tuple(want.shape)}")
    assert got.dtype == want.dtype, f"{msg}: {name}: dtype {got.dtype} != {want.dtype}"
    got, want = got.detach().cpu(), want.detach().cpu()
    if op.compare is not None:
        op.compare(got, want, case)
        return
    if not want.dtype.is_floating_point:
        bad = (got != want).nonzero()
        assert bad.numel() == 0, (f"{msg}: {name}: {len(bad)} elements differ, first at "
                                  f"{bad[0].tolist()}")
        return
    g, w = got.float(), want.float()
    assert_same_nonfinite(g, w, f"{msg}: {name}")
    fin = torch.isfinite(w)
    tol = op.tolerances.get(want.dtype)
    if tol is None:
        bad = (g[fin] != w[fin]).nonzero()
        assert bad.numel() == 0, (f"{msg}: {name}: {len(bad)} of {int(fin.sum())} elements "
                                  "differ (exact)")
        return
    err = (g - w).abs()[fin]
    lim = tol.atol + tol.rtol * w.abs()[fin]
    over = err > lim
    if over.any():
        i = int(torch.argmax(err - lim))
        raise AssertionError(
            f"{msg}: {name}: {int(over.sum())} of {err.numel()} elements over tolerance "
            f"(atol={tol.atol}, rtol={tol.rtol}); worst |diff|={float(err[i]):.4g} "
            f"at ref={float(w[fin][i]):.4g}")

