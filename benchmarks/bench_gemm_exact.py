"""The cost of `gemm_fp8`'s official-rounding backend (`triton_exact`, ops/triton/gemm_exact.py)
against the default `triton` op, both whole ops (activation quantisation included; the default's
weights folded once beforehand, as an engine's table holds them), on mini's dense FP8 shapes at
decode and prefill sizes: time, the ratio, and the share of outputs with the reference's bits
(M <= 64).

    PYTHONPATH=src python3 benchmarks/bench_gemm_exact.py
"""

from __future__ import annotations

import json

import torch
import triton

from shoal.bench import git_commit
from shoal.ops.reference.gemm import gemm_fp8 as reference
from shoal.ops.triton import gemm as tg
from shoal.ops.triton.gemm_exact import gemm_fp8_exact
from shoal.quant.fp8 import quant_fp8_weight

HBM, FP8_PEAK = 4.24e12, 1343e12
SHAPES = {"wq_a|wkv": (1792, 5120), "wq_b": (32768, 1280), "wo_b": (5120, 8192)}
ROWS = (1, 64, 4096)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w, ws = quant_fp8_weight(torch.randn(n, k, device="cuda", generator=g) / k**0.5, 32)
        cache = tg.PreparedCache()
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            kw = {"x": x, "weight": w, "weight_scale": ws}
            ref = reference(**kw) if m <= 64 else None  # (the fp64 reference is big above)
            fns = {"triton": lambda kw=kw, cache=cache: tg.gemm_fp8(**kw, state=cache),
                   "triton_exact": lambda kw=kw: gemm_fp8_exact(**kw)}
            row = {"shape": name, "M": m, "N": n, "K": k}
            for label, fn in fns.items():
                row[f"{label}_bitwise_share"] = None if ref is None else \
                    round(float((fn() == ref).float().mean()), 5)
                ms = triton.testing.do_bench(fn, warmup=10, rep=50)
                row[f"{label}_us"] = round(ms * 1e3, 1)
            t = row["triton_exact_us"] * 1e-6
            row["exact_over_default"] = round(row["triton_exact_us"] / row["triton_us"], 2)
            row["exact_frac_hbm"] = round((n * k + m * k * 2 + m * n * 2) / t / HBM, 3)
            row["exact_frac_fp8_peak"] = round(2.0 * m * n * k / t / FP8_PEAK, 3)
            rows.append(row)
            print(f"{name:9s} M={m:5d}  triton {row['triton_us']:8.1f} us  exact "
                  f"{row['triton_exact_us']:8.1f} us  x{row['exact_over_default']:.2f}  bitwise "
                  f"{row['triton_bitwise_share']} / {row['triton_exact_bitwise_share']}",
                  flush=True)
    print(json.dumps({"bench": "gemm_exact", "commit": git_commit(),
                      "gpu": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
