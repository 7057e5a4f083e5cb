"""Embedding, mHC (manifold-constrained hyper-connections, V4.1 single-pass form) and the stream
mean used by the DSpark capture (model.md §2.1, §2.2, §2.12).

Invariant: coefficient math is fp32 in the reference order: one RMS statistic over all
hc*D values, `fn` applied to the un-normalised stream, sigmoid pre (+hc_eps), 2*sigmoid post,
row softmax (+hc_eps), column normalisation, then (iters-1) x (row, column) normalisations.
Same rounding as the reference: its fp32 torch expressions, except that `fn . f` is the exact
product rounded once to fp32 and sigmoid / exp are correctly rounded fp32 values (the
reference's fp32 BLAS order and its vectorised transcendentals depend on the batch).
"""

from __future__ import annotations

import numpy as np
import torch

from shoal.ops.reference._cases import randn
from shoal.ops.reference._math import exp, matmul_nt, sigmoid
from shoal.ops.reference.norm import rms_normalise
from shoal.ops.registry import REGISTRY, OpCase, Tolerance

F32_TOL = {torch.float32: Tolerance(atol=1e-5, rtol=1e-4)}
BF16_TOL = {torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2)}


def _stream(g, t, d, dev):
    return randn(g, t, 4, d, device=dev)


@REGISTRY.define("embed", cases=[OpCase(f"T{t}", (lambda t: lambda g, d: {
    "ids": torch.randint(0, 97, (t,), generator=g).to(d),
    "table": randn(g, 97, 64, device=d)})(t)) for t in (1, 7, 0)])
def embed(*, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ids [T] int, table [V, D] bf16 -> [T, D] bf16 (the caller expands to 4 streams)."""
    return table[ids.long()]


def _coeff_case(t: int, d: int) -> OpCase:
    def make(g: torch.Generator, dev: torch.device) -> dict:
        return {"stream": _stream(g, t, d, dev),
                "fn": randn(g, 24, 4 * d, scale=0.05, dtype=torch.float32, device=dev),
                "scale": randn(g, 3, dtype=torch.float32, device=dev).abs() + 0.5,
                "base": randn(g, 24, dtype=torch.float32, device=dev),
                "norm_eps": 1e-20, "hc_eps": 1e-6, "iters": 20}

    return OpCase(f"T{t}xD{d}", make)


@REGISTRY.define("hc_coeffs", tolerances=F32_TOL,
                 cases=[_coeff_case(1, 32), _coeff_case(7, 128), _coeff_case(0, 32),
                        _coeff_case(83, 256), _coeff_case(20, 96), _coeff_case(3, 5120)])
def hc_coeffs(*, stream: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
              base: torch.Tensor, norm_eps: float, hc_eps: float,
              iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """stream [T, hc, D] bf16; fn [(2+hc)*hc, hc*D], scale [3], base [(2+hc)*hc] fp32.

    Returns pre [T, hc], post [T, hc], comb [T, hc, hc] fp32 (comb[i][j]: row i, column j).
    """
    hc = stream.shape[1]
    f = stream.flatten(1).float()
    m = matmul_nt(f, fn.float()) * torch.rsqrt(f.square().mean(-1, keepdim=True) + norm_eps)
    pre = sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = exp(comb - comb.amax(dim=-1, keepdim=True))
    sinkhorn = _sinkhorn_cpu if comb.device.type == "cpu" and hc == 4 else _sinkhorn
    return pre, post, sinkhorn(comb, hc_eps, iters)


def _sinkhorn(comb: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    """The normalisations of the row softmax comb [T, hc, hc] fp32 (the definition)."""
    comb = comb / comb.sum(dim=-1, keepdim=True) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return comb


def _sinkhorn_cpu(comb: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    """_sinkhorn for hc = 4 through numpy: the same fp32 operations in the same order, the sums
    of 4 added left to right as torch's CPU sum adds them (a test checks the bits). On [T, 4, 4]
    a numpy ufunc costs a fraction of a torch op, and these ~120 ops run twice per layer."""
    c = comb.numpy()
    eps = np.float32(hc_eps)
    with np.errstate(all="ignore"):  # NaN / inf propagate silently, as in torch
        for k in range(max(iters, 1)):  # the first round runs whatever iters says
            rows = ((c[..., 0] + c[..., 1]) + c[..., 2]) + c[..., 3]
            c = c / rows[..., None] + eps if k == 0 else c / (rows + eps)[..., None]
            cols = ((c[..., 0, :] + c[..., 1, :]) + c[..., 2, :]) + c[..., 3, :]
            c = c / (cols + eps)[..., None, :]
    return torch.from_numpy(c)


def _collapse_case(t: int, d: int, norm: bool) -> OpCase:
    def make(g: torch.Generator, dev: torch.device) -> dict:
        kw = {"stream": _stream(g, t, d, dev),
              "pre": torch.rand(t, 4, generator=g).to(dev)}
        if norm:
            kw.update(weight=randn(g, d, scale=0.1, device=dev) + 1, eps=1e-20)
        return kw

    return OpCase(f"T{t}xD{d}", make)


@REGISTRY.define("hc_collapse", tolerances=BF16_TOL,
                 cases=[_collapse_case(t, d, False) for t, d in ((1, 32), (7, 128), (0, 32))])
def hc_collapse(*, stream: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x = bf16(sum_i pre_i * X_i) in fp32 (the reference's expression). stream [T, hc, D],
    pre [T, hc]."""
    return torch.sum(pre.float().unsqueeze(-1) * stream.float(), dim=1).to(torch.bfloat16)


@REGISTRY.define("hc_collapse_norm", tolerances=BF16_TOL,
                 cases=[_collapse_case(t, d, True) for t, d in ((1, 32), (7, 128), (0, 32),
                                                                (83, 512))])
def hc_collapse_norm(*, stream: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """RMSNorm(collapse(stream, pre)) -> [T, D] bf16 (the collapse is rounded to bf16 first)."""
    return rms_normalise(hc_collapse(stream=stream, pre=pre).float(), weight, eps)


def _post_case(t: int, d: int) -> OpCase:
    def make(g: torch.Generator, dev: torch.device) -> dict:
        return {"y": randn(g, t, d, device=dev), "stream": _stream(g, t, d, dev),
                "post": torch.rand(t, 4, generator=g).to(dev) * 2,
                "comb": torch.rand(t, 4, 4, generator=g).to(dev)}

    return OpCase(f"T{t}xD{d}", make)


@REGISTRY.define("hc_post", tolerances=BF16_TOL,
                 cases=[_post_case(1, 32), _post_case(7, 128), _post_case(0, 32),
                        _post_case(83, 512)])
def hc_post(*, y: torch.Tensor, stream: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """R'_j = bf16(post_j * y + sum_i comb[i][j] * X_i) in fp32; y [T, D], stream [T, hc, D]."""
    mixed = torch.sum(comb.float().unsqueeze(-1) * stream.float().unsqueeze(-2), dim=1)
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(torch.bfloat16)


@REGISTRY.define("stream_mean", tolerances=BF16_TOL, cases=[
    OpCase(f"T{t}xD{d}", (lambda t, d: lambda g, dev: {"stream": _stream(g, t, d, dev)})(t, d))
    for t, d in ((1, 32), (5, 128), (0, 32))])
def stream_mean(*, stream: torch.Tensor) -> torch.Tensor:
    """bf16(mean_i X_i) over the hc streams: the DSpark capture. stream [T, hc, D]."""
    return stream.to(torch.bfloat16).mean(dim=1)  # the reference's bf16 mean
