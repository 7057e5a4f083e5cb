"""Op benchmarks for the Triton (sm_90) kernels at V4.1-Flash (mini) shapes.

For each kernel and batch size: median time (triton.testing.do_bench after warm-up, inputs
rotated so that decode-sized working sets do not sit in L2), FLOPs, bytes, the floor
max(bytes / HBM, FLOPs / peak) and the fraction of floor; the FP8 GEMM also against
torch._scaled_mm (per-tensor FP8) on the same shape. Ceilings are re-measured in the run.
A correctness line (relative error vs the reference op, run in fp32 on the GPU) precedes each
kernel. Prints a table, ends with one JSON line, and writes a dated copy to --out.

`--only hc,head`: the decode hot path (mHC coefficients at T = 1..4096, the LM head and the
bf16-weight GEMMs at M = 1..256), each against the reference on the GPU (the old path) in the
same run, plus bit-identity checks of batch invariance and of alternative tile configs.

Run: PYTHONPATH=src python3 benchmarks/bench_ops.py [--quick] [--out DIR] [--only LIST]
(--only: comma list of ceil, gemm, grouped, attn, index, hc, head, router; attn=V1+V2 picks attention
variants from bench_attn.ATTN_VARIANTS). Shared timing and records: op_bench.py.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os

import torch
import triton
from bench_attn import bench_attention
from op_bench import BF16_PEAK, FP8_PEAK, HBM, LINES, RESULTS, bench, copies, log, record, rel_err

from shoal.bench import git_commit
from shoal.ops.reference import gemm as ref_gemm
from shoal.ops.reference import hyper_connections as ref_hc
from shoal.ops.triton import act_quant as tact
from shoal.ops.triton import gemm as tri_gemm
from shoal.ops.triton import gemm_grouped as tri_grouped
from shoal.ops.triton import gemm_nt as tri_nt
from shoal.ops.triton import gemm_persistent as tri_pers
from shoal.ops.triton import hyper_connections as tri_hc
from shoal.ops.triton import router as tri_router
from shoal.ops.triton.device import sm_count
from shoal.quant.fp8 import quant_fp8_weight

GEMM_SHAPES = {"wq_a|wkv": (1280 + 512, 5120), "wq_b": (32768, 1280), "wo_b": (5120, 8192),
               "shared_w13": (2304, 5120), "shared_w2": (5120, 2304)}
def measure_ceilings() -> None:
    global HBM, BF16_PEAK, FP8_PEAK
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench([lambda: dst.copy_(src)], rep=50)
    hbm = 2 * src.numel() / (ms * 1e-3)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf16 = 2 * n**3 / (bench([lambda: a @ b], rep=200) * 1e-3)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    fp8 = 2 * n**3 / (bench([lambda: torch._scaled_mm(a8, b8, one, one,
                                                      out_dtype=torch.bfloat16)],
                            rep=200) * 1e-3)
    log(f"ceilings measured: HBM {hbm / 1e12:.2f} TB/s, bf16 {bf16 / 1e12:.0f} TF/s, "
        f"fp8 {fp8 / 1e12:.0f} TF/s (design figures 4.24 / 760 / 1343; floors use the design "
        f"figures unless the measurement is higher)")
    HBM, BF16_PEAK, FP8_PEAK = max(HBM, hbm), max(BF16_PEAK, bf16), max(FP8_PEAK, fp8)


GEMM_MODES = {"promoted": tri_gemm.PROMOTED, "chained": tri_gemm.CHAINED}


def bench_gemm_fp8(ms_list: list[int]) -> None:
    """The folded-scale kernel in its two accumulation modes (promoted: the op's default,
    DeepGEMM-style fp32 promotion per BLOCK_K; chained: no promotion, reduced-precision adds
    along K), the op as the engine calls it (activation quantisation + the promoted kernel)
    and torch._scaled_mm with one per-tensor
    scale, on the same codes. The check rows give each mode's relative error against the reference op."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in GEMM_SHAPES.items():
        w = torch.randn(n, k, generator=gen, device="cuda") / k**0.5
        codes, scales = quant_fp8_weight(w)
        for spread in (False, True):  # spread: per-block activation scales over 2^-10 .. 2^10
            x = torch.randn(64, k, generator=gen, device="cuda")
            if spread:
                x = x * torch.exp2(torch.randint(-10, 11, (64, k // 32), generator=gen,
                                                 device="cuda").float()).repeat_interleave(32, 1)
            x = x.to(torch.bfloat16)
            ref = ref_gemm.gemm_fp8(x=x, weight=codes, weight_scale=scales)
            xq, prep = tact.act_quant(x, 32, fold=True), tri_gemm.prepare_fp8_weight(
                codes, scales)
            errs = ", ".join(f"{mode} {rel_err(tri_gemm.gemm_fp8_folded(*xq, prep, v), ref):.2e}"
                             for mode, v in GEMM_MODES.items())
            log(f"check gemm_fp8 {name} M=64{' spread' if spread else ''}: rel err {errs}")
        n_copies = copies(n * k)
        weights = [(codes, scales)] + [(codes.clone(), scales.clone())
                                       for _ in range(n_copies - 1)]
        prepared = [tri_gemm.prepare_fp8_weight(c, s) for c, s in weights]
        for m in ms_list:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            qf = [tact.act_quant(xi, 32, fold=True) for xi in xs]
            flops = 2.0 * m * n * k
            nbytes = m * k + n * k + 2 * m * n
            one = torch.ones((), device="cuda")
            mats = [(q[0], p.codes.t()) for q, p in zip(itertools.cycle(qf), prepared,
                                                         strict=False)]
            t_ref = bench([lambda a=a, b=b, one=one: torch._scaled_mm(
                a, b, one, one, out_dtype=torch.bfloat16) for a, b in mats])
            shape = f"{name} M{m}xN{n}xK{k}"
            for mode, v in GEMM_MODES.items():
                t = bench([lambda q=q, p=p, v=v: tri_gemm.gemm_fp8_folded(q[0], q[1], p, v)
                           for q, p in zip(itertools.cycle(qf), prepared, strict=False)])
                record(f"gemm_fp8 ({mode})", shape, t, flops, nbytes, FP8_PEAK,
                       vs_scaled_mm=round(t / t_ref, 3), scaled_mm_us=round(t_ref * 1e3, 1))
            # the default above is the persistent kernel
            if tri_pers.persistent_ok(m, n, k, sm_count(torch.device("cuda"))):
                t = bench([lambda q=q, p=p: tri_gemm.gemm_fp8_folded(q[0], q[1], p,
                                                                    persistent=False)
                           for q, p in zip(itertools.cycle(qf), prepared, strict=False)])
                record("gemm_fp8 (promoted, pointer kernel)", shape, t, flops, nbytes, FP8_PEAK,
                       vs_scaled_mm=round(t / t_ref, 3))
            cache = tri_gemm.PreparedCache()  # as the op table holds it: folded once
            t_op = bench([lambda xi=xi, w=w, c=cache: tri_gemm.gemm_fp8(
                x=xi, weight=w[0], weight_scale=w[1], state=c)
                          for xi, w in zip(itertools.cycle(xs), weights, strict=False)])
            record("gemm_fp8 (op: act_quant + promoted)", shape, t_op, flops, nbytes + m * k, FP8_PEAK,
                   vs_scaled_mm=round(t_op / t_ref, 3))


def bench_grouped(ts: list[int]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    g, r, k = 8, 1024, 4096
    w = torch.randn(g * r, k, generator=gen, device="cuda") / k**0.5
    codes, scales = quant_fp8_weight(w)
    o = torch.randn(64, g, k, device="cuda", dtype=torch.bfloat16)
    got = tri_grouped.gemm_grouped_w8a16(o=o, weight=codes, weight_scale=scales)
    ref = ref_gemm.gemm_grouped_w8a16(o=o, weight=codes, weight_scale=scales)
    log(f"check gemm_grouped_w8a16 T=64: rel err {rel_err(got, ref):.2e}")
    ws = [(codes.clone(), scales.clone()) for _ in range(copies(g * r * k))]
    for t in ts:
        os_ = [torch.randn(t, g, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        calls = [lambda oi=oi, wi=wi: tri_grouped.gemm_grouped_w8a16(
            o=oi, weight=wi[0], weight_scale=wi[1]) for oi, wi in
            zip(itertools.cycle(os_), ws, strict=False)]
        ms = bench(calls)
        record("gemm_grouped_w8a16", f"T{t}xG{g}xR{r}xK{k}", ms, 2.0 * t * g * r * k,
               t * g * k * 2 + g * r * k + t * g * r * 2, BF16_PEAK)


def index_inputs(t: int, n: int, n_req: int, rpb: int, gen=None) -> dict:
    """index_scores inputs: 32 heads x 128, paged 68-B records; tokens round-robin over
    n_req requests of n visible rows each (n_req = 1: one prefill chunk)."""
    from shoal.quant.records import pack_index_k_record

    dev = torch.device("cuda")
    nb = -(-n // rpb)
    table = torch.randperm(n_req * nb, device=dev, generator=gen).view(n_req, nb).int()
    cache = pack_index_k_record(torch.randn(n_req * nb * rpb, 128, device=dev, generator=gen))
    return dict(q=torch.randn(t, 32, 128, device=dev, generator=gen).to(torch.bfloat16),
                weights=torch.randn(t, 32, device=dev, generator=gen), k_cache=cache,
                block_table=table, req=torch.arange(t, device=dev) % n_req,
                n_visible=torch.full((t,), n, device=dev), num_rows=n, rows_per_block=rpb)


def bench_index(cases: list[tuple[int, int, int]]) -> None:
    """index_scores: decode (T tokens of T requests) and prefill (T tokens of one request),
    each tiling (tb tokens per program) checked against the reference, then timed."""
    from shoal.ops.reference import indexer as ref_ix
    from shoal.ops.triton import indexer as tri_ix

    gen = torch.Generator(device="cuda").manual_seed(3)
    for t, n, n_req in cases:
        rpb = 256
        kw = index_inputs(t, n, n_req, rpb, gen=gen)
        small = index_inputs(min(t, 64), min(n, 1024), min(n_req, 64), rpb, gen=gen)
        ref = ref_ix.index_scores(**small)
        # (tb, bn, warps); the op's default is bn 64 and 8 warps for every tb (batch invariance)
        tilings = ([(1, 64, 8), (1, 64, 4), (1, 128, 4)] if n_req > 1 else
                   [(32, 64, 8), (8, 64, 8)])
        for tb, bn, warps in tilings:
            got = tri_ix.index_scores_tuned(**small, tb=tb, bn=bn, num_warps=warps)
            err = float((got - ref).abs().max() / ref.abs().max())
            log(f"check index_scores tb={tb} bn={bn} w={warps} T{min(t, 64)} N{min(n, 1024)}: "
                f"rel max err {err:.2e}")
            nbytes = (t if n_req > 1 else 1) * n * 68 + t * n * 4 + t * 32 * 128 * 2
            flops = 2.0 * t * 32 * n * 128
            sets = [index_inputs(t, n, n_req, rpb, gen=gen) for _ in range(copies(nbytes))] \
                if n_req > 1 else [kw]
            ms = bench([lambda s=s, b=tb, c=bn, w=warps: tri_ix.index_scores_tuned(
                **s, tb=b, bn=c, num_warps=w) for s in sets])
            record(f"index_scores[tb{tb},bn{bn},w{warps}]", f"T{t}xN{n}x{n_req}req", ms, flops,
                   nbytes, BF16_PEAK)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[a.dtype.itemsize]
    return a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def bench_hc(ts: list[int]) -> None:
    """hc_coeffs at D = 5120 (Flash): split-K Triton vs the reference on the GPU (fp64)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    d = 5120
    fn = torch.randn(24, 4 * d, generator=gen, device="cuda") * 0.05
    scale = torch.rand(3, generator=gen, device="cuda") + 0.5
    base = torch.randn(24, generator=gen, device="cuda")
    consts = dict(scale=scale, base=base, norm_eps=1e-6, hc_eps=1e-6, iters=20)
    bk, iters, split = tri_hc.coeff_split(d)
    log(f"hc_coeffs D={d}: BK={bk} x {iters} iterations per chunk, SPLIT={split}")
    big = (torch.randn(max(ts), 4, d, generator=gen, device="cuda")).to(torch.bfloat16)
    full = tri_hc.hc_coeffs(stream=big, fn=fn, **consts)
    for t in ts:
        stream = big[:t].contiguous()
        got = tri_hc.hc_coeffs(stream=stream, fn=fn, **consts)
        ref = ref_hc.hc_coeffs(stream=stream[:256], fn=fn, **consts)
        err = max(float((g[:256] - r).abs().max()) for g, r in zip(got, ref, strict=True))
        inv = all(bits_equal(g, f[:t]) for g, f in zip(got, full, strict=True))
        nbytes = t * 4 * d * 2 + 24 * 4 * d * 4 + t * 24 * 4
        n_copies = copies(nbytes)
        sets = [(stream.clone(), fn.clone()) for _ in range(n_copies)]
        ms = bench([lambda s=s, f=f: tri_hc.hc_coeffs(stream=s, fn=f, **consts)
                    for s, f in sets])
        ms_ref = bench([lambda s=s, f=f: ref_hc.hc_coeffs(stream=s, fn=f, **consts)
                        for s, f in sets[:2]], warmup=5, rep=20)
        record("hc_coeffs", f"T{t}xD{d}", ms, 2.0 * t * 24 * 4 * d, nbytes, BF16_PEAK,
               ref_gpu_us=round(ms_ref * 1e3, 1), speedup=round(ms_ref / ms, 1),
               max_abs_err=f"{err:.1e}", rows_equal_big_T=inv)


HEAD_SHAPES = {  # name: (N, K, x dtype, out dtype)
    "lm_head": (129280, 5120, torch.bfloat16, torch.float32),
    "compressor wkv|wgate": (512, 5120, torch.float32, torch.float32),
    "ratio-1 wkv": (512, 5120, torch.bfloat16, torch.bfloat16),
    "indexer weights_proj": (32, 5120, torch.bfloat16, torch.bfloat16),
    "indexer wk": (128, 512, torch.bfloat16, torch.bfloat16),
    "dspark markov head": (129280, 256, torch.bfloat16, torch.float32),
}
PREFILL_M = 4096  # the small-N shapes also at a prefill-sized M
VARIANTS = [dict(block_n=128), dict(block_k=256), dict(block_n=128, block_k=64),
            dict(num_stages=3), dict(num_stages=6), dict(num_warps=8, block_n=128),
            dict(block_m=64), dict(block_m=64, block_n=128, num_warps=8)]


def bench_head(ms_list: list[int], sweep: bool) -> None:
    """lm_head and gemm_bf16 (Triton gemm_nt) vs the reference on the GPU (fp64 matmul_nt) and
    cuBLAS bf16 (speed only); rows of M=1 vs the largest M must be bit-identical."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    for name, (n, k, xd, od) in HEAD_SHAPES.items():
        cfg = tri_nt.nt_config(n, k)
        log(f"{name} [N={n}, K={k}] x {str(xd)[6:]} -> {str(od)[6:]}: {cfg}")
        w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)
        m_list = ms_list + ([PREFILL_M] if n < 100000 else [])
        xs = (torch.randn(max(m_list), k, generator=gen, device="cuda")).to(xd)
        full = tri_nt.gemm_nt(xs, w, od)
        ws = [w] + [w.clone() for _ in range(copies(n * k * 2) - 1)]
        for m in m_list:
            x = xs[:m].contiguous()
            got = tri_nt.gemm_nt(x, w, od)
            ref = ref_gemm.gemm_bf16(x=x, weight=w, out_dtype=od)
            inv = bits_equal(got, full[:m])
            nbytes = m * k * x.element_size() + n * k * 2 + m * n * got.element_size()
            ms = bench([lambda x=x, wi=wi, od=od: tri_nt.gemm_nt(x, wi, od) for wi in ws])
            extra = dict(rel_err=f"{rel_err(got, ref):.1e}", rows_equal_big_M=inv)
            if m in (1, 64) or (n < 100000 and m < PREFILL_M):
                ms_ref = bench([lambda x=x, w=w, od=od: ref_gemm.gemm_bf16(
                    x=x, weight=w, out_dtype=od)], warmup=3, rep=20)
                extra.update(ref_gpu_us=round(ms_ref * 1e3, 1), speedup=round(ms_ref / ms, 1))
            xb = x.to(torch.bfloat16)
            ms_cublas = bench([lambda xb=xb, wi=wi: torch.matmul(xb, wi.t()) for wi in ws])
            extra["cublas_bf16_us"] = round(ms_cublas * 1e3, 1)
            record("gemm_nt", f"{name} M{m}xN{n}xK{k}", ms, 2.0 * m * n * k, nbytes,
                   BF16_PEAK, **extra)
        if sweep and name == "lm_head":
            sweep_nt(xs, w, od, ws, ms_list, VARIANTS)
        if sweep and name == "compressor wkv|wgate":
            sweep_nt(xs, w, od, ws, [64, PREFILL_M], VARIANTS[-2:])



def sweep_nt(xs: torch.Tensor, w: torch.Tensor, od: torch.dtype, ws: list,
             ms_list: list[int], variants: list[dict]) -> None:
    """Alternative tiles: time, and whether the bits equal the default config's (block_m 64
    may switch the MMA instruction; the ops keep block_m 16 unless the bits are equal)."""
    n, k = w.shape
    base = tri_nt.nt_config(n, k)
    for v in variants:
        cfg = tri_nt.NTConfig(**{**base.__dict__, **v})  # chunk stays a multiple of BK
        for m in ms_list:
            x = xs[:m].contiguous()
            try:
                got = tri_nt.gemm_nt(x, w, od, config=cfg)
                same = bits_equal(got, tri_nt.gemm_nt(x, w, od))
                ms = bench([lambda x=x, wi=wi, cfg=cfg: tri_nt.gemm_nt(x, wi, od, config=cfg)
                            for wi in ws])
            except Exception as exc:  # a variant that fails to compile is reported, not fatal
                log(f"gemm_nt variant {v} M{m}: failed {type(exc).__name__}: {exc!s:.150}")
                continue
            nbytes = m * k * x.element_size() + n * k * 2 + m * n * 4
            record(f"gemm_nt{v}", f"M{m}xN{n}xK{k}", ms, 2.0 * m * n * k, nbytes, BF16_PEAK,
                   bits_equal_default=same)


def bench_router(ts: list[int]) -> None:
    """The MoE router at mini shapes (384 experts x 5120, bf16 x and gate, fp64 sums on FP64
    tensor cores, then the top-6 selection): the whole op per T, with the default and the wide
    logits tile (router.WIDE_TILE; a bit-equality check first). Its floor counts the bytes
    only: no FP64 ceiling is measured here (TF/s shows the fp64 rate; the first results file,
    2026-11-29g, divided the FLOPs by the bf16 peak)."""
    e, d = 384, 5120
    g = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(e, d, device="cuda", generator=g) / 64).to(torch.bfloat16)
    bias = torch.randn(e, device="cuda", generator=g) * 0.01
    for t in ts:
        x = torch.randn(t, d, device="cuda", generator=g).to(torch.bfloat16)
        base = tri_router.logit_partials(x, w)
        same = torch.equal(tri_router.logit_partials(x, w, tri_router.WIDE_TILE), base)
        log(f"check router[wide] T={t}: fp64 logit partials bit-equal to the default tile's: "
            f"{same}")
        same_mid = torch.equal(tri_router.logit_partials(x, w, tri_router.MID_TILE), base)
        log(f"check router[mid] T={t}: bit-equal: {same_mid}")
        for name, tile in (("router", tri_router.DEFAULT_TILE),
                           ("router[wide]", tri_router.WIDE_TILE),
                           ("router[mid]", tri_router.MID_TILE)):
            ms = bench([lambda x=x, tile=tile: tri_router.router_tiled(
                x, w, bias, 6, 1.5, tile=tile)])
            record(name, f"T{t}xE{e}xD{d}", ms, 2 * t * e * d, (e * d + t * d) * 2, math.inf)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--only", default="ceil,gemm,grouped,attn")
    args = ap.parse_args()
    only = set(args.only.split(","))
    props = torch.cuda.get_device_properties(0)
    log(f"GPU {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}")
    if "ceil" in only:
        measure_ceilings()
    if "gemm" in only:
        bench_gemm_fp8([1, 16, 4096] if args.quick else [1, 16, 4096, 8192])
    if "grouped" in only:
        bench_grouped([1, 64, 4096])
    attn = [x for x in only if x.split("=")[0] == "attn"]  # attn or attn=VARIANT+VARIANT
    if attn:
        names = attn[0].partition("=")[2]
        bench_attention([1, 16, 64, 256] if args.quick else [1, 16, 64, 256, 2048],
                        names.split("+") if names else None)
    if "index" in only:
        bench_index([(64, 16384, 64), (2048, 8192, 1)])
    if "hc" in only:
        bench_hc([1, 16, 64, 256, 4096])
    if "router" in only:
        bench_router([1, 16, 64, 256, 2048, 8192])
    if "head" in only:
        bench_head([1, 16, 64, 256], sweep=not args.quick)
    commit = git_commit()
    summary = {"bench": "ops", "commit": commit or "?", "gpu": props.name,
               "date": datetime.date.today().isoformat(),
               "ceilings": {"hbm": HBM, "bf16": BF16_PEAK, "fp8": FP8_PEAK}, "results": RESULTS}
    line = json.dumps(summary)
    print(line)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_ops_{summary['date']}.txt")
    with open(path, "w") as f:
        f.write("\n".join(LINES) + "\n" + line + "\n")


if __name__ == "__main__":
    main()
