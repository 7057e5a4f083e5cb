"""Routed-expert MoE benchmark (mini layer: D 5120, I 2304, 384 experts, top-6) on sm_90.

Variants, side by side in one run (all through `moe_experts`, default tiles unless noted):
`asm` (W4A8, conversion and tiles as the op's defaults: fp16 weights on the decode tiles,
conversion 3 there), `asm_e4m3` (the decode tiles' e4m3 weight path, the default before
`fp4_tiles.w_f16`), `asm_v1` (default tiles, the first prmt conversion on duplicated bytes
everywhere: on the decode tiles the fp16 LUT conversion that conversion 3 replaced), `asm_v0` (the previous decode path: plain 16 x 32 / 16 x 64 mma tiles, asm v1; T * 6 <= 512 only), `asm_swap` (swap-AB wgmma
decode tiles, `moe_tiles.SWAP_DECODE`: faster, less accurate), `asm_p` / `asm_swap_p` (the same tiles
with `TileConfig.promote`: fp32 accumulation promoted every BLOCK_K), `port` (W4A8, portable
conversion), `w4a16` (the bf16 baseline) and `cuda` (the CUDA C++ decode kernels,
ops/cuda/moe_decode.py; decode sizes only; `cuda_dN`: with N chunks of loads in flight;
`cuda_prefill`: the
FP8 wgmma prefill kernels, prefill sizes only). For T = 8192
(compute-bound) and decode T in {1, 8, 16, 64, 256} (--quick:
8192, 1, 64): median time of the whole op (routing, quantisers, both grouped GEMMs, combine),
timed as CUDA-graph replays over rotated routings (so it also proves the op is capturable: no host
syncs); the floor max(HBM bytes of the touched experts' weights + scales / 4.24e12,
2*T*6*3*D*I / 1343e12), the fraction of floor, and the W4A8 (asm) / W4A16 speed ratio. A
correctness line per variant (vs the reference on the CPU, T = 16 on 8 experts) comes first.

--sweep decode|decode-plain|prefill|all: also time `asm` with each candidate tile pair of
moe_tile_sweeps.py's DECODE_CFGS / PLAIN_DECODE_CFGS / PREFILL_CFGS (a pair that fails to
build is reported and skipped) and name the best; --cfgs NAME,NAME keeps only those.
--breakdown: per-stage times of `asm` at each T (route, x quant, w13 GEMM, h quant, w2 GEMM,
combine; each stage its own graph) with each GEMM's own floor (HBM bytes or FP8 FLOPs).
--sass (no GPU needed): benchmarks/sass_moe.py: AOT-compile the tiles for sm_90 and print
registers, spills and the SASS instructions of each K loop per converted weight element.
--weights realistic (default) | random: the experts timed (MXFP4 of randn / sqrt(K), like the
engine's dummy weights, or random nibbles); --layers N: N weight sets the calls rotate over.
Ends with one JSON line; --out keeps a dated copy.

Run: PYTHONPATH=src python3 benchmarks/bench_moe.py [--quick] [--sweep S] [--breakdown] [--out DIR]
     PYTHONPATH=src python3 benchmarks/bench_moe.py --sass
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os

import torch
from moe_tile_sweeps import DECODE_CFGS, PLAIN_DECODE_CFGS, PREFILL_CFGS, V0_DECODE

from shoal.bench import git_commit
from shoal.ops.cuda import moe_decode as cuda_moe
from shoal.ops.cuda import moe_prefill as cuda_prefill
from shoal.ops.reference import moe as ref
from shoal.ops.triton import moe as tmoe
from shoal.ops.triton import moe_route
from shoal.ops.triton import moe_tiles as tiles
from shoal.quant.fp4 import quant_mxfp4

HBM = 4.24e12
FP8_PEAK = 1343e12
BF16_PEAK = 760e12
D, INTER, E, TOPK = 5120, 2304, 384, 6
LINES: list[str] = []


def log(s: str) -> None:
    print(s, flush=True)
    LINES.append(s)


def bench(calls: list, warmup: int = 5, rep: int = 30) -> float:
    """Median ms per call, replaying one CUDA graph that holds all `calls` (rotated inputs)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for c in calls:
            c()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(calls))
    return sorted(times)[len(times) // 2]


def weights(e: int, dev: torch.device) -> dict:
    """Random MXFP4 experts (random nibbles, scales around 2^-6 .. 2^-3)."""
    g = torch.Generator(device=dev).manual_seed(0)
    def w(n: int, k: int):
        p = torch.randint(0, 256, (e, n, k // 2), generator=g, device=dev, dtype=torch.uint8)
        s = torch.randint(121, 125, (e, n, k // 32), generator=g, device=dev, dtype=torch.uint8)
        return p, s
    w13, s13 = w(2 * INTER, D)
    w2, s2 = w(D, INTER)
    return {"w13": w13, "w13_scale": s13, "w2": w2, "w2_scale": s2, "limit": 10.0}


def routing(t: int, e: int, seed: int, dev: torch.device) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.rand(t, e, generator=g, device=dev).topk(TOPK, dim=1).indices
    return {"x": torch.randn(t, D, generator=g, device=dev).to(torch.bfloat16), "ids": ids,
            "weights": torch.rand(t, TOPK, generator=g, device=dev)}


def realistic_weights(e: int, dev: torch.device, seed: int = 1) -> dict:
    """MXFP4 of randn / sqrt(K) (the conformance grid's weights; outputs of order 1), made 16
    experts at a time (the fp32 source of all 384 would take 36 GB)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    out = {"limit": 10.0}
    for name, n, k in (("w13", 2 * INTER, D), ("w2", D, INTER)):
        parts = [quant_mxfp4(torch.randn(min(16, e - i), n, k, generator=g, device=dev)
                             / k**0.5, 32) for i in range(0, e, 16)]
        out[name] = torch.cat([p for p, _ in parts])
        out[name + "_scale"] = torch.cat([s for _, s in parts])
    return out


def variant_kwargs(name: str, rows: int) -> dict | None:
    """moe_experts keyword arguments of a named variant at `rows` routed rows (None: n/a)."""
    if name == "asm":
        return {"use_asm": True}
    if name == "asm_v1":
        return {"use_asm": True, "asm_variant": 1}
    if name == "asm_v0":
        return {"use_asm": True, "asm_variant": 1, "configs": V0_DECODE} if rows <= 512 else None
    if name == "asm_swap":  # the faster, less accurate swap-AB wgmma decode tiles
        return {"use_asm": True, "configs": tiles.SWAP_DECODE} if rows <= 512 else None
    if name in ("asm_p", "asm_swap_p"):  # the same with the promoted fp32 accumulation
        base = tiles.SWAP_DECODE if name == "asm_swap_p" else tiles.default_configs(rows, E)
        if name == "asm_swap_p" and rows > 512:
            return None
        return {"use_asm": True,
                "configs": tuple(dataclasses.replace(c, promote=True) for c in base)}
    if name == "asm_e4m3":  # the decode tiles' e4m3 weight path (the default before w_f16)
        return {"use_asm": True, "configs": tuple(
            dataclasses.replace(c, f16=False) for c in tiles.default_configs(rows, E))}
    if name == "port":
        return {"use_asm": False}
    if name == "w4a16":
        return {"w4a8": False}
    if name == "cuda_prefill":  # the CUDA C++ FP8 wgmma prefill kernels (prefill sizes)
        return {"cuda_prefill": True} if rows > cuda_moe.MAX_ROWS else None
    if name.startswith("cuda"):  # the CUDA C++ decode kernels (`cuda`: the op's defaults;
        # cuda_dN: MOE_DEPTH N)
        depth = int(name.removeprefix("cuda_d")) if name.startswith("cuda_d") else cuda_moe.DEPTH
        if name not in ("cuda", f"cuda_d{depth}"):
            raise ValueError(f"bad cuda variant {name}")
        return {"cuda": depth} if rows <= cuda_moe.MAX_ROWS else None
    raise ValueError(name)


CUDA_STATE: dict = {}


def run(kw: dict, **inputs) -> torch.Tensor:
    """The op of a variant: `moe_experts` with its kwargs, or the CUDA kernels."""
    if kw.get("cuda_prefill"):
        state = CUDA_STATE.setdefault("prefill", cuda_prefill.PrefillMoEState())
        return cuda_prefill.moe_mxfp4_prefill(**inputs, state=state)
    if kw.get("cuda"):
        state = CUDA_STATE.setdefault(kw["cuda"], cuda_moe.DecodeMoEState(kw["cuda"]))
        return cuda_moe.moe_mxfp4(**inputs, state=state)
    return tmoe.moe_experts(**inputs, **kw)


def correctness(dev: torch.device, keep: list[str]) -> dict:
    """Each variant against the reference at 16 tokens, or at 256 where it takes prefill sizes
    only."""
    w = realistic_weights(8, dev)
    cases = {}
    out = {}
    for name in keep:
        t = 16 if variant_kwargs(name, 16 * TOPK) is not None else 256
        if t not in cases:
            r = routing(t, 8, 1, dev)
            cases[t] = (r, ref.moe_mxfp4(**{k: v.cpu() if torch.is_tensor(v) else v
                                            for k, v in {**w, **r}.items()}))
        r, want = cases[t]
        kw = variant_kwargs(name, t * TOPK)
        got = run(kw, **r, **w).cpu()
        err = (got - want).abs()
        ok = bool((err <= 2e-2 + 2e-2 * want.abs()).all())
        rel = float((got - want).norm() / want.norm())
        out[name] = {"rel": rel, "max_abs": float(err.max()), "within_2e-2": ok}
        note = ("  (bf16 activations: the reference rounds x and h to e4m3, so this is that "
                "rounding; tests/kernels/test_moe_kernels checks w4a16 against its own math)"
                if name == "w4a16" else "")
        log(f"correctness {name:6s} rel {rel:.3e} max|d| {float(err.max()):.3e} "
            f"within tol {ok}{note}")
    return out


def floor_ms(t: int, ids: torch.Tensor) -> tuple[float, float, float]:
    touched = int(torch.unique(ids).numel())
    per_expert = 3 * INTER * D // 2 + 3 * INTER * D // 32
    hbm = touched * per_expert / HBM
    flops = 2 * t * TOPK * 3 * D * INTER
    return max(hbm, flops / FP8_PEAK) * 1e3, hbm * 1e3, flops


def gemm_floor_ms(touched: int, n: int, k: int) -> float:
    return touched * n * (k // 2 + k // 32) / HBM * 1e3


def time_calls(calls: list) -> float | None:
    try:
        return bench(calls)
    except Exception as exc:  # a variant that fails to build is reported, not fatal
        log(f"    failed: {type(exc).__name__}: {exc}"[:300])
        return None


def breakdown(t: int, w: dict, dev: torch.device) -> dict:
    """Per-stage ms of the asm op at T = t (default tiles), each stage replayed on its own."""
    s = routing(t, E, 10, dev)
    k = TOPK
    cfg1, cfg2 = tiles.default_configs(t * k, E)
    tok, orow, rw, counts = moe_route.route(s["ids"], s["weights"], E)
    xq, xs = tmoe._quant_folded(s["x"])
    h = torch.empty(t * k, INTER, dtype=torch.bfloat16, device=dev)
    y = torch.empty(t * k, D, dtype=torch.bfloat16, device=dev)
    tmoe._launch(xq, xs, tok, h, orow, rw, w["w13"], w["w13_scale"], counts, INTER, D, 10.0,
                 cfg1, True, True, True, None)
    hq, hs = tmoe._quant_folded(h)
    stages = {
        "route": lambda: moe_route.route(s["ids"], s["weights"], E),
        "x_quant": lambda: tmoe._quant_folded(s["x"]),
        "w13_gemm": lambda: tmoe._launch(xq, xs, tok, h, orow, rw, w["w13"], w["w13_scale"],
                                         counts, INTER, D, 10.0, cfg1, True, True, True, None),
        "h_quant": lambda: tmoe._quant_folded(h),
        "w2_gemm": lambda: tmoe._launch(hq, hs, None, y, orow, rw, w["w2"], w["w2_scale"],
                                        counts, D, INTER, 10.0, cfg2, False, False, True, None),
        "combine": lambda: tmoe._combine(y, t, k, D),
    }
    touched = int(torch.unique(s["ids"]).numel())
    flop_ms = 2 * t * k * 2 * INTER * D / FP8_PEAK * 1e3  # per GEMM: w13 has 2x, w2 1x
    floors = {"w13_gemm": max(gemm_floor_ms(touched, 2 * INTER, D), flop_ms),
              "w2_gemm": max(gemm_floor_ms(touched, D, INTER), flop_ms / 2)}
    out = {}
    for name, fn in stages.items():
        ms = time_calls([fn])
        if ms is None:
            continue
        out[name] = ms
        extra = f"  floor {floors[name]:.4f} ms  frac {floors[name] / ms:.3f}" \
            if name in floors else ""
        log(f"breakdown T={t:4d} {name:9s} {ms:8.4f} ms{extra}")
    out["sum"] = sum(v for v in out.values())
    log(f"breakdown T={t:4d} sum       {out['sum']:8.4f} ms (separate graphs: launch gaps "
        f"between stages not included)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--variants", default="asm,asm_p,asm_swap,asm_swap_p,w4a16")
    ap.add_argument("--sweep", default="", choices=["", "decode", "decode-plain", "prefill", "all"])
    ap.add_argument("--cfgs", default="", help="comma-separated sweep candidates (default: all)")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--tokens", default="", help="comma-separated T list (overrides --quick)")
    ap.add_argument("--weights", default="realistic", choices=["random", "realistic"],
                    help="timed experts: MXFP4 of randn / sqrt(K) (default: the engine's dummy "
                         "weights are made that way), or random nibbles with scales 2^-6..2^-3 "
                         "(the default until 2026-11-29; the W4A8 kernel ran up to 1.46x faster "
                         "on them than on realistic weights before its LUT words were computed)")
    ap.add_argument("--layers", type=int, default=1,
                    help="weight sets the timed calls rotate over (an engine step reads "
                         "every layer's experts once)")
    ap.add_argument("--sass", action="store_true",
                    help="no GPU: sm_90 SASS statistics of the tiles (registers, spills, "
                         "main-loop instructions per weight element), then exit")
    args = ap.parse_args()
    if args.sass:
        import sass_moe
        sass_moe.report(log)
        return
    dev = torch.device("cuda")
    results: dict = {"gpu": torch.cuda.get_device_name(), "shape": [D, INTER, E, TOPK]}
    keep = args.variants.split(",")
    results["correctness"] = correctness(dev, keep)
    wsets = [weights(E, dev) if args.weights == "random" else realistic_weights(E, dev, 1 + i)
             for i in range(args.layers)]  # random: one content, separate copies
    w = wsets[0]
    log(f"timed weights: {args.weights}, {args.layers} set(s)")
    tokens = [8192, 1, 64] if args.quick else [8192, 1, 8, 16, 64, 256]
    if args.tokens:
        tokens = [int(v) for v in args.tokens.split(",")]
    rows = []
    for t in tokens:
        sets = [routing(t, E, 10 + i, dev) for i in range(1 if t >= 1024 else 4)]
        fl, hbm_ms, flops = floor_ms(t, sets[0]["ids"])
        res = {}
        for name in keep:
            kw = variant_kwargs(name, t * TOPK)
            if kw is None:
                continue
            calls = [(lambda s=s, kw=kw, wi=wi: run(kw, **s, **wi))
                     for s in sets for wi in wsets]
            ms = time_calls(calls)
            if ms is None:
                continue
            res[name] = {"ms": ms, "frac_floor": fl / ms, "tflops": flops / ms / 1e9}
            log(f"T={t:5d} {name:6s} {ms:8.3f} ms  floor {fl:.3f} ms (hbm {hbm_ms:.3f})  "
                f"frac {fl / ms:.3f}  {flops / ms / 1e9:7.1f} TF/s")
        if "asm" in res and "w4a16" in res:
            res["w4a8_over_w4a16"] = res["w4a16"]["ms"] / res["asm"]["ms"]
            log(f"T={t:5d} W4A8(asm) speed-up over W4A16: {res['w4a8_over_w4a16']:.2f}x")
        if "asm" in res and "asm_v0" in res:
            res["asm_over_v0"] = res["asm_v0"]["ms"] / res["asm"]["ms"]
            log(f"T={t:5d} asm (new decode tiles) speed-up over asm_v0: "
                f"{res['asm_over_v0']:.2f}x")
        cands = {}
        if args.sweep in ("decode", "all") and t < 1024:
            cands = DECODE_CFGS
        if args.sweep == "decode-plain" and t < 1024:
            cands = PLAIN_DECODE_CFGS
        if args.sweep in ("prefill", "all") and t >= 1024:
            cands = PREFILL_CFGS
        if args.cfgs:
            cands = {n: c for n, c in cands.items() if n in args.cfgs.split(",")}
        sweep = {}
        for cname, cfg in cands.items():
            calls = [(lambda s=s, cfg=cfg: tmoe.moe_experts(**s, **w, use_asm=True,
                                                            configs=cfg)) for s in sets]
            ms = time_calls(calls)
            if ms is None:
                log(f"T={t:5d} sweep {cname:20s} failed")
                continue
            sweep[cname] = ms
            ratio = (f"  {res['w4a16']['ms'] / ms:.2f}x w4a16" if "w4a16" in res else "")
            log(f"T={t:5d} sweep {cname:20s} {ms:8.3f} ms  frac {fl / ms:.3f}{ratio}")
        if sweep:
            best = min(sweep, key=sweep.get)
            log(f"T={t:5d} sweep best {best} {sweep[best]:.3f} ms frac {fl / sweep[best]:.3f}")
            res["sweep"] = sweep
        rows.append({"T": t, "floor_ms": fl, "hbm_floor_ms": hbm_ms, **res})
    if args.breakdown:
        results["breakdown"] = {t: breakdown(t, w, dev) for t in tokens}
    results["rows"] = rows
    commit = git_commit()
    results["commit"] = commit
    line = json.dumps(results)
    log(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        day = datetime.date.today().isoformat()
        with open(os.path.join(args.out, f"bench_moe_{day}.txt"), "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
