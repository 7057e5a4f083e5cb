"""Batch-invariant MoE tiles (mini layer, sm_90): which tile pairs give a token the same bits as
the invariant 16-row mma.sync tiles (`moe_tiles.INVARIANT_DECODE`) and as each other, and what
each costs from decode to prefill sizes.

For every candidate (w13, w2) pair: the whole [T, D] output at T = 8192 compared bitwise with
the 16-row tiles' output on the same inputs ("= m16"), a token alone (T = 1) against the same
token inside the 8192-token call ("self-invariant"), and the median ms of the op (CUDA-graph
replays, bench_moe.bench) at each T with the floor fraction. A candidate may serve invariant mode
at some sizes only if it is "= m16" (or the mode switches family at no size).

Run: PYTHONPATH=src python3 benchmarks/bench_moe_invariant.py [--tokens 1,64,256,2048,8192]
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_moe import TOPK, E, floor_ms, log, realistic_weights, routing, time_calls

from shoal.bench import git_commit
from shoal.ops.triton import moe as tmoe
from shoal.ops.triton import moe_tiles as tiles

T = tiles.TileConfig
CANDIDATES = {
    "m16": tiles.INVARIANT_DECODE,
    "m32w2": (T(32, 64, 128, 2, 4, f16=True),) * 2,
    "m32w4": (T(32, 64, 128, 4, 4, f16=True),) * 2,
    "m32w4n128": (T(32, 128, 128, 4, 3, f16=True),) * 2,
    "m32w2n128": (T(32, 128, 128, 2, 3, f16=True),) * 2,
    "m32w8n256": (T(32, 256, 128, 8, 3, f16=True),) * 2,
    "m32w2k64s6": (T(32, 64, 64, 2, 6, f16=True),) * 2,
    "m32w2k64s8": (T(32, 64, 64, 2, 8, f16=True),) * 2,
    "m32w2n32k64s6": (T(32, 32, 64, 2, 6, f16=True),) * 2,
    "m32w4n128k64s6": (T(32, 128, 64, 4, 6, f16=True),) * 2,
    "m32w2k32s8": (T(32, 64, 32, 2, 8, f16=True),) * 2,
    "m16w2k64s6": (T(16, 64, 64, 2, 6, f16=True),) * 2,
    "m64w2n32": (T(64, 32, 128, 2, 3, f16=True),) * 2,
    "m64w2": (T(64, 64, 128, 2, 3, f16=True),) * 2,
    "m64w4_f16wg": (T(64, 64, 128, 4, 3, f16=True),) * 2,
    "m128w8_f16wg": (T(128, 64, 128, 8, 3, f16=True),) * 2,
    "wg128p": tiles.default_configs(8192 * TOPK, E),
    "wg64p": (T(64, 64, 256, 4, 3, promote=True, fused_gate_up=True),
              T(64, 64, 128, 4, 3, promote=True)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,64,256,2048,8192")
    ap.add_argument("--cands", default=",".join(CANDIDATES))
    args = ap.parse_args()
    dev = torch.device("cuda")
    w = realistic_weights(E, dev)
    big = routing(8192, E, 10, dev)
    names = args.cands.split(",")
    outs = {}
    for name in names:
        cfg = CANDIDATES[name]
        try:
            full = tmoe.moe_experts(**big, **w, configs=cfg)
            one = tmoe.moe_experts(**{k: v[:1] for k, v in big.items()}, **w, configs=cfg)
        except Exception as exc:  # a pair that fails to build is reported, not fatal
            log(f"{name:14s} failed: {type(exc).__name__}: {exc}"[:300])
            continue
        torch.cuda.synchronize()
        outs[name] = full
        same_m16 = "m16" in outs and torch.equal(full, outs["m16"])
        log(f"{name:14s} = m16: {same_m16}   self-invariant (T=1 vs row 0 of T=8192): "
            f"{torch.equal(one[0], full[0])}")
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        sets = [{k: v[:t] for k, v in routing(max(t, 1), E, 20 + i, dev).items()}
                for i in range(1 if t >= 1024 else 4)]
        fl, _, _ = floor_ms(t, sets[0]["ids"])
        row = {"T": t, "floor_ms": fl}
        for name in outs:
            cfg = CANDIDATES[name]
            ms = time_calls([(lambda s=s, cfg=cfg: tmoe.moe_experts(**s, **w, configs=cfg))
                             for s in sets])
            if ms is None:
                continue
            row[name] = ms
            log(f"T={t:5d} {name:14s} {ms:8.3f} ms  frac {fl / ms:.3f}")
        rows.append(row)
    log(json.dumps({"bench": "moe_invariant", "commit": git_commit(),
                    "gpu": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
