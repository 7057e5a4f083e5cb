"""Prefix-cache hits of data-parallel replicas placed by load alone against prefix affinity
(`parallel/prefix_affinity.py`): F families of prompts sharing a prefix, R requests each, in a
shuffled order, over `--dp` replicas with prefix caching; prints the hit tokens of each
placement against the ideal (every family computed once), and checks the outputs are one
engine's. Counts, not timings: the CPU gives the same numbers as a GPU.

    python benchmarks/bench_prefix_affinity.py [--model tiny] [--dp 2] [--families 8]
        [--per-family 3] [--prefix 200] [--device cpu]
"""

from __future__ import annotations

import argparse
import random

from shoal import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--families", type=int, default=8)
    p.add_argument("--per-family", type=int, default=3)
    p.add_argument("--prefix", type=int, default=200, help="shared prefix tokens")
    p.add_argument("--tail", type=int, default=20, help="tokens of each prompt's own tail")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args()
    rng = random.Random(args.seed)
    prefixes = [[rng.randint(3, 500) for _ in range(args.prefix)] for _ in range(args.families)]
    order = [f for f in range(args.families) for _ in range(args.per_family)]
    rng.shuffle(order)
    prompts = [prefixes[f] + [rng.randint(3, 500) for _ in range(args.tail)] for f in order]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    opts = {"device": args.device, "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.prefix + args.tail + 8, "block_size": args.block_size,
            "prefill_mode": "full", "enable_prefix_caching": True}
    shared = args.prefix // args.block_size * args.block_size
    ideal = shared * (len(prompts) - args.families)
    outputs = {}
    print(f"{args.model}, {args.dp} replicas, {args.families} families x {args.per_family} "
          f"requests (shuffled), {shared} shared tokens each; ideal hit tokens {ideal}")
    for placement in ("load", "affinity"):
        llm = LLM(args.model, data_parallel_size=args.dp, **opts)
        if placement == "load":
            llm.replicas.affinity = None
        try:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            stats = llm.replicas.stats()[1]
            served = [llm.replicas.served_by[i] for i in range(len(prompts))]
        finally:
            llm.close()
        outputs[placement] = [o.outputs[0].token_ids for o in outs]
        spread = sum(len({served[i] for i in range(len(prompts)) if order[i] == f})
                     for f in range(args.families)) / args.families
        print(f"{placement:9s} hit tokens {stats.hit_tokens:6d} of {stats.query_tokens} "
              f"queried ({stats.hit_tokens / ideal:.0%} of ideal); replicas per family "
              f"{spread:.2f}; per replica {[served.count(r) for r in range(args.dp)]}")
    print("outputs equal:", outputs["load"] == outputs["affinity"])


if __name__ == "__main__":
    main()
