"""Fold loss on CPU: how far the Triton kernels' folded FP8 scales alone move `gemm_fp8` and
`moe_mxfp4` from their references, and how far a 1-ulp bf16 change of the MoE's g/u does.

The Triton GEMM (ops/triton/gemm.py) and MoE (ops/triton/moe.py) fold the per-32 UE8M0 block
scales into one scale per row: a block of exponent e in a row whose largest is E is re-encoded
as e4m3(v * 2^(e - E)) (RNE), lossy where that drops into e4m3 subnormals. Here the model runs
on dummy weights with the reference ops; every gemm_fp8 / moe_mxfp4 call is intercepted and
recomputed on the same inputs, otherwise exactly (fp64 sums rounded as the reference rounds):

  exact     the harness with no fold (must equal the reference bit for bit: a self-check)
  fold      activations (x; and h in the MoE) and weights folded as the kernels do
  fold_act  activations folded only          fold_w  weights folded only
  ulp       MoE only: reference math, g and u moved by one bf16 ulp (random direction) in a
            random 1% of elements before the SwiGLU (FP8 re-quantisation flips of h)

Each is compared with the op's output by the op's tolerance (|d| <= atol + rtol |ref|, as
ops/compare.py). `--shrink-mini` replaces mini's 384 routed experts and 2 x 24M-row Engram
tables by smaller ones (same shapes elsewhere) so that it fits in ~10 GB; full mini needs ~50 GB.

    PYTHONPATH=src python benchmarks/fold_loss.py [--model tiny|mini] [--prompt N] [--steps S]
                                                  [--shrink-mini] [--seed 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import defaultdict

import torch

from shoal.checkpoint.writer import generate_weights
from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.config import engram_primes
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams
from shoal.model.presets import PRESETS
from shoal.model.state import KVCaches
from shoal.ops.reference._math import matmul_nt
from shoal.ops.reference.moe import swiglu_clamp
from shoal.ops.registry import REGISTRY, OpTable, resolve_ops
from shoal.quant.fp4 import e2m1_decode, unpack_fp4
from shoal.quant.fp8 import quant_fp8_act

E4M3, BLOCK = torch.float8_e4m3fn, 32
VARIANTS = {"gemm_fp8": ("exact", "fold", "fold_act", "fold_w"),
            "moe_mxfp4": ("exact", "fold", "fold_act", "fold_w", "ulp")}


class FoldStats:
    """Codes changed by folding and the largest block-exponent spread E_max - e_b, per kind."""

    def __init__(self) -> None:
        self.changed: dict[str, int] = defaultdict(int)
        self.total: dict[str, int] = defaultdict(int)
        self.spread: dict[str, int] = defaultdict(int)

    def as_dict(self) -> dict:
        return {k: {"changed": self.changed[k], "total": self.total[k],
                    "frac": self.changed[k] / max(self.total[k], 1),
                    "max_spread": self.spread[k]} for k in sorted(self.total)}


def operand(values: torch.Tensor, exps: torch.Tensor, fold: bool, stats: FoldStats | None = None,
            kind: str = "") -> torch.Tensor:
    """values [R, K] (e4m3 or e2m1 values as fp32) with biased block exponents exps [R, KB] ->
    the fp32 operand: values * 2^(e_b - 127) exactly, or folded as the kernels do
    (e4m3_RNE(values * 2^(e_b - E)) * 2^(E - 127), E = the row's largest e_b)."""
    k = values.shape[1]
    exps = exps.to(torch.int32)
    if not fold:
        return values * torch.exp2((exps - 127).float()).repeat_interleave(BLOCK, 1)[:, :k]
    top = exps.amax(dim=1, keepdim=True)
    shift = (exps - top).clamp_min(-126)
    f = torch.exp2(shift.float()).repeat_interleave(BLOCK, 1)[:, :k]
    folded = (values * f).to(E4M3).float()
    if stats is not None:
        stats.changed[kind] += int((folded.double() != values.double() * f.double()).sum())
        stats.total[kind] += values.numel()
        if exps.numel():
            stats.spread[kind] = max(stats.spread[kind], int((top - exps).max()))
    # col scale of the kernels: 2^(E - 127) (the MoE's bit trick reads E = 0 as 0: no such rows)
    return folded * torch.exp2((top - 127).float())


def act(x: torch.Tensor, fold: bool, stats: FoldStats | None, kind: str) -> torch.Tensor:
    codes, scales = quant_fp8_act(x, BLOCK)
    return operand(codes.float(), scales, fold, stats, kind)


def gemm_fp8(x, weight, weight_scale, fold_a: bool, fold_w: bool, stats=None) -> torch.Tensor:
    """The reference gemm_fp8 (fp64 sums -> fp32 -> bf16) on optionally folded operands."""
    w = weight.view(E4M3) if weight.dtype == torch.uint8 else weight
    w_exps = weight_scale.repeat_interleave(BLOCK, 0)[: w.shape[0]]  # 32x32 blocks -> per row
    a = act(x, fold_a, stats, "act")
    return matmul_nt(a, operand(w.float(), w_exps, fold_w, stats, "weight")).to(torch.bfloat16)


def bump(v: torch.Tensor, frac: float, gen: torch.Generator) -> torch.Tensor:
    """bf16 v with a random `frac` of its elements moved one ulp up or down."""
    pick = torch.rand(v.shape, generator=gen) < frac
    up = torch.rand(v.shape, generator=gen) < 0.5
    target = torch.where(up, torch.inf, -torch.inf).to(v.dtype)
    return torch.where(pick, torch.nextafter(v, target), v)


def moe_mxfp4(x, ids, weights, w13, w13_scale, w2, w2_scale, limit, fold_a: bool, fold_w: bool,
              ulp_frac: float = 0.0, gen: torch.Generator | None = None, stats=None):
    """The reference moe_mxfp4, step for step, with optional folds and g/u perturbation."""
    t, d = x.shape
    out = torch.zeros(t, d, dtype=torch.float32)
    if t == 0:
        return out
    inter = w2.shape[2] * 2
    xa = act(x, fold_a, stats, "act")
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        w13_e = operand(e2m1_decode(unpack_fp4(w13[e])), w13_scale[e], fold_w, stats, "weight")
        gu = matmul_nt(xa[tok], w13_e).to(torch.bfloat16)
        if ulp_frac:
            gu = bump(gu, ulp_frac, gen)
        gu = gu.float()
        h = swiglu_clamp(gate=gu[:, :inter], up=gu[:, inter:], weight=weights[tok, slot],
                         limit=limit)
        w2_e = operand(e2m1_decode(unpack_fp4(w2[e])), w2_scale[e], fold_w, stats, "weight")
        y = matmul_nt(act(h, fold_a, stats, "act"), w2_e)
        out.index_add_(0, tok, y.to(torch.bfloat16).float())
    return out


@dataclasses.dataclass
class Tally:
    """Elements over tolerance and the worst differences of one op variant, over its calls."""

    calls: int = 0
    calls_over: int = 0
    over: int = 0
    total: int = 0
    bitwise_diff: int = 0
    max_diff: float = 0.0
    ref_at_max: float = 0.0
    worst_excess: float = -float("inf")  # max of |d| - limit (compare.py's "worst")
    diff_at_worst: float = 0.0
    ref_at_worst: float = 0.0

    def add(self, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
        g, w = got.double().flatten(), want.double().flatten()
        d = (g - w).abs()
        lim = atol + rtol * w.abs()
        over = int((d > lim).sum())
        self.calls, self.total = self.calls + 1, self.total + d.numel()
        self.over, self.calls_over = self.over + over, self.calls_over + (over > 0)
        self.bitwise_diff += int((g != w).sum())
        if d.numel() == 0:
            return
        i = int(d.argmax())
        if float(d[i]) > self.max_diff:
            self.max_diff, self.ref_at_max = float(d[i]), float(w[i])
        j = int((d - lim).argmax())
        if float(d[j] - lim[j]) > self.worst_excess:
            self.worst_excess = float(d[j] - lim[j])
            self.diff_at_worst, self.ref_at_worst = float(d[j]), float(w[j])


def intercept(table: OpTable, tallies: dict, stats: dict, gen: torch.Generator,
              ulp_frac: float) -> OpTable:
    """`table` with gemm_fp8 and moe_mxfp4 wrapped: the op runs, then every variant is tallied
    against its output (the model goes on with the op's own result)."""
    fns = dict(table.fns)

    def gemm_call(**kw):
        want = table.fns["gemm_fp8"](**kw)
        tol = REGISTRY.ops["gemm_fp8"].tolerances[want.dtype]
        args = (kw["x"], kw["weight"], kw["weight_scale"])
        folds = {"exact": (False, False), "fold": (True, True), "fold_act": (True, False),
                 "fold_w": (False, True)}
        for name, (fa, fw) in folds.items():
            got = gemm_fp8(*args, fa, fw, stats["gemm_fp8"] if name == "fold" else None)
            tallies["gemm_fp8"][name].add(got, want, tol.atol, tol.rtol)
        return want

    def moe_call(**kw):
        want = table.fns["moe_mxfp4"](**kw)
        tol = REGISTRY.ops["moe_mxfp4"].tolerances[want.dtype]
        args = [kw[k] for k in ("x", "ids", "weights", "w13", "w13_scale", "w2", "w2_scale",
                                "limit")]
        runs = {"exact": (False, False, 0.0), "fold": (True, True, 0.0),
                "fold_act": (True, False, 0.0), "fold_w": (False, True, 0.0),
                "ulp": (False, False, ulp_frac)}
        for name, (fa, fw, frac) in runs.items():
            got = moe_mxfp4(*args, fa, fw, frac, gen, stats["moe_mxfp4"] if name == "fold" else None)
            tallies["moe_mxfp4"][name].add(got, want, tol.atol, tol.rtol)
        return want

    fns["gemm_fp8"], fns["moe_mxfp4"] = gemm_call, moe_call
    return OpTable(fns, dict(table.origin), table.requested, table.declined)


def shrunk_mini(experts: int, engram_vocab: int):
    c = PRESETS["mini"]
    primes = engram_primes(len(c.engram_layer_ids), c.engram_max_ngram_size, c.engram_n_heads,
                           engram_vocab)
    return dataclasses.replace(c, n_routed_experts=experts, engram_vocab_size=engram_vocab,
                               engram_num_embeddings=tuple(sum(map(sum, p)) for p in primes))


def run_model(config, table: OpTable, n_prompt: int, steps: int, seed: int) -> None:
    """Prefill a random prompt, then `steps` greedy decode steps (as scripts/bisect_ops.py)."""
    params = ModelParams.load(config, generate_weights(config, seed=0, device="cpu"), "cpu")
    model = DeepseekV41(config, params, table, token_map_for(config))
    caches = KVCaches.allocate(config, num_blocks=8, num_slots=2, max_tokens=1024,
                               block_size=128, device="cpu")
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(3, config.vocab_size, (n_prompt,), generator=g).tolist()
    for i in range(steps + 1):
        start = 0 if i == 0 else len(seq) - 1
        chunk = RequestChunk.from_sequence(seq, start, len(seq) - start, 1, (1, 2, 3, 4), n_prompt)
        batch = build_forward_batch(config, [chunk], device="cpu", prefill_mode="full")
        seq.append(int(model.forward(batch, caches).logits[-1].float().argmax()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "mini"])
    ap.add_argument("--prompt", type=int, default=None, help="default 200 (tiny), 120 (mini)")
    ap.add_argument("--steps", type=int, default=0, help="greedy decode steps after prefill")
    ap.add_argument("--seed", type=int, default=5, help="prompt and perturbation seed")
    ap.add_argument("--ulp-frac", type=float, default=0.01,
                    help="fraction of g/u elements moved by one ulp in the ulp variant")
    ap.add_argument("--shrink-mini", type=int, nargs=2, metavar=("EXPERTS", "ENGRAM_VOCAB"),
                    help="mini with fewer routed experts and a smaller Engram vocabulary")
    args = ap.parse_args()
    n_prompt = args.prompt or (200 if args.model == "tiny" else 120)
    config = shrunk_mini(*args.shrink_mini) if args.shrink_mini else PRESETS[args.model]
    tallies = {op: {v: Tally() for v in vs} for op, vs in VARIANTS.items()}
    stats = {op: FoldStats() for op in VARIANTS}
    gen = torch.Generator().manual_seed(args.seed)
    table = intercept(resolve_ops("cpu"), tallies, stats, gen, args.ulp_frac)
    t0 = time.time()
    run_model(config, table, n_prompt, args.steps, args.seed)
    shrunk = (" shrunk to {} routed experts, engram vocab {}".format(*args.shrink_mini)
              if args.shrink_mini else "")
    print(f"{args.model}{shrunk}: prompt {n_prompt}, {args.steps} "
          f"decode steps, ulp variant on {args.ulp_frac:.2%} of g/u, {time.time() - t0:.0f} s\n")
    head = (f"{'op':10s} {'variant':8s} {'calls':>5s} {'c.over':>6s} {'over':>6s} {'total':>10s} "
            f"{'!=bits':>9s} {'max|d|':>9s} {'ref@max':>9s} {'worst|d|':>9s} {'ref@worst':>9s}")
    print(head + "\n" + "-" * len(head))
    for op, vs in tallies.items():
        for v, t in vs.items():
            worst = (f"{t.diff_at_worst:9.3g} {t.ref_at_worst:9.3g}" if t.over else
                     f"{'-':>9s} {'-':>9s}")
            print(f"{op:10.10s} {v:8s} {t.calls:5d} {t.calls_over:6d} {t.over:6d} {t.total:10d} "
                  f"{t.bitwise_diff:9d} {t.max_diff:9.3g} {t.ref_at_max:9.3g} {worst}")
    print("\n(c.over: calls with any element over tolerance; !=bits: elements not bitwise equal;"
          " worst: max of |d| - (atol + rtol|ref|), the element compare.py reports)\n")
    print(f"{'op':10s} {'operand':7s} {'changed':>10s} {'total':>12s} {'fraction':>10s} "
          f"{'max spread':>10s}")
    for op, s in stats.items():
        for kind, r in s.as_dict().items():
            print(f"{op:10.10s} {kind:7s} {r['changed']:10d} {r['total']:12d} {r['frac']:10.3g} "
                  f"{r['max_spread']:10d}")
    print(json.dumps({"model": args.model, "shrink_mini": args.shrink_mini, "prompt": n_prompt,
                      "steps": args.steps, "seed": args.seed, "ulp_frac": args.ulp_frac,
                      "ops": {op: {v: dataclasses.asdict(t) for v, t in vs.items()}
                              for op, vs in tallies.items()},
                      "fold": {op: s.as_dict() for op, s in stats.items()}}))


if __name__ == "__main__":
    main()
