"""The fused synthetic-MXFP4 kernel (src/shoal/checkpoint/mxfp4_kernel.py) against its definition,
the torch path of the checkpoint writer (hash -> near-normal -> `quant_mxfp4`) on the CPU: the
same bytes for odd row counts, widths that are and are not a multiple of the kernel's tile, and
keys of both signs; and `generate_weights` on CUDA equal to the CPU for every expert tensor of
`tiny`. Run where the Triton kernel tests run (sm_90, or the CPU under the interpreter).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from support.triton_interpreter import DEV, ON_GPU, needs_kernels  # noqa: E402

pytestmark = needs_kernels

from shoal.checkpoint import writer  # noqa: E402
from shoal.checkpoint.mxfp4_kernel import generate_mxfp4  # noqa: E402
from shoal.model.presets import TINY  # noqa: E402
from shoal.quant.fp4 import quant_mxfp4  # noqa: E402

CONSTANTS = (writer._GAMMA, writer._MIX1, writer._MIX2)


def _definition(n: int, k: int, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    values = writer._values(key, 0, n * k, "cpu", 1.0 / math.sqrt(k)).view(n, k)
    return quant_mxfp4(values, 32)


@pytest.mark.parametrize(("n", "k"), [(1, 32), (17, 96), (33, 256), (5, 2304)])
def test_kernel_bytes_equal_the_torch_generator(n: int, k: int) -> None:
    for name in (f"layers.0.ffn.experts.{n}.w1.weight", f"x{k}"):  # keys of both signs
        key = writer.tensor_key(7, name)
        packed, scales = generate_mxfp4(n, k, key, 1.0 / math.sqrt(k), CONSTANTS, DEV)
        want_packed, want_scales = _definition(n, k, key)
        assert torch.equal(packed.cpu(), want_packed), (n, k, key)
        assert torch.equal(scales.cpu(), want_scales), (n, k, key)


def test_width_not_a_multiple_of_32_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        generate_mxfp4(2, 48, 1, 0.1, CONSTANTS, DEV)


@pytest.mark.skipif(not ON_GPU, reason="generate_weights takes the kernel on CUDA only")
def test_generate_weights_on_cuda_equals_the_cpu() -> None:
    names = [n for n in writer.checkpoint_inventory(TINY) if ".experts." in n][:12]
    assert any(n.endswith(".scale") for n in names)
    got = dict(writer.generate_weights(TINY, seed=3, device="cuda", names=names))
    want = dict(writer.generate_weights(TINY, seed=3, device="cpu", names=names))
    for name in names:
        assert torch.equal(got[name].cpu(), want[name]), name
