"""Host-mapped tensors: a CUDA tensor whose storage is pinned host memory, read by kernels
over the bus in place (unified virtual addressing: the host pointer is valid on the device).

Used for the Engram tables (`engram_placement="host"`): they are large (203 GB for `flash`)
and a step reads a few rows of them (24 per token and Engram layer), so the gather kernel reads
exactly those rows from host memory, with nothing to copy ahead, no host sync, and the same
kernel, bytes and results as device placement (CUDA graphs capture it unchanged).

Ranks of one node share one copy (`node_shared`): the node's local rank 0 writes each table
into a file in /dev/shm, every rank maps it (MAP_SHARED) and page-locks the mapping in place
(`cudaHostRegister`), and the writer unlinks the files once all have mapped them (the memory lives
until the last process exits; nothing is left behind).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


class _HostBytes:
    """`__cuda_array_interface__` over the bytes of a contiguous host tensor; the CUDA tensor
    made from it keeps this object (and so the host tensor) alive."""

    def __init__(self, raw: torch.Tensor) -> None:
        self.raw = raw
        self.__cuda_array_interface__ = {"shape": tuple(raw.shape), "typestr": "|u1",
                                         "data": (raw.data_ptr(), False), "version": 3}


SHM_DIR = Path("/dev/shm")
CUDA_HOST_REGISTER_PORTABLE_MAPPED = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped


def node_shared(tables: Iterator[tuple[str, torch.Tensor]] | None, specs: dict[str, tuple],
                key: str, creator: bool, barrier: Callable[[], None]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor over a node-shared mapping) for each of `specs` (name -> (shape,
    dtype)). The creator writes `tables` (its loaded tensors) into the files; every rank calls
    this with the same specs and key (others pass tables=None and read nothing)."""
    paths = {name: SHM_DIR / f"shoal-{key}-{name}" for name in specs}

    def nbytes(name: str) -> int:
        shape, dtype = specs[name]
        return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()

    if creator:
        assert tables is not None
        for name, tensor in tables:
            out = torch.from_file(str(paths[name]), shared=True, size=nbytes(name),
                                  dtype=torch.uint8)
            out.copy_(tensor.contiguous().view(torch.uint8).reshape(-1))
    barrier()  # every file written
    mapped = {name: torch.from_file(str(paths[name]), shared=True, size=nbytes(name),
                                    dtype=torch.uint8).view(specs[name][1]).view(specs[name][0])
              for name in specs}
    barrier()  # every rank holds its mappings
    if creator:
        for path in paths.values():
            path.unlink(missing_ok=True)
    yield from mapped.items()


def register_in_place(host: torch.Tensor) -> None:
    """Page-lock a CPU tensor's memory (a file mapping, say) and map it for the GPU, without
    copying it."""
    err = int(torch.cuda.cudart().cudaHostRegister(
        host.data_ptr(), host.numel() * host.element_size(), CUDA_HOST_REGISTER_PORTABLE_MAPPED))
    if err:
        raise RuntimeError(f"cudaHostRegister of {host.numel() * host.element_size()} B failed "
                           f"(cudaError {err})")


def host_mapped(tensor: torch.Tensor, device: torch.device, in_place: bool = False
                ) -> torch.Tensor:
    """A tensor on CUDA `device` whose storage is a pinned host copy of `tensor`, or with
    `in_place` (a contiguous CPU tensor, e.g. from `node_shared`) its own memory, registered."""
    if in_place:
        register_in_place(tensor)
        host = tensor
    else:
        host = tensor.detach().to("cpu").contiguous()
        host = host if host.is_pinned() else host.pin_memory()
    with torch.cuda.device(device):
        view = torch.as_tensor(_HostBytes(host.view(torch.uint8)), device=device)
    return view.view(tensor.dtype)
