"""Triton backend for sm_90 (Hopper): importing this package registers its op implementations.

Invariant: every implementation has the reference op's exact signature and a cheap shape-only
`supports` predicate; anything it does not support falls back to the reference (registry.py).
"""

from shoal.ops.triton import (  # noqa: F401
    act_quant,
    attention,
    attention_meta,
    cache,
    engram,
    gemm,
    gemm_exact,
    gemm_grouped,
    head,
    hyper_connections,
    indexer,
    moe,
    moe_swiglu,
    norm,
    pool,
    rope,
    router,
)
