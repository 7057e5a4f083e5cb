"""Which fast ops move shoal's layers off the official reference (CUDA): the teacher-forced
layer comparison of tests/model/test_official_layers.py for one fixture case, with every op
on the reference, every op fast, and each op alone fast (the rest on the reference, through
SHOAL_REFERENCE_OPS). One summary line per configuration: non-bitwise rows, the worst row's
relative error, pre_mix, discrete mismatches (no near-tie).

    PYTHONPATH=src:tests python3 scripts/official_layers_bisect.py [--case tiny-modulo-map]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import pytest

from model import test_official_layers as t
from shoal.ops.registry import REGISTRY, resolve_ops


def run(case: dict, reference: list[str], device: str) -> str:
    os.environ["SHOAL_REFERENCE_OPS"] = ",".join(reference)
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        report = t.measure(t.teacher_forced(case, Path(tmp), mp, device=device))
    return t.summary(report)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="tiny-modulo-map")
    ap.add_argument("--ops", nargs="*", default=None, help="ops to try alone (default: all fast)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    case = next(c for c in t.FIXTURE["cases"] if c["name"] == args.case)
    os.environ.pop("SHOAL_REFERENCE_OPS", None)
    table = resolve_ops(args.device)
    names = sorted(REGISTRY.ops)
    fast = [n for n in names if table.origin.get(n) != "reference"] if args.ops is None \
        else args.ops
    print(f"{args.case}: fast ops {fast}", flush=True)
    print(f"all reference: {run(case, names, args.device)}", flush=True)
    print(f"all fast: {run(case, [], args.device)}", flush=True)
    for op in fast:
        print(f"only {op} fast: {run(case, [n for n in names if n != op], args.device)}",
              flush=True)


if __name__ == "__main__":
    main()
