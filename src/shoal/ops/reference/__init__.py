"""Portable PyTorch reference backend: importing this package registers every op definition."""

from shoal.ops.reference import (  # noqa: F401
    attention,
    cache,
    engram,
    gemm,
    head,
    hyper_connections,
    indexer,
    moe,
    norm,
    rope,
)
