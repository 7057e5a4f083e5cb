"""Which fast ops give a row other bits when other rows share the call? Each op runs at the real
mini/Flash shapes (probe_triton_ops.py's inputs at T = 256; the GEMMs at the T after '@'): all
rows, then the first r rows alone; those rows must match bitwise. Ops with index lists or
padded logits also run with the widths padded (empty -1 compressed columns, -inf logits), as
in a batch whose widest row is wider. Backends in the batch_invariant order (triton_invariant first).

    PYTHONPATH=src python3 scripts/probe_row_invariance.py [OP ...]   # 'SAME op' / 'DIFF op ...'
"""

from __future__ import annotations

import sys

import torch
from probe_triton_ops import inputs

from shoal.ops.reference._cases import fp8_weight
from shoal.ops.registry import REGISTRY, load_backends

# The arguments that carry one entry per token (sliced together); the rest are shared.
ROW_ARGS = {
    "sparse_attn_sink": ("q", "swa_idx", "comp_idx"),
    "index_scores": ("q", "weights", "req", "n_visible"),
    "topk_rows": ("logits", "n_visible"), "candidate_mask": ("logits", "n_visible"),
    "index_q_quant": ("q",), "rope_tail": ("x", "positions"), "rmsnorm": ("x",),
    "hc_coeffs": ("stream",), "hc_collapse_norm": ("stream", "pre"),
    "hc_post": ("y", "stream", "post", "comb"), "router": ("x",),
    "moe_mxfp4": ("x", "ids", "weights"), "act_quant_fp8": ("x",), "gemm_fp8": ("x",),
    "gemm_grouped_w8a16": ("o",), "gemm_bf16": ("x",),
}
PROBES = ("sparse_attn_sink", "index_scores@decode", "index_scores@prefill", "index_scores@odd",
          "topk_rows", "candidate_mask", "index_q_quant", "rope_tail", "rmsnorm", "hc_coeffs",
          "hc_collapse_norm", "hc_post", "router", "moe_mxfp4", "act_quant_fp8",
          "gemm_fp8@1024", "gemm_fp8@8192", "gemm_grouped_w8a16@256", "gemm_bf16@1024")


def gemm_inputs(op: str, t: int, g: torch.Generator) -> dict:
    if op == "gemm_grouped_w8a16":  # wo_a: 8 groups of 4096 -> 1024
        w, s = fp8_weight(g, 8 * 1024, 4096, "cuda")
        return dict(o=torch.randn(t, 8, 4096, generator=g).to(torch.bfloat16).cuda(), weight=w,
                    weight_scale=s, block=32)
    x = torch.randn(t, 5120, generator=g).to(torch.bfloat16).cuda()
    if op == "gemm_bf16":
        return dict(x=x, weight=(torch.randn(4096, 5120, generator=g) / 64).to(
            torch.bfloat16).cuda())
    w, s = fp8_weight(g, 4096, 5120, "cuda")  # wq_b-like N, a K that splits at decode sizes
    return dict(x=x, weight=w, weight_scale=s, block=32)


def padded(op: str, kw: dict) -> dict | None:
    """The same rows with wider index lists / logits, as a wider batch would give them."""
    if op == "sparse_attn_sink":  # (the SWA list is always `window` wide)
        comp = kw["comp_idx"]
        return {**kw, "comp_idx": torch.cat([comp, torch.full((comp.shape[0], 64), -1,
                                                              dtype=comp.dtype,
                                                              device=comp.device)], 1)}
    if op in ("topk_rows", "candidate_mask"):
        lg = kw["logits"]
        return {**kw, "logits": torch.cat([lg, torch.full((lg.shape[0], 1000), -torch.inf,
                                                          device=lg.device)], 1)}
    return None


def call(fn, kw: dict):
    kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = fn(**kw)
    if out is None:  # in place on its first row argument
        return (kw[next(iter(kw))],)
    return out if isinstance(out, tuple) else (out,)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


def probe(spec: str) -> str:
    op, _, variant = spec.partition("@")
    impl = REGISTRY.impl("triton_invariant", op) or REGISTRY.impl("triton", op)
    g = torch.Generator().manual_seed(0)
    kw = gemm_inputs(op, int(variant), g) if op.startswith("gemm") else inputs(spec, g)
    rows = ROW_ARGS[op]
    t = kw[rows[0]].shape[0]
    full = call(impl.fn, kw)
    diffs = []
    for r in sorted({1, 3, 64, 65, t // 2} - {t}):
        part = call(impl.fn, {k: (v[:r] if k in rows else v) for k, v in kw.items()})
        if not all(same(a[:r], b) for a, b in zip(full, part, strict=True)):
            diffs.append(f"rows {r} of {t}")
    wide = padded(op, kw)
    if wide is not None:
        got = call(impl.fn, wide)
        if not all(same(a, b[tuple(slice(0, n) for n in a.shape)])
                   for a, b in zip(full, got, strict=True)):
            diffs.append("padded width")
    torch.cuda.synchronize()
    return f"SAME {spec}" if not diffs else f"DIFF {spec}: {', '.join(diffs)}"


def main() -> None:
    load_backends()
    for spec in sys.argv[1:] or PROBES:
        try:
            print(probe(spec), flush=True)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next op
            print(f"FAIL {spec}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
