"""What the Triton launch heuristics read off the device: its SM count. Off the GPU (the Triton
interpreter) it is the H200's 132, so CPU tests run the partitions the H200 runs."""

from __future__ import annotations

import functools

import torch

H200_SMS = 132


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
