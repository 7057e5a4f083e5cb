"""Batch-invariant products for the reference ops.

Reference results must not depend on how many rows are in a batch (chunked prefill, decode and
batch N must agree bit for bit up to fp32 rounding). fp32 BLAS kernels choose their blocking and
summation order by problem size, so the same row can round differently in a bigger matrix; that
flips exact-looking top-k decisions downstream. Accumulating in fp64 and rounding once to fp32
makes each result independent of the batch (and closer to the exact block sums the official
kernels accumulate)."""

from __future__ import annotations

import torch


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32(a @ b^T) accumulated in fp64. a [..., K], b [N, K]."""
    return (a.double() @ b.double().t()).float()


def einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """fp32 einsum accumulated in fp64."""
    return torch.einsum(equation, *(x.double() for x in operands)).float()
