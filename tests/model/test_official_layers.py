"""shoal against the official DeepSeek-V4.1 reference, teacher-forced layer by layer.

tests/data/official_goldens.safetensors (written by scripts/official_goldens.py beside the JSON)
holds, per case, the reference's residual stream [hc, D] bf16 and pre_mix [hc] fp32 at the input
of every backbone layer after the first and after the last one, for every prompt row (one
prefill) and each of 16 decode steps fed the reference's own greedy tokens; its routed expert
ids, index top-k rows and candidate mask with their top-k score gaps; and the top-5 log-probs
of the head on its final stream.

shoal's model (the real `DeepseekV41.forward` over explicit caches, the CPU reference ops)
runs the same steps with one test-side wrapper around `mhc_block`: after a layer's block it
records shoal's output and hands the next layer the reference's recorded input instead. Every
layer, Engram included, thus sees the reference's input, and the state later rows read (SWA
rings, compressed KV, index keys, candidates) is built from it. Per layer and case:

- the output stream equals the reference's next input bit for bit on all but
  `MAX_NONBITWISE_FRACTION` of the rows, and no row's relative L2 error exceeds `MAX_ROW_REL`;
  pre_mix within `MAX_PRE_ABS`;
- routed expert sets, index top-k sets and candidate masks equal the reference's, except on
  rows whose reference top-k gap is a near-tie (0 < gap <= the `*_TIE` bounds; exact ties are
  broken lowest index first on both sides and must agree);
- the head's log-probs of the reference's top-5 tokens, from the reference's final stream, are
  within `HEAD_TOLERANCE`.

Why per layer: end to end, the reference is chaotic against itself on these checkpoints (see
test_official_goldens.py); a layer fed the exact input is not, so a bound at rounding level
separates semantics from noise (the bounds below sit a few times above what the reference ops
give). Each of the semantic mutations in `MUTATIONS` fails the checks (test_mutations_are_caught
runs two of them). On CUDA (sm_90) the same runs on the fast ops (Triton where implemented),
the FP8 GEMM in its official-rounding variant (`BACKENDS`), with the same bounds
(`ROW_BOUNDS`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import tokenizers
import torch
from safetensors.torch import load_file

import shoal.model.deepseek_v41 as dsv
from shoal.checkpoint.reader import CheckpointReader
from shoal.checkpoint.writer import write_checkpoint
from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams
from shoal.model.presets import TINY
from shoal.model.state import KVCaches
from shoal.ops.registry import resolve_ops

DATA = Path(__file__).parents[1] / "data"
FIXTURE = json.loads((DATA / "official_goldens.json").read_text())
TENSORS = load_file(str(DATA / "official_goldens.safetensors"))

# Bounds; in comments the worst of the four cases with the CPU reference ops:
MAX_NONBITWISE_FRACTION = 0.15  # measured <= 4/56 = 0.071
MAX_ROW_REL = 5e-2  # measured <= 1.33e-2 (one e4m3 step is 6-12 % of an element)
MAX_PRE_ABS = 1e-3  # measured <= 5.7e-5 (pre_mix is fp32, O(1))
ROUTER_TIE = 1e-3  # reference gaps go down to 2.8e-5 (all matched); scores are O(0.1-1)
INDEX_TIE = 2e-3  # bf16 index scores: one ulp of a 0.1-1 score is 2^-11 - 2^-8
HEAD_TOLERANCE = 1e-3  # measured <= 1e-6
BLOCK_SIZE = 128  # the smallest KV page the tiny layouts allow; the 152-row case crosses one
ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs CUDA sm_90")])]

# On CUDA the fast ops with the FP8 GEMM that keeps the official kernel's rounding points
# (ops/triton/gemm_exact.py). The default `triton` GEMM folds scales and promotes every 128 K:
# within its op tolerance, but a flipped bf16 ulp re-quantises differently downstream and moves
# discrete choices, which these per-layer bounds see (scripts/gemm_fp8_in_situ.py measures it).
BACKENDS = {"cuda": ["triton_exact", "triton", "reference"]}
# The per-row bounds hold on both: on CUDA with these backends (H200 2026-12-05, session 33)
# at most 10/152 rows of a layer not bitwise, worst row 1.2e-2 relative, pre_mix <= 1.4e-4,
# no discrete choice off, head <= 4.4e-4 (benchmarks/results/session33_h200_2026-12-05.txt).
ROW_BOUNDS = {"cpu": True, "cuda": True}

Mutation = Callable[[pytest.MonkeyPatch, dict], None]


def case_tensors(name: str) -> dict[str, torch.Tensor]:
    return {k.split("/", 1)[1]: v for k, v in TENSORS.items() if k.startswith(name + "/")}


def build_model(case: dict, tmp_path: Path, wrap_ops=None, device: str = "cpu",
                backends: list[str] | None = None) -> DeepseekV41:
    """The case's checkpoint written again and loaded by path (config.json and tokenizer.json
    as the reference reads them), over the op table of `backends` (default: the device's
    comparison backends, `BACKENDS`; `wrap_ops(fns)` may replace some ops)."""
    over = {k: tuple(v) if isinstance(v, list) else v for k, v in case["overrides"].items()}
    config = dataclasses.replace(TINY, name=case["name"], **over)
    ckpt = write_checkpoint(config, tmp_path / case["name"], seed=case["seed"])
    with CheckpointReader(ckpt) as reader:
        cfg = reader.config
        params = ModelParams.load(cfg, ((n, reader.get(n)) for n in reader.names()), device)
    token_map = token_map_for(cfg, tokenizers.Tokenizer.from_file(
        str(ckpt / "tokenizer.json"))) if cfg.engram_layer_ids else None
    ops = resolve_ops(device, backends or BACKENDS.get(device))
    if wrap_ops is not None:
        ops = dataclasses.replace(ops, fns=wrap_ops(dict(ops.fns)))
    return DeepseekV41(cfg, params, ops, token_map)


def teacher_forced(case: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   mutate: Mutation | None = None, device: str = "cpu",
                   backends: list[str] | None = None) -> dict:
    """Run the case's prefill and 16 decode steps through shoal, each layer fed the reference's
    recorded input. Returns per layer the output stream / pre_mix over every row, the discrete
    choices per (op, layer) in call order, and the log-probs of every row."""
    ref = case_tensors(case["name"])
    forced_in = {k: ref[k].to(device) for k in ("stream", "pre")}
    current = {"layer": 0}
    choices: dict[tuple[str, int], list] = {}

    def wrap_ops(fns: dict) -> dict:
        for name in ("router", "topk_rows", "candidate_mask"):
            def recorded(fn=fns[name], name=name, **kw):
                out = fn(**kw)
                kept = tuple(t.cpu() for t in out) if isinstance(out, tuple) else out.cpu()
                choices.setdefault((name, current["layer"]), []).append(kept)
                return out
            fns[name] = recorded
        if mutate is not None:
            mutate(monkeypatch, fns)
        return fns

    model = build_model(case, tmp_path, wrap_ops, device, backends)
    cfg = model.config
    prompt, tokens = case["prompt"], case["decode_tokens"]
    ids, n = prompt + tokens, len(prompt)
    outs: dict[str, list[list[torch.Tensor]]] = {"stream": [[] for _ in cfg.backbone],
                                                 "pre": [[] for _ in cfg.backbone]}
    block, rows = dsv.mhc_block, {}

    def forced(ctx, prefix, stream, pre_prev, *args, **kwargs):
        layer = current["layer"] = int(prefix.split(".")[1])
        out, pre_f = block(ctx, prefix, stream, pre_prev, *args, **kwargs)
        outs["stream"][layer].append(out.cpu())
        outs["pre"][layer].append(pre_f.cpu())
        return forced_in["stream"][layer, rows["now"]], forced_in["pre"][layer, rows["now"]]

    monkeypatch.setattr(dsv, "mhc_block", forced)
    caches = KVCaches.allocate(cfg, num_blocks=8, num_slots=2, max_tokens=n,
                               block_size=BLOCK_SIZE, device=device)
    blocks = (5, 2, 7)[: -(-len(ids) // BLOCK_SIZE)]  # out of order: the block table is read
    logits = []
    for start, num in [(0, n)] + [(n + s, 1) for s in range(len(tokens))]:
        rows["now"] = slice(start, start + num)
        batch = build_forward_batch(cfg, [RequestChunk.from_sequence(
            ids, start, num, 1, blocks, n, "all")], device=device, prefill_mode="full")
        logits.append(model.forward(batch, caches).logits.cpu())
    return {"config": cfg, "ref": ref, "choices": choices,
            "stream": [torch.cat(v) for v in outs["stream"]],
            "pre": [torch.cat(v) for v in outs["pre"]],
            "logprobs": torch.log_softmax(torch.cat(logits).double(), dim=-1)}


def _set_mismatch(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """Rows whose sets differ ([R, k] each, order and -1 padding as produced)."""
    return (ours.long().sort(-1).values != theirs.long().sort(-1).values).any(-1)


def _unexplained(mismatch: torch.Tensor, gap: torch.Tensor, tie: float) -> int:
    """Mismatched rows that are no near-tie (exact ties must agree: both break them low first)."""
    return int((mismatch & ~((gap > 0) & (gap <= tie))).sum())


def measure(run: dict) -> dict:
    """Per layer: rows, non-bitwise rows, worst row relative L2 error, worst pre_mix error,
    unexplained discrete mismatches (router, top-k, candidates); the head's worst error."""
    cfg, ref, choices = run["config"], run["ref"], run["choices"]
    layers = []
    for spec in cfg.backbone:
        layer = spec.layer_id
        ours, theirs = run["stream"][layer].float(), ref["stream"][layer].float()
        diff = (ours - theirs).flatten(1)
        rel = diff.norm(dim=-1) / theirs.flatten(1).norm(dim=-1)
        entry = {"layer": layer, "rows": diff.shape[0],
                 "nonbitwise": int((diff != 0).any(-1).sum()), "worst_rel": float(rel.max()),
                 "pre_abs": float((run["pre"][layer] - ref["pre"][layer]).abs().max())}
        experts = torch.cat([ids for ids, _ in choices[("router", layer)]])
        entry["router"] = _unexplained(_set_mismatch(experts, ref["experts"][layer]),
                                       ref["expert_gap"][layer], ROUTER_TIE)
        if f"topk.{layer}" in ref:
            top = torch.cat(choices[("topk_rows", layer)])
            entry["topk"] = _unexplained(_set_mismatch(top, ref[f"topk.{layer}"]),
                                         ref[f"topk_gap.{layer}"], INDEX_TIE)
        if layer == cfg.candidate_source_layer:
            masks = choices[("candidate_mask", layer)]
            want = ref["candidates"]
            ours_mask = torch.zeros_like(want)
            row = 0
            for m in masks:
                ours_mask[row:row + m.shape[0], :m.shape[1]] = m[:, :want.shape[1]]
                row += m.shape[0]
            entry["candidates"] = int((ours_mask != want).any(-1).sum())
        layers.append(entry)
    head = (run["logprobs"].gather(1, ref["top_ids"].long())
            - ref["top_logprobs"].double()).abs().max()
    return {"layers": layers, "head": float(head)}


def failures(report: dict, rows: bool = True) -> list[str]:
    """The checks of the module docstring, as readable failures (rows=False: without the two
    per-row bounds, see `ROW_BOUNDS`)."""
    bad = []
    for e in report["layers"]:
        where = f"layer {e['layer']}"
        if rows and e["nonbitwise"] > MAX_NONBITWISE_FRACTION * e["rows"]:
            bad.append(f"{where}: {e['nonbitwise']}/{e['rows']} rows not bitwise")
        if rows and e["worst_rel"] > MAX_ROW_REL:
            bad.append(f"{where}: a row off by {e['worst_rel']:.2e} relative")
        if e["pre_abs"] > MAX_PRE_ABS:
            bad.append(f"{where}: pre_mix off by {e['pre_abs']:.2e}")
        for key in ("router", "topk", "candidates"):
            if e.get(key):
                bad.append(f"{where}: {e[key]} rows of other {key} choices (no near-tie)")
    if report["head"] > HEAD_TOLERANCE:
        bad.append(f"head: log-probs off by {report['head']:.2e}")
    return bad


def summary(report: dict) -> str:
    ls = report["layers"]
    return (f"non-bitwise rows per layer <= {max(e['nonbitwise'] for e in ls)}/{ls[0]['rows']}, "
            f"worst row {max(e['worst_rel'] for e in ls):.2e}, pre_mix "
            f"{max(e['pre_abs'] for e in ls):.1e}, discrete mismatches "
            f"{sum(e.get(k, 0) for e in ls for k in ('router', 'topk', 'candidates'))}, "
            f"head {report['head']:.1e}")


# ------------------------------------------------------------------------ semantic mutations


def _no_sink(mp: pytest.MonkeyPatch, fns: dict) -> None:
    attn = fns["sparse_attn_sink"]
    fns["sparse_attn_sink"] = lambda sink, **kw: attn(sink=torch.full_like(sink, -torch.inf), **kw)


def _skip_engram(mp: pytest.MonkeyPatch, fns: dict) -> None:
    mp.setattr(dsv, "engram", lambda ctx, layer, stream, rows: stream)


def _biased_weights(mp: pytest.MonkeyPatch, fns: dict) -> None:
    router = fns["router"]

    def biased(x, weight, bias, k, route_scale, gate_temp=1.0):
        ids, _ = router(x=x, weight=weight, bias=bias, k=k, route_scale=route_scale,
                        gate_temp=gate_temp)
        s = torch.nn.functional.softplus(x.float() @ weight.float().T / gate_temp).sqrt() + bias
        w = s.gather(1, ids)
        return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * route_scale
    fns["router"] = biased


def _window(delta: int) -> Mutation:
    def mutate(mp: pytest.MonkeyPatch, fns: dict) -> None:
        swa = fns["swa_indices"]
        fns["swa_indices"] = lambda window, **kw: swa(window=window + delta, **kw)
    return mutate


def _visible(delta: int) -> Mutation:
    def mutate(mp: pytest.MonkeyPatch, fns: dict) -> None:
        from shoal.model.context import StepContext, select

        def n_visible(self, ratio, rows):
            return ((select(self.batch.positions, rows) + 1 + delta) // ratio).clamp_min(0)
        mp.setattr(StepContext, "n_visible", n_visible)
    return mutate


def _rope_last_of_group(mp: pytest.MonkeyPatch, fns: dict) -> None:
    import shoal.model.attention as attention

    compressor, rope = attention.run_compressor, fns["rope_tail"]

    def shifted(ctx, spec, x, rows):  # compressed rows roped at their group's last token
        fns["rope_tail"] = lambda positions, **kw: rope(
            positions=positions + spec.compress_ratio - 1, **kw)
        try:
            compressor(ctx, spec, x, rows)
        finally:
            fns["rope_tail"] = rope
    mp.setattr(attention, "run_compressor", shifted)


def _no_candidate_filter(mp: pytest.MonkeyPatch, fns: dict) -> None:
    fns["mask_logits"] = lambda logits, mask: logits


def _ties_high_first(mp: pytest.MonkeyPatch, fns: dict) -> None:
    topk = fns["topk_rows"]

    def flipped(logits, n_visible, k):  # the same top-k with exact ties broken high first
        base, width = topk(logits=logits, n_visible=n_visible, k=k), logits.shape[-1]
        if width < k:
            return base
        vals, idx = torch.sort(logits.flip(-1), dim=-1, descending=True, stable=True)
        big = torch.iinfo(torch.int64).max
        idx = torch.where(vals[:, :k] > -torch.inf, width - 1 - idx[:, :k], big).sort(-1).values
        idx = torch.where(idx == big, -1, idx).to(torch.int32)
        return torch.where((n_visible <= k).unsqueeze(1), base, idx)
    fns["topk_rows"] = flipped


def _blocks_per_pool(mp: pytest.MonkeyPatch, fns: dict) -> None:
    """The attention's online softmax over each pool's own blocks (SWA blocks, then compressed
    ones) instead of blocks of the concatenated list: the SWA list padded to whole blocks with
    empty indices (which add nothing) moves the compressed rows into blocks of their own."""
    attn = fns["sparse_attn_sink"]

    def per_pool(swa_idx, **kw):
        pad = -swa_idx.shape[1] % 64
        return attn(swa_idx=torch.nn.functional.pad(swa_idx, (0, pad), value=-1), **kw)
    fns["sparse_attn_sink"] = per_pool


def _sinkhorn(iterations: int) -> Mutation:
    def mutate(mp: pytest.MonkeyPatch, fns: dict) -> None:
        coeffs = fns["hc_coeffs"]
        fns["hc_coeffs"] = lambda iters, **kw: coeffs(iters=iterations, **kw)
    return mutate


MUTATIONS: dict[str, Mutation] = {
    "no-attention-sink": _no_sink, "skip-engram": _skip_engram,
    "biased-routing-weights": _biased_weights, "swa-window-minus-1": _window(-1),
    "swa-window-plus-1": _window(1), "compressed-visible-plus-1": _visible(1),
    "compressed-visible-minus-1": _visible(-1), "compressed-rope-last-of-group":
    _rope_last_of_group, "no-candidate-filter": _no_candidate_filter,
    "index-ties-high-first": _ties_high_first, "sinkhorn-3-iterations": _sinkhorn(3),
    "attention-blocks-per-pool": _blocks_per_pool,
}

CASES = [pytest.param(c, id=c["name"]) for c in FIXTURE["cases"]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_layers_match_official_reference(case: dict, device: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    report = measure(teacher_forced(case, tmp_path, monkeypatch, device=device))
    print(f"{case['name']} ({device}): {summary(report)}")
    bad = failures(report, rows=ROW_BOUNDS[device])
    assert not bad, bad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mutation", ["no-attention-sink", "swa-window-minus-1"])
def test_mutations_are_caught(mutation: str, device: str, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks reject a semantic change (the smallest case; all of MUTATIONS fail them on
    every case where they apply, see the module docstring), on CUDA without the row bounds."""
    case = next(c for c in FIXTURE["cases"] if c["name"] == "tiny-modulo-map")
    report = measure(teacher_forced(case, tmp_path, monkeypatch, MUTATIONS[mutation],
                                    device=device))
    assert failures(report, rows=ROW_BOUNDS[device]), summary(report)
