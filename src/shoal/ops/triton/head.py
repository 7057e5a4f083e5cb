"""Triton (sm_90) output heads (model.md §2.11, §2.12): `lm_head`, the DSpark `markov_bias` and
`confidence`, on the batch-invariant bf16-weight GEMM `gemm_nt` (ops/triton/gemm.py).

- lm_head: logits [T', V] fp32 = h . W^T, bf16 products on the tensor cores, fp32 accumulation.
  At decode (a few rows) it is a GEMV over the [V, D] bf16 head: one program per 64 vocabulary
  rows streams its slice of the head once (memory-bound by design).
- markov_bias: the row gather e = embed[prev] (bit-exact, a device index) then e . head^T.
- confidence: proj . [h ; e] as one [B * n, D + r] x [1, D + r]^T product.
Invariant: the reference contracts; only fp32 summation order differs from the reference's
fp64 products, inside the registered tolerances; a row's result never depends on the batch.
"""

from __future__ import annotations

import torch

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.gemm_nt import gemm_nt, supports_nt
from shoal.ops.triton.norm import on_device


def _supports_lm_head(*, h: torch.Tensor, weight: torch.Tensor) -> bool:
    return supports_nt(h, weight, torch.float32)


@REGISTRY.implement("triton", "lm_head", supports=_supports_lm_head)
def lm_head(*, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [T', D] bf16 x head [V, D] bf16 -> logits [T', V] fp32 (fp32 accumulation)."""
    return gemm_nt(h, weight, torch.float32)


def _supports_markov(*, prev: torch.Tensor, embed: torch.Tensor, head: torch.Tensor) -> bool:
    return (on_device(prev) and prev.dim() == 1 and embed.dim() == 2
            and embed.dtype == torch.bfloat16 and supports_nt(embed, head, torch.float32))


@REGISTRY.implement("triton", "markov_bias", supports=_supports_markov)
def markov_bias(*, prev: torch.Tensor, embed: torch.Tensor,
                head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e = embed[prev] [B, r] bf16; bias = e . head^T [B, V] fp32. Returns (bias, e)."""
    e = embed[prev.long()]
    return gemm_nt(e, head, torch.float32), e


def _supports_confidence(*, hidden: torch.Tensor, markov_embed: torch.Tensor,
                         proj: torch.Tensor) -> bool:
    return (on_device(hidden) and hidden.dim() == 3 and markov_embed.dim() == 3
            and hidden.shape[:2] == markov_embed.shape[:2] and proj.dim() == 2
            and proj.shape == (1, hidden.shape[2] + markov_embed.shape[2])
            and proj.dtype == torch.bfloat16 and hidden.dtype == markov_embed.dtype
            and hidden.dtype in (torch.bfloat16, torch.float32))


@REGISTRY.implement("triton", "confidence", supports=_supports_confidence)
def confidence(*, hidden: torch.Tensor, markov_embed: torch.Tensor,
               proj: torch.Tensor) -> torch.Tensor:
    """proj . [h ; e] in fp32: hidden [B, n, D], markov_embed [B, n, r] bf16, proj [1, D + r]
    bf16 -> [B, n] fp32."""
    b, n, _ = hidden.shape
    cat = torch.cat([hidden, markov_embed], dim=-1).reshape(b * n, proj.shape[1])
    return gemm_nt(cat, proj, torch.float32).view(b, n)
