"""`batch_invariant=True`: the batch-invariant backend variants go ahead of every other (their
bits: tests/kernels/test_moe_kernels.py; on the GPU: tests/cuda/test_prefix_caching_gpu.py)."""

from __future__ import annotations


def test_batch_invariant_puts_its_backend_ahead_of_triton() -> None:
    from shoal.config import RunnerConfig
    from shoal.runner.loading import op_backends

    default = ["triton", "reference"]
    assert op_backends(RunnerConfig(), default) == default
    assert op_backends(RunnerConfig(batch_invariant=True), default) == [
        "triton_invariant", "triton", "reference"]
    assert op_backends(RunnerConfig(batch_invariant=True), ["reference"]) == ["reference"]
    # ahead of the CUDA kernels too: they serve the MoE at decode sizes only
    assert op_backends(RunnerConfig(batch_invariant=True, backends=("cuda", "triton")),
                       default) == ["triton_invariant", "cuda", "triton"]
