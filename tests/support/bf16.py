"""bf16 comparisons against float64 truths for the reference-op tests."""

from __future__ import annotations

import numpy as np
import torch

from support.rand import f64


def bf16_round(x: np.ndarray | float) -> np.ndarray:
    """float64 -> nearest bf16 (one rounding from the float64 value: RNE on the fp64 bits)."""
    return f64(torch.as_tensor(np.asarray(x, dtype=np.float64)).to(torch.bfloat16))


def bf16_ulp(ref: np.ndarray) -> np.ndarray:
    """One bf16 ulp at the magnitude of each element of `ref`."""
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - 7)


def assert_bf16_close(out: torch.Tensor, ref: np.ndarray, ulps: float = 1.0,
                      atol: float = 1e-5, msg: str = "") -> None:
    """out (bf16) within `ulps` bf16 ulps of the float64 truth `ref` (plus atol)."""
    assert out.dtype == torch.bfloat16, out.dtype
    o = f64(out)
    ulp = bf16_ulp(ref)
    err = np.abs(o - ref)
    bad = err > ulps * ulp + atol
    assert not bad.any(), (f"{msg} {bad.sum()} of {bad.size} outside {ulps} ulp; worst at "
                           f"{np.unravel_index(np.argmax(err - ulps * ulp), err.shape)}: "
                           f"out={o[bad][:4]} ref={ref[bad][:4]}")
