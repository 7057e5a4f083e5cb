"""Shared argument checks and block reshapes for the quantisers (private to ``shoal.quant``).

Invariant: every helper is a pure function of its arguments; errors are ValueErrors that name the
function, the argument and the expectation.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_block(fn: str, block: int) -> None:
    """Raise ValueError unless ``block`` is a positive int."""
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ValueError(f"{fn}: block must be a positive int, got {block!r}")


def check_float(fn: str, name: str, x: Tensor) -> None:
    """Raise ValueError unless ``x`` is a floating-point tensor with at least one dimension."""
    if not torch.is_floating_point(x):
        raise ValueError(f"{fn}: {name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{fn}: {name} must have at least 1 dimension, got a scalar")


def check_last_dim(fn: str, name: str, k: int, block: int, even: bool = False) -> None:
    """Raise ValueError unless ``k`` is a multiple of ``block`` (and even, when asked)."""
    if k % block != 0:
        raise ValueError(f"{fn}: {name}.shape[-1]={k} must be a multiple of block={block}")
    if even and k % 2 != 0:
        raise ValueError(f"{fn}: {name}.shape[-1]={k} must be even (two fp4 codes per byte)")


def check_shape(fn: str, name: str, t: Tensor, expected: tuple[int, ...]) -> None:
    """Raise ValueError unless ``t.shape == expected``."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{fn}: {name}.shape must be {tuple(expected)}, got {tuple(t.shape)}")


def check_dtype(fn: str, name: str, t: Tensor, *dtypes: torch.dtype) -> None:
    """Raise ValueError unless ``t.dtype`` is one of ``dtypes``."""
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{fn}: {name}.dtype must be {want}, got {t.dtype}")


def blocked(x: Tensor, block: int) -> Tensor:
    """[..., K] -> [..., K // block, block] (a view; K must be a multiple of block)."""
    return x.unflatten(-1, (x.shape[-1] // block, block))


def abs_block_max(g: Tensor) -> Tensor:
    """max |g| over the last dim of [..., nb, block] fp32 -> [..., nb]; NaN anywhere gives NaN."""
    return g.abs().amax(dim=-1)
