"""Where the Triton kernel tests run: natively on sm_90 (`ON_GPU`) or on the CPU under the Triton
interpreter (`INTERP`, TRITON_INTERPRET=1 set before the run); `DEV` is their device and
`needs_kernels` skips a test elsewhere.

Work-arounds for defects of the Triton interpreter (Triton 3.6), applied per test through
pytest's monkeypatch so the kernels' own numerics are what gets checked:

- fp32 -> bf16 casts truncate (the GPU rounds to nearest even): rounded through torch instead;
- `tl.dot` on bf16 operands is wrong: the operands are widened to fp32 (exact) first and
  multiplied by an einsum (NumPy's matmul rounds a row differently by its place in the tile);
- a scalar's `__index__` fails with NumPy 2 (runtime `range` bounds): read the value directly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
INTERP = os.environ.get("TRITON_INTERPRET", "") == "1"
DEV = torch.device("cuda" if ON_GPU else "cpu")
needs_kernels = pytest.mark.skipif(not (ON_GPU or INTERP),
                                   reason="needs sm_90 or TRITON_INTERPRET=1")


def patch_interpreter(monkeypatch: pytest.MonkeyPatch, *, bf16: bool = True) -> None:
    """Apply the shims (bf16=False: only the `__index__` one)."""
    import triton.language as tl
    from triton.runtime import interpreter as ip

    orig_conv, orig_dot, orig_plt = (ip._convert_float, ip.InterpreterBuilder.create_dot,
                                     ip._patch_lang_tensor)

    def conv(data, src, dst, rounding):
        if src == tl.float32 and dst == tl.bfloat16:
            f = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return f.to(torch.bfloat16).view(torch.uint16).numpy()
        return orig_conv(data, src, dst, rounding)

    def up(h):
        if h.dtype != tl.bfloat16:
            return h
        return ip.TensorHandle((np.ascontiguousarray(h.data).astype(np.uint32) << 16)
                               .view(np.float32), tl.float32)

    def dot(self, a, b, d, precision, max_imprecise):
        if a.dtype != tl.bfloat16 and b.dtype != tl.bfloat16:
            return orig_dot(self, a, b, d, precision, max_imprecise)
        # NumPy's fp32 matmul rounds a row's sums differently by its position in the tile
        # (BLAS blocking: 1e-5 apart at K = 128), which no MMA does: a plain einsum instead
        prod = np.einsum("...mk,...kn->...mn", up(a).data, up(b).data)
        return ip.TensorHandle(prod.astype(d.data.dtype) + d.data, d.dtype.scalar)

    def plt(tensor, scope):
        orig_plt(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    if bf16:
        monkeypatch.setattr(ip, "_convert_float", conv)
        monkeypatch.setattr(ip.InterpreterBuilder, "create_dot", dot)
    monkeypatch.setattr(ip, "_patch_lang_tensor", plt)
