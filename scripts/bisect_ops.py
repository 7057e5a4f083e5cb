"""Which Triton op makes a model's logits leave the reference's? Runs the model (dummy weights)
on a prompt, prefill then greedy decode steps, once with reference ops only, once with every
fast op, then once per op with only that op fast and once with all fast but that op. Prints the
largest logit difference of each run relative to the reference logits' largest magnitude.
With random weights these differences measure the model's sensitivity as much as the kernels
(see ops/shadow.py); --shadow instead checks every fast op call in situ against the reference.

    PYTHONPATH=src python3 scripts/bisect_ops.py [--model tiny] [--prompt 60] [--steps 8]
                                                 [--shadow]
"""

from __future__ import annotations

import argparse

import torch

from shoal.checkpoint.writer import generate_weights
from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams
from shoal.model.presets import PRESETS
from shoal.model.state import KVCaches
from shoal.ops.registry import REFERENCE, REGISTRY, load_backends
from shoal.ops.shadow import ShadowLog, shadow_table


def logits_of(config, params, table, seq: list[int], n_prompt: int, steps: int, mode: str,
              device: str) -> tuple[torch.Tensor, list[int]]:
    """Logits of the prefill's last row and of `steps` decode steps. Tokens past `seq` are the
    run's own greedy picks; a run given the reference's `seq` is teacher-forced by it."""
    model = DeepseekV41(config, params, table, token_map_for(config))
    caches = KVCaches.allocate(config, num_blocks=8, num_slots=2, max_tokens=1024,
                               block_size=128, device=device)
    seq, out = list(seq), []
    for i in range(steps + 1):
        start = 0 if i == 0 else n_prompt + i - 1
        chunk = RequestChunk.from_sequence(seq, start, n_prompt + i - start, 1, (1, 2, 3, 4),
                                           n_prompt)
        batch = build_forward_batch(config, [chunk], device=device, prefill_mode=mode)
        out.append(model.forward(batch, caches).logits[-1].float().cpu())
        if len(seq) == n_prompt + i:
            seq.append(int(out[-1].argmax()))
    return torch.stack(out), seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--prompt", type=int, default=60)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--mode", default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shadow", action="store_true", help="in-situ op checks only")
    args = ap.parse_args()
    load_backends()
    config = PRESETS[args.model]
    params = ModelParams.load(config, generate_weights(config, seed=0, device=args.device),
                               args.device)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, config.vocab_size, (args.prompt,), generator=g).tolist()
    ops = sorted(REGISTRY.ops)
    if args.shadow:
        log = ShadowLog()
        table = shadow_table(REGISTRY.resolve(["triton", REFERENCE]), log)
        logits_of(config, params, table, prompt, len(prompt), args.steps, args.mode, args.device)
        for name, n in sorted(log.calls.items()):
            print(f"{name:20s} {n:5d} calls  {'MISMATCH' if name in log.failed_ops() else 'ok'}")
        print("\n".join(log.mismatches) or "no mismatches")
        return
    ref, seq = logits_of(config, params, REGISTRY.resolve([REFERENCE]), prompt, len(prompt),
                         args.steps, args.mode, args.device)
    scale = float(ref.abs().max())
    fast_ops = [n for n in ops if REGISTRY.impl("triton", n) is not None]

    def run(forced: list[str], label: str) -> None:
        table = REGISTRY.resolve(["triton", REFERENCE], forced)
        got, _ = logits_of(config, params, table, seq, len(prompt), args.steps, args.mode,
                           args.device)
        worst = (got - ref).abs().max(dim=-1).values / scale  # per step
        declined = ",".join(f"{k}x{v}" for k, v in sorted(table.declined.items())) or "-"
        print(f"{label:28s} max {float(worst.max()):.2e}  prefill {float(worst[0]):.2e}  "
              f"declined {declined}", flush=True)

    print(f"{args.model}: prompt {args.prompt}, {args.steps} decode steps, mode {args.mode}, "
          f"reference |logit| max {scale:.3f}")
    run([], "all fast")
    for name in fast_ops:
        run([n for n in ops if n != name], f"only {name}")
    for name in fast_ops:
        run([name], f"all but {name}")


if __name__ == "__main__":
    main()
