"""Output tokens/s per GPU against the per-rank batch, one line per `shoal bench
--expert-parallel` run (e.g. 4 and 8 GPUs, Engram on the device and in host memory), from the
JSON line each run prints last.

    python benchmarks/plot_ep.py ep_x4.txt ep_x8.txt [--out bench_ep_tok_s.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def last_json(path: Path) -> dict:
    for line in reversed(path.read_text().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"{path}: no JSON line (did the bench finish?)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", default="bench_ep_tok_s.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for path in args.runs:
        run = last_json(path)
        rows = [d for d in run["decode"] if "error" not in d]
        world = rows[0]["world"] if rows else "?"
        label = f"{run['model']}, {world} GPUs, Engram {run['engram_placement']}"
        plt.plot([d["batch"] for d in rows], [d["tokens_per_s_per_gpu"] for d in rows], "o-",
                 label=label)
        plt.plot([d["batch"] for d in rows], [d["batch"] / (d["floor_ms"] * 1e-3) for d in rows],
                 "--", alpha=0.5, label=f"{label}: floor")
        for d in rows:
            print(f"{path.name}: batch {d['batch']} per rank, {d['tokens_per_s_per_gpu']:.0f} "
                  f"tok/s per GPU, {d['fraction_of_floor']:.3f} of the floor")
    plt.xscale("log", base=2)
    plt.yscale("log")
    plt.xlabel("batch per GPU")
    plt.ylabel("output tokens/s per GPU")
    plt.legend(fontsize=7)
    plt.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
