"""Rotary embedding on the last `rope_dim` dims, GPT-J interleaved (model.md §2.4).

Invariant: frequencies, angles (fp32(p) * f, rounded in fp32), cos/sin and the rotation are fp32,
computed exactly as the official table (`precompute_freqs_cis`), so no position table is needed;
YaRN only for ratio != 0 layers, and never an attention/mscale factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shoal.ops.reference._cases import randn
from shoal.ops.reference._prepared import Prepared
from shoal.ops.registry import REGISTRY, OpCase, Tolerance


@dataclass(frozen=True)
class RopeParams:
    """One layer's rotary table: rope_dim, theta, and YaRN (factor, original length, betas)."""

    rope_dim: int
    theta: float
    yarn_factor: float = 1.0
    original_max_position: int = 0  # 0 = no YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def rope_frequencies(p: RopeParams, device=None) -> torch.Tensor:
    """[rope_dim // 2] fp32 inverse frequencies, with the YaRN ramp where enabled."""
    rd = p.rope_dim
    freqs = 1.0 / (p.theta ** (torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd))
    if p.original_max_position > 0:
        def corrected_dim(rotations: float) -> float:
            return rd * math.log(p.original_max_position / (rotations * 2 * math.pi)) / (
                2 * math.log(p.theta))

        low = max(math.floor(corrected_dim(p.beta_fast)), 0)
        high = min(math.ceil(corrected_dim(p.beta_slow)), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float32, device=device) - low)
                / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / p.yarn_factor * (1 - smooth) + freqs * smooth
    return freqs


def _case(shape: tuple[int, ...], rd: int, yarn: bool, inverse: bool) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        params = RopeParams(rd, 160000.0, 16.0, 65536) if yarn else RopeParams(rd, 10000.0)
        return {"x": randn(g, *shape, device=d),
                "positions": torch.randint(0, 1 << 20, (shape[0],), generator=g).to(d),
                "params": params, "inverse": inverse}

    return OpCase(f"{'x'.join(map(str, shape))}-rd{rd}-{'yarn' if yarn else 'base'}"
                  f"{'-inv' if inverse else ''}", make)


@REGISTRY.define("rope_tail", tolerances={torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2)},
                 state=Prepared,
                 cases=[_case((1, 64), 16, False, False), _case((7, 4, 64), 16, True, False),
                        _case((0, 4, 64), 16, True, True), _case((83, 32, 128), 64, True, False),
                        _case((9, 64, 512), 64, True, True)])
def rope_tail(*, x: torch.Tensor, positions: torch.Tensor, params: RopeParams,
              inverse: bool = False, state: Prepared | None = None) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of the last rope_dim dims of x by angle pos * f_i.

    x [T, n] or [T, H, n] bf16; positions [T] int64 (p, or j*r for compressed rows).
    `inverse` conjugates the rotation (attention output). Returns a new bf16 tensor.
    `state`: the op table's memo of each layer's frequencies.
    """
    rd = params.rope_dim
    freqs = rope_frequencies(params, x.device) if state is None else state.value(
        ("rope", params), x.device, lambda: rope_frequencies(params, x.device))
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs  # [T, rd/2]
    # cos/sin of the fp32 angle evaluated in fp64 and rounded (batch-invariant; within an ulp
    # of the reference's fp32 table)
    cos, sin = torch.cos(angles.double()).float(), torch.sin(angles.double()).float()
    if inverse:
        sin = -sin
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    tail = x[..., -rd:].float().unflatten(-1, (-1, 2))
    re, im = tail[..., 0], tail[..., 1]
    rot = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rot.to(x.dtype)], dim=-1)
