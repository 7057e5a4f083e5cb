"""Where do CUDA-graph decode steps and plain eager steps part? (diagnosis, CUDA only)

Runs one greedy workload three times on the same model preset with dummy weights:
  eager   - cuda_graphs=False (plain eager steps, batch = live requests);
  static  - the graphs' static padded batch (padded size, context bound) run eagerly;
  graphs  - CUDA graph replay.
Prints which pairs differ in tokens / logprobs, and for eager vs static the first op call whose
output differs on the real rows (a hash of the overlapping region of every op's outputs).

    python3 scripts/diag_graphs.py --model mini
"""

from __future__ import annotations

import argparse
import gc

import torch

from shoal import LLM, SamplingParams
from shoal.bench import random_prompt


def _region_hash(t: torch.Tensor, rows: int) -> tuple:
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return ("scalar", float(t) if isinstance(t, torch.Tensor) else repr(t))
    r = t[:rows].contiguous()
    b = r.view(torch.uint8).flatten().long() if r.dtype != torch.bool else r.flatten().long()
    w = torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 1000003 + 1
    return (tuple(t.shape[1:]), int((b * w).sum()))


class Recorder:
    def __init__(self, llm: LLM) -> None:
        model = llm.engine.runner.model
        self.calls: list[list[tuple]] = []  # per forward: (op, output hashes) per op call
        self.real = 0  # rows of the current forward that belong to requests
        self.pending = 0  # set by the graphs' forward: its step's row count (before padding)
        forward = model.forward

        def fwd(batch, caches, **kw):
            self.calls.append([])
            self.real = self.pending or int(batch.input_ids.shape[0])
            return forward(batch, caches, **kw)

        model.forward = fwd
        graphs = llm.engine.runner.graphs
        if graphs is not None:  # static path: the real rows are the step's, not the padding
            gforward = graphs.forward

            def gfwd(batch):
                self.pending = int(batch.input_ids.shape[0])
                try:
                    return gforward(batch)
                finally:
                    self.pending = 0

            graphs.forward = gfwd
        ops = model.ops
        for name, fn in list(ops.fns.items()):
            ops.fns[name] = self._wrap(name, fn)

    def _wrap(self, name, fn):
        def call(**kw):
            out = fn(**kw)
            if self.calls:
                outs = out if isinstance(out, tuple) else (out,)
                self.calls[-1].append((name, [_region_hash(o, self.real) for o in outs]))
            return out
        return call


def _llm(model: str, graphs: bool) -> LLM:
    return LLM(model, device="cuda", load_format="dummy", cuda_graphs=graphs,
               kv_cache_memory_gb=2.0, max_num_seqs=6, max_model_len=1100)


def _run(llm: LLM, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=5)
              for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [sorted((t, v.logprob) for t, v in e.items()) for e in o.outputs[0].logprobs])
            for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mini")
    args = ap.parse_args()
    lengths, max_tokens = (5, 700, 33, 1, 260), (12, 9, 3, 12, 6)
    results, records = {}, {}
    for mode in ("eager", "static", "graphs"):
        llm = _llm(args.model, graphs=mode != "eager")
        if mode == "static":
            llm.engine.runner.graphs.use_graphs = False
            llm.engine.runner.graphs._graphs.clear()
        g = torch.Generator().manual_seed(5)
        prompts = [random_prompt(llm.config.model_config, n, g) for n in lengths]
        rec = None
        if mode != "graphs":
            rec = Recorder(llm)
        results[mode] = _run(llm, prompts, max_tokens)
        records[mode] = rec
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for a, b in (("eager", "static"), ("eager", "graphs"), ("static", "graphs")):
        same_tok = all(x[0] == y[0] for x, y in zip(results[a], results[b], strict=True))
        same_lp = all(x[1] == y[1] for x, y in zip(results[a], results[b], strict=True))
        print(f"{a} vs {b}: tokens {'same' if same_tok else 'DIFFER'}, "
              f"logprobs {'same' if same_lp else 'DIFFER'}")
        if not same_lp:
            for i, (x, y) in enumerate(zip(results[a], results[b], strict=True)):
                if x != y:
                    j = next(j for j, (p, q) in enumerate(zip(x[1], y[1], strict=False)) if p != q)
                    print(f"  request {i}: first logprob difference at output token {j}: "
                          f"{x[1][j][:2]} vs {y[1][j][:2]}")
    ea, st = records["eager"].calls, records["static"].calls
    print(f"forwards recorded: eager {len(ea)}, static {len(st)}")
    for s, (ca, cb) in enumerate(zip(ea, st, strict=False)):
        for c, (x, y) in enumerate(zip(ca, cb, strict=False)):
            if x[0] != y[0]:
                print(f"forward {s} call {c}: op order differs ({x[0]} vs {y[0]})")
                return 0
            for o, (hx, hy) in enumerate(zip(x[1], y[1], strict=False)):
                if hx[0] == hy[0] and hx != hy:
                    print(f"first differing output: forward {s} call {c} op {x[0]} output {o} "
                          f"(trailing shape {hx[0]})")
                    return 0
    print("no op output differs on the overlapping real rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
