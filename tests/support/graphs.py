"""CUDA graph helpers for the GPU tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def replayed(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`fn()` run once on a side stream (warm: modules loaded, kernels compiled), then captured
    in a CUDA graph whose output is zeroed and replayed: the replay's output."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out
