"""Where `gemm_fp8`'s persistent TMA kernel (ops/triton/gemm_persistent.py) beats the autotuned
pointer kernel: both through `gemm_fp8_folded` on mini's six dense FP8 shapes at M = 128 ..
8192, whether their bits agree (they do not since the persistent tile promotes every 256 K:
session 11), fraction of the FP8 peak, and torch._scaled_mm (per-tensor FP8) on the same codes
at M >= 4096. The `persistent_ok` rule (tile steps per SM) comes from this script's H200 run in
benchmarks/results/session11_h200_2026-12-01.txt.

    PYTHONPATH=src python3 benchmarks/bench_gemm_persistent.py
"""

from __future__ import annotations

import json

import torch
import triton

from shoal.bench import git_commit
from shoal.ops.triton import act_quant as tact
from shoal.ops.triton import gemm as tg
from shoal.ops.triton.device import sm_count
from shoal.ops.triton.gemm_persistent import persistent_ok
from shoal.quant.fp8 import quant_fp8_weight

FP8_PEAK = 1343e12
SHAPES = {"wq_a|wkv": (1792, 5120), "wq_b": (32768, 1280), "wo_b": (5120, 8192),
          "shared_w13": (2304, 5120), "shared_w2": (5120, 2304), "index_wq_b": (4096, 1280)}
ROWS = (128, 256, 512, 1024, 2048, 4096, 8192)


def measure(name: str, prep: tg.PreparedFP8Weight, x: torch.Tensor) -> dict:
    """One shape and M: both kernels (and _scaled_mm from M = 4096) on the same folded codes."""
    (m, k), n = x.shape, prep.codes.shape[0]
    q, rs = tact.act_quant(x, 32, fold=True)
    calls = {"pointer": lambda: tg.gemm_fp8_folded(q, rs, prep, persistent=False),
             "persistent": lambda: tg.gemm_fp8_folded(q, rs, prep, persistent=True)}
    row = {"shape": name, "M": m, "N": n, "K": k,
           "bit_equal": torch.equal(calls["pointer"](), calls["persistent"]()),
           "default": "persistent" if persistent_ok(m, n, k, sm_count(x.device)) else "pointer"}
    for label, fn in calls.items():
        ms = triton.testing.do_bench(fn, warmup=10, rep=50)
        row[f"{label}_us"] = round(ms * 1e3, 1)
        row[f"{label}_frac_peak"] = round(2.0 * m * n * k / (ms * 1e-3) / FP8_PEAK, 3)
    if m >= 4096:
        one = torch.ones((), device="cuda")
        ms = triton.testing.do_bench(lambda: torch._scaled_mm(
            q, prep.codes.t(), one, one, out_dtype=torch.bfloat16), warmup=10, rep=50)
        row["scaled_mm_us"] = round(ms * 1e3, 1)
    return row


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name, (n, k) in SHAPES.items():
        codes, scales = quant_fp8_weight(torch.randn(n, k, generator=gen, device="cuda") / k**0.5)
        prep = tg.prepare_fp8_weight(codes, scales)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            row = measure(name, prep, x)
            print(" ".join(f"{key}={val}" for key, val in row.items()), flush=True)
            results.append(row)
    print(json.dumps({"bench": "gemm_persistent", "commit": git_commit(),
                      "gpu": torch.cuda.get_device_name(), "rows": results}))


if __name__ == "__main__":
    main()
