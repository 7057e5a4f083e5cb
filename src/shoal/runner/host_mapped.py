"""Host-mapped tensors: a CUDA tensor whose storage is pinned host memory, read by kernels
over the bus in place (unified virtual addressing: the host pointer is valid on the device).

Used for the Engram tables (`engram_placement="host"`): they are large (203 GB for `flash`)
and a step reads a few rows of them (24 per token and Engram layer), so the gather kernel reads
exactly those rows from host memory, with nothing to copy ahead, no host sync, and the same
kernel, bytes and results as device placement (CUDA graphs capture it unchanged).
"""

from __future__ import annotations

import torch


class _HostArray:
    """`__cuda_array_interface__` over a pinned host tensor; the tensor made from it keeps
    this object (and so the host tensor) alive."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        typestr = {torch.uint8: "|u1", torch.int8: "|i1", torch.float32: "<f4",
                   torch.int32: "<i4", torch.int64: "<i8", torch.float16: "<f2"}
        if host.dtype not in typestr:
            raise TypeError(f"host_mapped: dtype {host.dtype} (map its bytes as uint8)")
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": typestr[host.dtype],
            "data": (host.data_ptr(), False), "version": 3,
            "strides": tuple(s * host.element_size() for s in host.stride())}


def host_mapped(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on CUDA `device` whose storage is a pinned host copy of `tensor`."""
    host = tensor.detach().to("cpu").contiguous()
    host = host if host.is_pinned() else host.pin_memory()
    raw = host.view(torch.uint8) if host.dtype not in (torch.uint8, torch.int8, torch.float32,
                                                      torch.int32, torch.int64, torch.float16) \
        else host
    with torch.cuda.device(device):
        view = torch.as_tensor(_HostArray(raw), device=device)
    return view.view(tensor.dtype) if raw is not host else view
