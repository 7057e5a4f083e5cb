"""Output heads (model.md §2.11, §2.12): the LM head and the DSpark Markov and confidence heads.

Invariant: logits are fp32(h) . fp32(W)^T, computed only for the rows that are sampled.
"""

from __future__ import annotations

import torch

from shoal.ops.reference._cases import randn
from shoal.ops.reference._math import matmul_nt
from shoal.ops.registry import REGISTRY, OpCase, Tolerance

F32_TOL = {torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
           torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2)}


@REGISTRY.define("lm_head", tolerances=F32_TOL, cases=[
    OpCase(f"T{t}xD{d}xV{v}", (lambda t, d, v: lambda g, dev: {
        "h": randn(g, t, d, device=dev), "weight": randn(g, v, d, scale=d**-0.5, device=dev)})(
        t, d, v), heavy=v > 10000)
    for t, d, v in ((1, 32, 97), (7, 128, 512), (0, 32, 16), (5, 96, 1000), (3, 5120, 129280))])
def lm_head(*, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [T', D] bf16 (normed) x head [V, D] bf16 -> logits [T', V] fp32."""
    return matmul_nt(h.float(), weight.float())


@REGISTRY.define("markov_bias", tolerances=F32_TOL, cases=[
    OpCase(f"B{b}xV{v}xR{r}", (lambda b, v, r: lambda g, dev: {
        "prev": torch.randint(0, v, (b,), generator=g).to(dev),
        "embed": randn(g, v, r, device=dev), "head": randn(g, v, r, scale=r**-0.5, device=dev)})(
        b, v, r)) for b, v, r in ((1, 97, 16), (7, 512, 16), (0, 16, 16))])
def markov_bias(*, prev: torch.Tensor, embed: torch.Tensor,
                head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DSpark Markov head: e = embed[prev] [B, r] bf16; bias = fp32(e) . fp32(head)^T [B, V]."""
    e = embed[prev.long()]
    return matmul_nt(e.float(), head.float()), e


@REGISTRY.define("confidence", tolerances=F32_TOL, cases=[
    OpCase(f"B{b}xN{n}xD{d}", (lambda b, n, d: lambda g, dev: {
        "hidden": randn(g, b, n, d, device=dev), "markov_embed": randn(g, b, n, 16, device=dev),
        "proj": randn(g, 1, d + 16, scale=0.05, device=dev)})(b, n, d))
    for b, n, d in ((1, 3, 32), (4, 5, 128), (0, 3, 32))])
def confidence(*, hidden: torch.Tensor, markov_embed: torch.Tensor,
               proj: torch.Tensor) -> torch.Tensor:
    """DSpark confidence logit: proj . [h ; e] in fp32. hidden [B, n, D] bf16 (collapsed,
    pre-norm), markov_embed [B, n, r] bf16, proj [1, D + r] bf16 -> [B, n] fp32."""
    cat = torch.cat([hidden, markov_embed], dim=-1).float()
    return matmul_nt(cat, proj.float()).squeeze(-1)
