"""CUDA C++ kernels compiled at run time by NVRTC (`nvrtc.py`), loaded and launched through the
driver API (`driver.py`); registered as backend "cuda" (not in the default priority until its
kernels are measured on the device; `RunnerConfig.backends` opts in). Each kernel family is a
Python front `<family>.py` beside its source `<family>.cu`."""

from shoal.ops.cuda import moe_decode, sparse_attn  # noqa: F401  (register their ops)
