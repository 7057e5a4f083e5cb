"""Why did the folded Triton `gemm_fp8` and `moe_mxfp4` leave their references' tolerance in the
H200 in-situ check (benchmarks/results/in_situ_h200_2026-11-29.txt)? CPU emulation. (Since then
gemm_fp8 promotes every BLOCK_K product to fp32, which passes in situ: in_situ_h200_2026-11-29d.)

The model runs on dummy weights with the reference ops; every gemm_fp8 / moe_mxfp4 call is
recomputed on the same inputs in variants, otherwise exact (fp64 sums rounded as the reference
rounds), each compared with the op's output by its tolerance (|d| <= atol + rtol |ref|):

  exact     no change (a self-check: must equal the reference bit for bit)
  fold      the kernels' scale folding (triton/act_quant.py `_act_quant_kernel(FOLD=True)`,
            `prepare_fp8_weight`; triton/moe.py `_quant_folded` and the e2m1 -> e4m3 weight LUT):
            a 32-block of exponent e in a row whose largest is E becomes e4m3_RNE(v 2^(e - E)),
            one scale 2^(E - 127) per row; lossy where that falls into e4m3 subnormals. Which
            operand loses what: the table of codes changed by folding (activations: x, and h in
            the MoE; weights)
  fold+fp32 fold, and the K sum in fp32 steps of 32 (`chained`: another fp32 summation order,
            as mma.sync or a promoted wgmma accumulator gives)
  fold+fp22 fold, and the K sum by a model of sm_90 FP8 wgmma's chained accumulator (`chained`,
            13 mantissa bits; in the MoE where the kernel picks wgmma tiles, else as fold+fp32)
  ulp       MoE only: reference math with g and u moved one bf16 ulp (random direction) in a
            random fraction (--ulp-frac) of elements before the SwiGLU
MoE column `g/u chg`: the fraction of a variant's bf16 g and u that differ from the reference's
(they feed the FP8 re-quantisation of h).

Full mini needs ~50 GB of host memory and ~2.4 s per expert matrix to generate its dummy weights
here; `--shrink-mini E V` gives it E routed (and draft) experts and Engram vocabulary V, other
shapes unchanged (E = 8, V = 10000: ~6 GB). E changes the routed rows per expert, which pick the
MoE kernel's tiles.

    PYTHONPATH=src python benchmarks/fold_loss.py [--model tiny|mini] [--prompt N] [--steps S]
        [--ulp-frac 0.01] [--shrink-mini E V] [--seed 5]
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
OPS = {"gemm_fp8": ("x", "weight", "weight_scale"),
       "moe_mxfp4": ("x", "ids", "weights", "w13", "w13_scale", "w2", "w2_scale", "limit")}


class FoldStats:
    """Per operand kind: codes changed by folding, codes seen, largest spread E - e_b."""

    def __init__(self) -> None:
        self.changed, self.total, self.spread = (defaultdict(int) for _ in range(3))

    def as_dict(self) -> dict:
        return {k: {"changed": self.changed[k], "total": self.total[k], "max_spread":
                    self.spread[k], "frac": self.changed[k] / max(self.total[k], 1)}
                for k in sorted(self.total)}


def operand(values: torch.Tensor, exps: torch.Tensor, fold: bool, stats: FoldStats | None,
            kind: str) -> torch.Tensor:
    """values [R, K] (e4m3 or e2m1 values, fp32), biased block exponents exps [R, K/32] -> the
    fp32 operand values 2^(e_b - 127): exact, or folded as the kernels do."""
    k, exps = values.shape[1], exps.to(torch.int32)
    if not fold:
        return values * torch.exp2((exps - 127).float()).repeat_interleave(BLOCK, 1)[:, :k]
    top = exps.amax(dim=1, keepdim=True)
    f = torch.exp2((exps - top).clamp_min(-126).float()).repeat_interleave(BLOCK, 1)[:, :k]
    folded = (values * f).to(E4M3).float()
    if stats is not None:
        stats.changed[kind] += int((folded.double() != values.double() * f.double()).sum())
        stats.total[kind] += values.numel()
        if exps.numel():
            stats.spread[kind] = max(stats.spread[kind], int((top - exps).max()))
    return folded * torch.exp2((top - 127).float())  # the row / column scale 2^(E - 127)


def act(x: torch.Tensor, fold: bool, stats: FoldStats | None) -> torch.Tensor:
    codes, scales = quant_fp8_act(x, BLOCK)
    return operand(codes.float(), scales, fold, stats, "act")


def chained(a: torch.Tensor, w: torch.Tensor, bits: int | None) -> torch.Tensor:
    """fp32 a @ w^T summed over K in steps of 32 (one MMA each; the step's products add exactly):
    bits None: acc = fp32_RNE(acc + step); else a model of sm_90 FP8 wgmma chaining its
    accumulator over all of K (Triton's default there, max_num_imprecise_acc = 2^30, and what the
    folded GEMM and unpromoted MoE tiles do): acc = truncate(acc + step) to `bits` mantissa bits,
    the reported FP22 accumulator (SageAttention 2; DeepSeek-V3 report 3.5.2; DeepGEMM issues 37
    and 50). A model only: split-K partials (M <= 64) and in-step alignment are not modelled."""
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float64)
    for k0 in range(0, a.shape[1], 32):
        acc += a[:, k0:k0 + 32].double() @ w[:, k0:k0 + 32].double().t()
        if bits is None:
            acc = acc.float().double()
        else:
            m, e = torch.frexp(acc)
            acc = torch.ldexp(torch.trunc(m * 2.0 ** (bits + 1)), e - bits - 1)
    return acc.float()


def product(v: dict, wgmma: bool = True):
    """The K sum of variant `v`: the reference's fp64 (matmul_nt), fp32 steps, or FP22 steps."""
    if v["acc"] == "fp22" and wgmma:
        return lambda a, w: chained(a, w, 13)
    return matmul_nt if v["acc"] is None else lambda a, w: chained(a, w, None)


def gemm_fp8(x, weight, weight_scale, v: dict, gen=None, stats=None):
    """The reference gemm_fp8 (fp64 sums -> fp32 -> bf16), variant `v` -> (out, None)."""
    w = weight.view(E4M3) if weight.dtype == torch.uint8 else weight
    w_exps = weight_scale.repeat_interleave(BLOCK, 0)[: w.shape[0]]  # 32x32 blocks -> per row
    w_op = operand(w.float(), w_exps, v["fold"], stats, "weight")
    return product(v)(act(x, v["fold"], stats), w_op).to(torch.bfloat16), None


def bump(v: torch.Tensor, frac: float, gen: torch.Generator) -> torch.Tensor:
    """bf16 v with a random `frac` of its elements moved one ulp up or down."""
    pick = torch.rand(v.shape, generator=gen) < frac
    target = torch.where(torch.rand(v.shape, generator=gen) < 0.5, torch.inf, -torch.inf)
    return torch.where(pick, torch.nextafter(v, target.to(v.dtype)), v)


def moe_mxfp4(x, ids, weights, w13, w13_scale, w2, w2_scale, limit, v: dict, gen=None,
              stats=None):
    """The reference moe_mxfp4 step for step, variant `v` -> (out, bf16 g|u of every routed
    row). The kernel runs 128-row wgmma tiles above 40 routed rows per expert, else mma.sync."""
    t, d = x.shape
    out, gus = torch.zeros(t, d, dtype=torch.float32), []
    if t == 0:
        return out, None
    inter = w2.shape[2] * 2
    mm = product(v, wgmma=ids.numel() > 40 * w13.shape[0])
    xa = act(x, v["fold"], stats)

    def weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return operand(e2m1_decode(unpack_fp4(packed)), scale, v["fold"], stats, "weight")

    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        gu = mm(xa[tok], weight(w13[e], w13_scale[e])).to(torch.bfloat16)
        if v["ulp"]:
            gu = bump(gu, v["ulp"], gen)
        gus.append(gu)
        h = swiglu_clamp(gate=gu[:, :inter].float(), up=gu[:, inter:].float(),
                         weight=weights[tok, slot], limit=limit)
        y = mm(act(h, v["fold"], stats), weight(w2[e], w2_scale[e]))
        out[tok] += y.to(torch.bfloat16).float()  # = the reference's index_add_ (tok unique)
    return out, torch.cat(gus)


def variants(op: str, ulp_frac: float) -> dict[str, dict]:
    def v(fold=False, acc=None, ulp=0.0) -> dict:
        return {"fold": fold, "acc": acc, "ulp": ulp}

    out = {"exact": v(), "fold": v(True), "fold+fp32": v(True, "fp32"),
           "fold+fp22": v(True, "fp22")}
    return out | ({"ulp": v(ulp=ulp_frac)} if op == "moe_mxfp4" else {})


@dataclasses.dataclass
class Tally:
    """One op variant over its calls: elements over tolerance, largest differences."""

    calls: int = 0
    calls_over: int = 0
    over: int = 0
    most_over_in_call: int = 0
    total: int = 0
    not_bitwise_equal: int = 0
    gu_changed: int = 0  # MoE: bf16 g/u elements that differ from the reference's
    gu_total: int = 0
    max_diff: float = 0.0
    ref_at_max: float = 0.0
    over_calls: list[str] = dataclasses.field(default_factory=list)  # "call#: shapes: over"
    worst_excess: float | None = None  # max of |d| - limit: the element compare.py reports
    diff_at_worst: float = 0.0
    ref_at_worst: float = 0.0

    def add(self, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float,
            label: str) -> None:
        g, w = got.double().flatten(), want.double().flatten()
        d = (g - w).abs()
        excess = d - (atol + rtol * w.abs())
        over = int((excess > 0).sum())
        self.calls, self.total = self.calls + 1, self.total + d.numel()
        self.over, self.calls_over = self.over + over, self.calls_over + (over > 0)
        self.most_over_in_call = max(self.most_over_in_call, over)
        if over:
            self.over_calls.append(f"{label}: {over}")
        self.not_bitwise_equal += int((g != w).sum())
        if d.numel():
            i, j = int(d.argmax()), int(excess.argmax())
            if float(d[i]) > self.max_diff:
                self.max_diff, self.ref_at_max = float(d[i]), float(w[i])
            if self.worst_excess is None or float(excess[j]) > self.worst_excess:
                self.worst_excess, self.diff_at_worst, self.ref_at_worst = (
                    float(excess[j]), float(d[j]), float(w[j]))


def intercept(table: OpTable, tallies: dict, stats: dict, gen: torch.Generator,
              ulp_frac: float) -> OpTable:
    """`table` with gemm_fp8 and moe_mxfp4 wrapped: the op runs (the model goes on with its
    result), then every variant is computed on the same inputs and tallied against it."""
    fns = dict(table.fns)

    def wrap(op: str, emulate):
        def call(**kw):
            want = table.fns[op](**kw)
            tol = REGISTRY.ops[op].tolerances[want.dtype]
            label = (f"#{tallies[op]['exact'].calls} x{list(kw['x'].shape)} -> "
                     f"{list(want.shape)}")
            gu_ref = None
            for name, v in variants(op, ulp_frac).items():
                got, gu = emulate(*(kw[k] for k in OPS[op]), v, gen,
                                  stats[op] if name == "fold" else None)
                tally = tallies[op][name]
                tally.add(got, want, tol.atol, tol.rtol, label)
                gu_ref = gu if name == "exact" else gu_ref
                if gu is not None:
                    tally.gu_changed += int((gu != gu_ref).sum())
                    tally.gu_total += gu.numel()
            return want
        return call

    fns["gemm_fp8"], fns["moe_mxfp4"] = wrap("gemm_fp8", gemm_fp8), wrap("moe_mxfp4", moe_mxfp4)
    return OpTable(fns, dict(table.origin), table.requested, table.declined)


def shrunk_mini(experts: int, engram_vocab: int):
    c = PRESETS["mini"]
    primes = engram_primes(len(c.engram_layer_ids), c.engram_max_ngram_size, c.engram_n_heads,
                           engram_vocab)
    return dataclasses.replace(c, n_routed_experts=experts, dspark_n_routed_experts=experts,
                               engram_vocab_size=engram_vocab,
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


def report(title: str, tallies: dict, stats: dict) -> None:
    head = (f"{'op':9s} {'variant':9s} {'calls':>5s} {'c.over':>6s} {'over':>5s} {'/call':>5s} "
            f"{'of':>8s} {'!=bits':>7s} {'max|d|':>7s} {'ref@max':>7s} {'worst|d|':>8s} "
            f"{'ref@wrst':>8s} {'g/u chg':>8s}")
    print(f"{title}\n\n{head}\n{'-' * len(head)}")
    for op, vs in tallies.items():
        for name, t in vs.items():
            worst = f"{t.diff_at_worst:8.3g} {t.ref_at_worst:8.3g}" if t.over else f"{'-':>8s} " * 2
            gu = f"{t.gu_changed / t.gu_total:8.2e}" if t.gu_total else f"{'-':>8s}"
            print(f"{op:9.9s} {name:9s} {t.calls:5d} {t.calls_over:6d} {t.over:5d} "
                  f"{t.most_over_in_call:5d} {t.total:8d} {t.not_bitwise_equal:7d} "
                  f"{t.max_diff:7.3g} {t.ref_at_max:7.3g} {worst.rstrip()} {gu}")
    print("\nc.over: calls with an element over tolerance; /call: the most in one call; of: "
          "elements compared;\n!=bits: elements not bitwise equal; worst: the element of largest"
          " |d| - (atol + rtol |ref|) (the one\ncompare.py reports), where some are over; g/u chg:"
          " fraction of the MoE's bf16 g and u that differ\n")
    for op, vs in tallies.items():
        for name, t in vs.items():
            if t.over_calls:
                more = f" (+{len(t.over_calls) - 8} more)" if len(t.over_calls) > 8 else ""
                print(f"{op} {name}: calls over (call #: x -> out: elements over): "
                      f"{'; '.join(t.over_calls[:8])}{more}")
    print(f"\n{'op':9s} {'operand':7s} {'codes changed by fold':>21s} {'of':>10s} "
          f"{'fraction':>9s} {'max E - e_b':>11s}")
    for op, s in stats.items():
        for kind, r in s.as_dict().items():
            print(f"{op:9.9s} {kind:7s} {r['changed']:21d} {r['total']:10d} {r['frac']:9.3g} "
                  f"{r['max_spread']:11d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "mini"])
    ap.add_argument("--prompt", type=int, default=None, help="default 200 (tiny), 120 (mini)")
    ap.add_argument("--steps", type=int, default=0, help="greedy decode steps after prefill")
    ap.add_argument("--seed", type=int, default=5, help="prompt and perturbation seed")
    ap.add_argument("--ulp-frac", type=float, default=0.01, help="g/u fraction moved (ulp)")
    ap.add_argument("--shrink-mini", type=int, nargs=2, metavar=("E", "V"),
                    help="mini with E routed experts and Engram vocabulary V")
    args = ap.parse_args()
    n_prompt = args.prompt or (200 if args.model == "tiny" else 120)
    config = shrunk_mini(*args.shrink_mini) if args.shrink_mini else PRESETS[args.model]
    tallies = {op: {v: Tally() for v in variants(op, args.ulp_frac)} for op in OPS}
    stats = {op: FoldStats() for op in OPS}
    table = intercept(resolve_ops("cpu"), tallies, stats, torch.Generator().manual_seed(args.seed),
                      args.ulp_frac)
    t0 = time.time()
    run_model(config, table, n_prompt, args.steps, args.seed)
    shrunk = (" shrunk to {} routed experts, Engram vocabulary {}".format(*args.shrink_mini)
              if args.shrink_mini else "")
    report(f"{args.model}{shrunk}: prompt {n_prompt}, {args.steps} decode steps, seed "
           f"{args.seed}, ulp variant on {args.ulp_frac:.2%} of g/u; {time.time() - t0:.0f} s",
           tallies, stats)
    print(json.dumps({"model": args.model, "shrink_mini": args.shrink_mini, "prompt": n_prompt,
                      "steps": args.steps, "seed": args.seed, "ulp_frac": args.ulp_frac,
                      "ops": {op: {v: dataclasses.asdict(t) for v, t in vs.items()}
                              for op, vs in tallies.items()},
                      "fold": {op: s.as_dict() for op, s in stats.items()}}))


if __name__ == "__main__":
    main()
