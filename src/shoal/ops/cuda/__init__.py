"""CUDA C++ kernels compiled at run time by NVRTC (`nvrtc.py`), loaded and launched through the
driver API (`driver.py`); registered as backend "cuda" (not in the default priority until its
kernels are measured on the device; `RunnerConfig.backends` opts in). Each kernel family is a
Python front `<family>.py` beside its source `<family>.cu`."""

from shoal.ops.cuda import moe_decode  # noqa: F401  (registers its ops)
