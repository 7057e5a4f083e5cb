"""The Triton `gemm_fp8` against its reference on the inputs a model gives it (CUDA): the
official fixture's case run teacher-forced (tests/model/test_official_layers.py) with every
gemm_fp8 call recorded, then per weight shape the worst output row's relative L2 error of the
fast op against the reference op on the same inputs, and of the folded activations
(`act_quant(fold=True)`: codes times the row scale) against the reference's dequantised ones,
and the share of outputs not bitwise the reference's, for the op and for `triton_exact`.

    PYTHONPATH=src:tests python3 scripts/gemm_fp8_in_situ.py [--case tiny-modulo-map]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pytest
import torch

from model import test_official_layers as t
from shoal.ops.reference.gemm import gemm_fp8 as reference_gemm
from shoal.ops.triton.act_quant import act_quant
from shoal.ops.triton.gemm_exact import gemm_fp8_exact
from shoal.quant.fp8 import dequant_fp8_act, quant_fp8_act


def row_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="tiny-modulo-map")
    ap.add_argument("--calls", type=int, default=300, help="calls recorded (the first ones)")
    ap.add_argument("--backends", default="triton,reference",
                    help="op table (triton_exact first: the official-rounding GEMM)")
    args = ap.parse_args()
    case = next(c for c in t.FIXTURE["cases"] if c["name"] == args.case)
    calls: list[dict] = []

    def record(mp: pytest.MonkeyPatch, fns: dict) -> None:
        fast = fns["gemm_fp8"]

        def recorded(**kw):
            out = fast(**kw)
            if len(calls) < args.calls:
                calls.append({"x": kw["x"].clone(), "weight": kw["weight"],
                              "weight_scale": kw["weight_scale"], "out": out.clone()})
            return out
        fns["gemm_fp8"] = recorded

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        t.teacher_forced(case, Path(tmp), mp, record, device="cuda",
                         backends=args.backends.split(","))
    worst: dict[tuple, list[float]] = {}
    for c in calls:
        x = c["x"].reshape(-1, c["x"].shape[-1])
        ref = reference_gemm(x=x, weight=c["weight"], weight_scale=c["weight_scale"])
        q, rs = act_quant(x, 32, fold=True)
        folded = q[:x.shape[0]].float() * rs.unsqueeze(1)
        exact = dequant_fp8_act(*quant_fp8_act(x, 32), 32)
        out = c["out"].reshape(ref.shape)
        strict = gemm_fp8_exact(x=x, weight=c["weight"], weight_scale=c["weight_scale"])
        key = (tuple(c["weight"].shape), x.shape[0])
        w = worst.setdefault(key, [0.0, 0.0, 0, 0, 0, 0])
        w[0] = max(w[0], row_rel(out, ref))
        w[1] = max(w[1], row_rel(folded, exact))
        w[2] += 1
        w[3] += int((out != ref).sum())
        w[4] += int((strict != ref).sum())
        w[5] += ref.numel()
    print(f"{args.case}: {len(calls)} gemm_fp8 calls")
    print("weight [N, K]   rows  calls  worst row rel (op vs reference)  "
          "worst row rel (folded vs exact activations)  outputs not bitwise: op, triton_exact")
    for (shape, rows), (op, act, n, off, off_exact, total) in sorted(worst.items()):
        print(f"{str(list(shape)):14s} {rows:5d}  {n:5d}  {op:.3e}  {act:.3e}  "
              f"{off / total:.4f}  {off_exact / total:.4f}")


if __name__ == "__main__":
    main()
