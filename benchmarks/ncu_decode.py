"""The decode-step kernels that sit furthest below their floors, each launched once inside a
profiler range, for Nsight Compute (hardware counters; the H200 machines run it):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section SchedulerStats \\
        python3 benchmarks/ncu_decode.py [--only moe,attn,gemm,grouped]

Every kernel is compiled and run once before the range opens (so ncu sees no compilation);
inside it: the routed MoE at T = 1 and 64 (mini layer, default tiles; `moe_real`: the same over
MXFP4 of randn weights instead of random nibbles), sparse attention with the
op's knobs at T = 1 and 64 (64 heads x 512, 128 SWA + 512 selected rows), the FP8 GEMM at M = 1
on wq_b (1280 -> 32768) and wo_b (8192 -> 5120), the grouped W8A16 wo_a at T = 1; `moe_cuda`: the CUDA C++ decode MoE
(ops/cuda/moe_decode.py), the op's default, over MXFP4 of randn at T = 1 and 64. A range
marker line before each call names it in the log (ncu's own lines follow in launch order).
Without ncu it just runs them (a smoke check).
"""

from __future__ import annotations

import argparse

import bench_attn
import bench_moe
import torch

from shoal.ops.triton import act_quant as tact
from shoal.ops.triton import attention as tri_attn
from shoal.ops.triton import gemm as tg
from shoal.ops.triton import gemm_grouped as tgg
from shoal.ops.triton import moe as tmoe
from shoal.quant.fp8 import quant_fp8_weight


def workloads(only: set[str]) -> list[tuple[str, object]]:
    dev = torch.device("cuda")
    out = []
    if "moe" in only:
        w = bench_moe.weights(bench_moe.E, dev)
        for t in (1, 64):
            r = bench_moe.routing(t, bench_moe.E, 10, dev)
            out.append((f"moe T={t}", lambda r=r: tmoe.moe_experts(**r, **w)))
    if "moe_real" in only:  # the same routings over MXFP4 of randn (bench_moe: ~1.4x slower)
        wr = bench_moe.realistic_weights(bench_moe.E, dev)
        for t in (1, 64):
            r = bench_moe.routing(t, bench_moe.E, 10, dev)
            out.append((f"moe realistic T={t}", lambda r=r: tmoe.moe_experts(**r, **wr)))
    if "moe_cuda" in only:  # the CUDA C++ decode kernels (the op's default)
        from shoal.ops.cuda import moe_decode as cmoe
        wr = bench_moe.realistic_weights(bench_moe.E, dev)
        for name, state in (("default", cmoe.DecodeMoEState()),):
            for t in (1, 64):
                r = bench_moe.routing(t, bench_moe.E, 10, dev)
                out.append((f"moe cuda {name} T={t}",
                            lambda r=r, s=state: cmoe.moe_mxfp4(**r, **wr, state=s)))
    if "attn" in only:
        gen = torch.Generator(device=dev).manual_seed(2)
        for t in (1, 64):
            kw = bench_attn.attn_inputs(t, 128, 512, gen=gen)
            out.append((f"sparse_attn T={t}",
                        lambda kw=kw: tri_attn.sparse_attn(**kw, **tri_attn.OP_KNOBS)))
    if "gemm" in only:
        for name, n, k in (("wq_b", 32768, 1280), ("wo_b", 5120, 8192)):
            x = torch.randn(1, k, device=dev).to(torch.bfloat16)
            wt = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
            ws = torch.full((n // 32, k // 32), 120, dtype=torch.uint8, device=dev)
            prep = tg.prepare_fp8_weight(wt, ws)
            q, rs = tact.act_quant(x, 32, fold=True)
            out.append((f"gemm_fp8 {name} M=1", lambda q=q, rs=rs, p=prep:
                        tg.gemm_fp8_folded(q, rs, p)))
    if "grouped" in only:
        g, r, k = 8, 1024, 4096
        codes, scales = quant_fp8_weight(torch.randn(g * r, k, device=dev) / k**0.5)
        o = torch.randn(1, g, k, device=dev, dtype=torch.bfloat16)
        out.append(("grouped_w8a16 T=1", lambda: tgg.gemm_grouped_w8a16(
            o=o, weight=codes, weight_scale=scales)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="moe,attn,gemm,grouped")
    args = ap.parse_args()
    work = workloads(set(args.only.split(",")))
    for _, fn in work:  # compile, autotune, warm
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in work:
        print(f"=== ncu_decode: {name}", flush=True)
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
