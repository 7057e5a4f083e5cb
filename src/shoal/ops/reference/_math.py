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


def blockwise_matmul_nt(a: torch.Tensor, b: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The official block-scaled GEMM's accumulation: each K block's product exact (fp64,
    rounded once to fp32), added to an fp32 accumulator (from zero) in K order. a [..., K] and
    b [N, K] hold the dequantised values (the power-of-two block scales are exact factors), so
    every block product is exact in fp64 and all blocks can be formed in one batched product."""
    return blockwise_matmul_blocks(a, weight_blocks(b, block))


def weight_blocks(b: torch.Tensor, block: int = 32) -> torch.Tensor:
    """b [N, K] -> [K / block, block, N] fp64: the weight as blockwise_matmul_nt reads it."""
    n, k = b.shape
    return b.reshape(n, k // block, block).permute(1, 2, 0).double()


def blockwise_matmul_blocks(a: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """blockwise_matmul_nt of a [..., K] and a weight already in `weight_blocks` form."""
    *lead, _ = a.shape
    nb, block, n = wb.shape
    rows = a.reshape(-1, nb, block)
    out = torch.empty(rows.shape[0], n, dtype=torch.float32, device=a.device)
    step = max(1, (1 << 25) // max(1, nb * n))  # rows per chunk: <= 256 MB of fp64 products
    for r in range(0, rows.shape[0], step):
        prod = torch.bmm(rows[r:r + step].transpose(0, 1).double(), wb).float()  # [nb, R, N]
        acc = torch.zeros_like(prod[0])
        for j in range(nb):
            acc += prod[j]
        out[r:r + step] = acc
    return out.reshape(*lead, n)


def einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """fp32 einsum accumulated in fp64."""
    return torch.einsum(equation, *(x.double() for x in operands)).float()


def exp(x: torch.Tensor) -> torch.Tensor:
    """fp32 exp evaluated in fp64: torch's CPU kernels evaluate a buffer's bulk with vectorised
    code and its tail with scalar code, which can differ by an ulp, so in fp32 the same row's
    result would depend on where it sits in the batch; in fp64 that ulp vanishes in the rounding
    to fp32."""
    return torch.exp(x.double()).float()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid evaluated in fp64 (see exp)."""
    return torch.sigmoid(x.double()).float()
