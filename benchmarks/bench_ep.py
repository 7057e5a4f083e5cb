"""One expert-parallel MoE layer on several GPUs (torchrun, one process per GPU; gloo on the CPU
for a smoke run): per per-rank batch T, the time of `ExpertParallel.moe` with the exchange by
counts (eager steps) and the fixed exchange (CUDA graph steps), of the local experts alone on
as many rows as a rank receives on average (T x k), and of one all-to-all of the fixed
exchange's packed rows alone; each with the bytes a rank sends and the NVLink rate.

    torchrun --standalone --nproc-per-node N benchmarks/bench_ep.py [--model mini]
        [--tokens 1 16 64 256]

The model's MoE shapes (hidden size, experts, top-k, intermediate size), each rank holding its
E/N slice of MXFP4-of-randn experts (like the engine's dummy weights); routings drawn uniformly.
Rank 0 prints one line per T and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.model.presets import get_preset
from shoal.ops.registry import resolve_ops
from shoal.parallel.expert_parallel import ExpertParallel
from shoal.quant.fp4 import quant_mxfp4


def local_experts(cfg, per: int, device: torch.device, gen: torch.Generator) -> dict:
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    parts: dict[str, list[torch.Tensor]] = {"w13": [], "w13_scale": [], "w2": [], "w2_scale": []}
    for _ in range(per):  # one expert at a time: the fp32 draws stay small
        for name, (n, k) in (("w13", (2 * inter, d)), ("w2", (d, inter))):
            w, s = quant_mxfp4(torch.randn(n, k, device=device, generator=gen) / k ** 0.5)
            parts[name].append(w)
            parts[f"{name}_scale"].append(s)
    return {name: torch.stack(ts) for name, ts in parts.items()}


def timed(fn, device: torch.device, reps: int) -> float:
    """Median ms of `fn` over `reps` calls, every rank starting each call together."""
    fn()  # warm (kernels compiled, buffers allocated)
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_tokens(t: int, cfg, ep: ExpertParallel, ops, experts: dict, device: torch.device,
                 gen: torch.Generator, reps: int) -> dict:
    """One row of the table: the four timings at T = t tokens per rank."""
    e, k, d, world = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, ep.world
    x = (torch.randn(t, d, device=device, generator=gen) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=device, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, device=device, generator=gen)
    shared = torch.zeros(t, d, dtype=torch.bfloat16, device=device)

    def by_counts():
        ep.moe(ops, x, ids, weights, shared, experts, cfg.swiglu_limit)

    def fixed():
        with ep.fixed_exchange(t):
            ep.moe(ops, x, ids, weights, shared, experts, cfg.swiglu_limit)

    xr = (torch.randn(t * k, d, device=device, generator=gen) * 0.5).to(torch.bfloat16)
    idr = torch.randint(0, e // world, (t * k, 1), device=device, generator=gen)
    wr = torch.ones(t * k, 1, device=device)

    def experts_alone():
        ops.moe_mxfp4(x=xr, ids=idr, weights=wr, limit=cfg.swiglu_limit, **experts)

    width = d + d // 32 + 8  # a packed pair: FP8 codes, UE8M0 scales, local id, weight
    send = torch.zeros(world * t * k, width, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)

    def exchange():
        dist.all_to_all_single(recv, send)

    row: dict = {"T": t, "world": world}
    for name, fn in (("moe_counts", by_counts), ("moe_fixed", fixed),
                     ("experts_alone", experts_alone), ("all_to_all", exchange)):
        row[f"{name}_ms"] = timed(fn, device, reps)
    row["fixed_bytes_sent"] = int(send.numel() * (world - 1) / world)
    row["all_to_all_GB_s"] = row["fixed_bytes_sent"] / (row["all_to_all_ms"] * 1e-3) / 1e9
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mini")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    on_cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}" if on_cuda else "cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_cuda else "gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = get_preset(args.model)
    ep = ExpertParallel.from_process_group(device, None, 600.0)
    assert ep is not None, "run under torchrun with at least two processes"
    ops = resolve_ops(device)
    gen = torch.Generator(device=device).manual_seed(rank)
    experts = local_experts(cfg, cfg.n_routed_experts // world, device, gen)
    rows = []
    for t in args.tokens:
        row = bench_tokens(t, cfg, ep, ops, experts, device, gen, args.reps)
        rows.append(row)
        if rank == 0:
            print(f"T={t:4d} x{world}: moe by counts {row['moe_counts_ms']:.3f} ms, fixed "
                  f"{row['moe_fixed_ms']:.3f} ms, experts alone {row['experts_alone_ms']:.3f} "
                  f"ms, all-to-all {row['all_to_all_ms']:.3f} ms "
                  f"({row['fixed_bytes_sent'] / 1e6:.2f} MB sent, "
                  f"{row['all_to_all_GB_s']:.1f} GB/s)", flush=True)
    if rank == 0:
        print(json.dumps({"bench": "ep", "model": args.model, "world": world,
                          "device": torch.cuda.get_device_name() if on_cuda else "cpu",
                          "rows": rows}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
