"""Session settings of the whole suite.

torch's intra-op threads: one on a machine without CUDA, unless OMP_NUM_THREADS says otherwise
or the Triton interpreter runs (its lane). `make test` runs the main suite beside the
interpreted lane on 2 cores, where a second torch thread of the main suite waits on the core the
interpreter holds; alone, the tiny model's ops are too small for a second thread to pay. The
interpreted lane keeps torch's threads: its large reference ops take the second core whenever
the main suite leaves it. Every test starts with the count (an in-process `shoal` CLI call sets
its own); spawned processes and the CLI read it from OMP_NUM_THREADS.
"""

from __future__ import annotations

import os

import pytest
import torch

if ("OMP_NUM_THREADS" in os.environ or torch.cuda.is_available()
        or os.environ.get("TRITON_INTERPRET") == "1"):
    SUITE_THREADS = torch.get_num_threads()
else:
    SUITE_THREADS = 1
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _suite_threads() -> None:
    torch.set_num_threads(SUITE_THREADS)
