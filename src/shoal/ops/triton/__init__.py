"""Triton backend for sm_90 (Hopper): importing this package registers its op implementations.

Invariant: every implementation has the reference op's exact signature and a cheap shape-only
`supports` predicate; anything it does not support falls back to the reference (registry.py).
"""

from shoal.ops.triton import attention, gemm, moe  # noqa: F401
from shoal.ops.triton import hyper_connections, norm, rope  # noqa: F401
