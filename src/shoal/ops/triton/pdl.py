"""Programmatic dependent launch (PDL, sm_90) for every Triton kernel of the backend.

A kernel launched with `**PDL_LAUNCH` may be put on the SMs while the kernel before it in the
stream is still draining; its first statement, `pdl_wait()`, blocks until that kernel has
finished and its writes are visible (`griddepcontrol.wait`), then lets the next kernel launch
(`griddepcontrol.launch_dependents`). So the data flow is that of plain stream order, and each
kernel boundary loses less time, which counts: a decode step of `mini` is about 450 launches
(measurements: docs/perf/pdl.md).

Rule (tests/ops/test_pdl.py checks it on the source): every kernel (a `@triton.jit` function
that reads `tl.program_id`) starts with `pdl_wait()`, and every launch passes `**PDL_LAUNCH`.
A kernel that read its inputs before its wait would race with the kernel that writes them.

Off under the Triton interpreter (it runs no inline PTX) and with SHOAL_PDL=0 in the
environment (read once at import: for A/B timing; the results are the same either way).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = (os.environ.get("TRITON_INTERPRET", "0") != "1"
           and os.environ.get("SHOAL_PDL", "1") != "0")
PDL_ON = tl.constexpr(ENABLED)
PDL_LAUNCH: dict = {"launch_pdl": True} if ENABLED else {}


@triton.jit
def pdl_wait():
    """Wait for the previous kernel in the stream (and its writes), then let the next one
    launch. A no-op in a kernel launched without PDL."""
    if PDL_ON:
        gdc_wait()
        gdc_launch_dependents()
