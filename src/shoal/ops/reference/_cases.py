"""Input builders shared by the reference ops' conformance case grids (random, seeded by the
conformance test through a torch.Generator; never zeros, so that timing/equality is honest)."""

from __future__ import annotations

import torch

from shoal.quant.fp4 import quant_mxfp4
from shoal.quant.fp8 import quant_fp8_weight


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype=torch.bfloat16,
          device: torch.device | str = "cpu") -> torch.Tensor:
    x = torch.randn(*shape, generator=gen, dtype=torch.float32) * scale
    return x.to(dtype).to(device)


def fp8_weight(gen: torch.Generator, n: int, k: int, device, block: int = 32):
    w = torch.randn(n, k, generator=gen) / k**0.5
    codes, scales = quant_fp8_weight(w, block)
    return codes.to(device), scales.to(device)


def fp4_weight(gen: torch.Generator, n: int, k: int, device, block: int = 32):
    w = torch.randn(n, k, generator=gen) / k**0.5
    packed, scales = quant_mxfp4(w, block)
    return packed.to(device), scales.to(device)
