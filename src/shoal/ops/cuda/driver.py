"""Loading a cubin into torch's CUDA context and launching its kernels on torch's current
stream, through the driver API (cuda.bindings.driver). Launches are plain `cuLaunchKernel`
calls, so they are captured by CUDA graphs like torch's own. A `Module` belongs to whoever
loaded it (the op table's backend state): nothing module-global.

Arguments: a tensor passes its data pointer, an int an int32 (range-checked), a float an
fp32; any ctypes scalar passes as itself (e.g. ctypes.c_int64 for a 64-bit count).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch


class CudaDriverError(RuntimeError):
    pass


def _check(result: tuple | Any, what: str):
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise CudaDriverError(f"{what}: {err!r} ({msg.decode() if msg else ''})")
    return rest[0] if len(rest) == 1 else tuple(rest)


def _arg(value: Any) -> ctypes._SimpleCData:
    if isinstance(value, torch.Tensor):
        return ctypes.c_uint64(value.data_ptr())
    if isinstance(value, ctypes._SimpleCData):
        return value
    if isinstance(value, bool):
        return ctypes.c_int32(int(value))
    if isinstance(value, int):
        if not -(1 << 31) <= value < (1 << 31):
            raise ValueError(f"kernel argument {value} does not fit an int32: pass a ctypes type")
        return ctypes.c_int32(value)
    if isinstance(value, float):
        return ctypes.c_float(value)
    raise TypeError(f"unsupported kernel argument type {type(value).__name__}")


class Kernel:
    """One `__global__` function of a loaded module."""

    def __init__(self, module: Module, name: str) -> None:
        from cuda.bindings import driver

        self.name = name
        self._module = module  # keeps the module loaded while the kernel lives
        self._fn = _check(driver.cuModuleGetFunction(module.handle, name.encode()),
                          f"cuModuleGetFunction({name})")
        self._shared = 0

    def allow_shared(self, nbytes: int) -> None:
        """Allow `nbytes` of dynamic shared memory (above the 48 KB default)."""
        from cuda.bindings import driver

        if nbytes > self._shared:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver.cuFuncSetAttribute(self._fn, attr, nbytes),
                   f"cuFuncSetAttribute({self.name})")
            self._shared = nbytes

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], *args: Any,
                 shared: int = 0) -> None:
        from cuda.bindings import driver

        gx, gy, gz = (*grid, 1, 1)[:3]
        bx, by, bz = (*block, 1, 1)[:3]
        if gx * gy * gz == 0:
            return
        if shared > 48 * 1024:
            self.allow_shared(shared)
        values = [_arg(a) for a in args]
        ptrs = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
        stream = torch.cuda.current_stream(self._module.device).cuda_stream
        _check(driver.cuLaunchKernel(self._fn, gx, gy, gz, bx, by, bz, shared, stream,
                                     ctypes.addressof(ptrs), 0), f"launch {self.name}")


class Module:
    """A cubin loaded into the primary context of `device` (the one torch uses)."""

    def __init__(self, cubin: bytes, device: torch.device) -> None:
        from cuda.bindings import driver

        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            torch.cuda.current_stream()  # makes torch's (primary) context current
            torch.cuda.synchronize()
            self.handle = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            self._kernels[name] = Kernel(self, name)
        return self._kernels[name]
