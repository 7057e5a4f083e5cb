"""The torch work a decode forward does outside the op table (the "glue": step metadata, casts,
index arithmetic). On a GPU each such op is a kernel launch of its own (about 1.5 us, and it cuts
the chain of programmatic dependent launches), so it stays on a budget: a tiny decode step ran 52
torch ops outside the ops that are not views or no-op casts on 2026-12-01 (session 14): the step
metadata of model/context.py (about half, once per step), the indexer weights' scale and cast
(model/indexer.py, 2 per indexer layer), the compressor's cast and row positions
(model/compressor.py); 49 since the first block's pre_prev is an expanded constant (it was a
zeros and a fill per step). A change that adds glue must raise the budget on purpose; one that
removes glue should lower it.
"""

from __future__ import annotations

import collections
import traceback

from torch.utils._python_dispatch import TorchDispatchMode

from shoal import LLM, SamplingParams

GLUE_BUDGET = 49
VIEWS = {"view", "_unsafe_view", "slice", "select", "expand", "unsqueeze", "squeeze",
         "as_strided", "t", "transpose", "permute", "alias", "detach", "split", "unbind",
         "narrow", "_reshape_alias", "split_with_sizes"}  # no data moves


class _Glue(TorchDispatchMode):
    """Counts the non-view aten ops dispatched while `active` and no op-table call is running,
    keyed by op and the shoal source line that issued them."""

    def __init__(self) -> None:
        super().__init__()
        self.in_op = 0
        self.active = False
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        out = func(*args, **(kwargs or {}))
        if name == "to" and out is args[0]:  # already that dtype / device: nothing runs
            return out
        if self.active and not self.in_op and name not in VIEWS:
            frames = [f for f in traceback.extract_stack() if "/shoal/" in f.filename]
            where = (f"{frames[-1].filename.split('/shoal/')[-1]}:{frames[-1].lineno}"
                     if frames else "?")
            self.sites[f"{name} at {where}"] += 1
        return out


def test_a_decode_step_stays_within_its_glue_budget() -> None:
    llm = LLM("tiny", device="cpu")
    model = llm.engine.runner.model
    glue = _Glue()

    def counted(fn):
        def call(*args, **kwargs):
            glue.in_op += 1
            try:
                return fn(*args, **kwargs)
            finally:
                glue.in_op -= 1
        return call

    model.ops.fns.update({name: counted(fn) for name, fn in model.ops.fns.items()})
    forward, steps = model.forward, []

    def watched(batch, caches, capture=False):
        decode = batch.num_tokens == batch.num_requests and steps  # after the prefill
        steps.append(batch.num_tokens)
        if decode and not glue.sites:
            glue.active = True
            try:
                with glue:
                    return forward(batch, caches, capture)
            finally:
                glue.active = False
        return forward(batch, caches, capture)

    model.forward = watched
    llm.generate(["hello world", "abc"], SamplingParams(max_tokens=4, temperature=0.0),
                 use_tqdm=False)
    total = sum(glue.sites.values())
    assert total > 0, f"no decode step was counted (steps {steps})"
    report = "\n".join(f"{n:3d} {site}" for site, n in glue.sites.most_common())
    assert total <= GLUE_BUDGET, f"{total} glue ops outside the op table:\n{report}"
