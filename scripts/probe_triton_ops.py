"""Run one Triton op at the real mini/Flash shapes against the reference, synchronising after
the call, in a fresh process (a CUDA fault kills the context): the conformance grid uses small
shapes, this catches faults that only appear at real widths.

    PYTHONPATH=src python3 scripts/probe_triton_ops.py OP   # prints 'OK op max_err' or 'FAIL op'

OP may carry a shape variant after '@' (index_scores@decode, @prefill, @odd; see
index_scores_inputs). The op must be served by the Triton backend at that shape (checked).
"""

from __future__ import annotations

import sys

import torch

from shoal.ops.reference.rope import RopeParams
from shoal.ops.registry import REGISTRY, load_backends
from shoal.quant.fp4 import quant_mxfp4
from shoal.quant.records import pack_index_k_record


def index_scores_inputs(variant: str, g: torch.Generator) -> dict:
    """index_scores at Flash shapes (32 heads x 128, 68-B records, 256-token pages):
    flash: T=256 of one request, 2048 rows, 256 rows per block (the shape that faulted);
    decode: 64 requests x 1 token, up to 16K rows each, 128 rows per block;
    prefill: a 1024-token chunk of one request over 4096 rows (the token-tiled path);
    odd: 37 tokens of 3 interleaved requests, 3001 rows, 128 rows per block, the cache a view
    that starts one record into its buffer (4-byte but not 16-byte aligned)."""
    d = "cuda"
    t, n, rpb, n_req = {"flash": (256, 2048, 256, 1), "decode": (64, 16384, 128, 64),
                        "prefill": (1024, 4096, 256, 1), "odd": (37, 3001, 128, 3)}[variant]
    nb = -(-n // rpb)
    table = torch.randperm(n_req * nb, generator=g).view(n_req, nb).to(torch.int32)
    cache = pack_index_k_record(torch.randn(n_req * nb * rpb + 1, 128, generator=g))
    cache = cache.to(d)[1:] if variant == "odd" else cache[:-1].to(d)
    req = torch.arange(t) % n_req if n_req > 1 else torch.zeros(t, dtype=torch.long)
    nv = torch.randint(1, n + 1, (t,), generator=g)
    nv[0] = n
    return dict(q=(torch.randn(t, 32, 128, generator=g)).to(torch.bfloat16).to(d),
                weights=torch.randn(t, 32, generator=g).to(d), k_cache=cache,
                block_table=table.to(d), req=req.to(d), n_visible=nv.to(d), num_rows=n,
                rows_per_block=rpb)


def inputs(op: str, g: torch.Generator) -> dict:
    d = "cuda"
    t = 256

    def rn(*s, dt=torch.bfloat16, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dt).to(d)

    if op.startswith("index_scores"):
        return index_scores_inputs(op.partition("@")[2] or "flash", g)
    if op == "sparse_attn_sink":  # Flash decode batch: 64 heads x 512, 128 SWA + 512 selected
        from shoal.quant.records import pack_compressed_record, pack_swa_record

        n_swa, n_comp, pool = 128, 512, 4096
        swa_idx = torch.randint(-1, pool, (t, n_swa), generator=g, dtype=torch.int32)
        comp_idx = torch.randint(-1, pool, (t, n_comp), generator=g, dtype=torch.int32)
        swa_idx[0] = -1
        comp_idx[0] = -1  # an all-empty row
        return dict(q=rn(t, 64, 512), swa_cache=pack_swa_record(torch.randn(
                        pool, 512, generator=g)).to(d), swa_idx=swa_idx.to(d),
                    comp_cache=pack_compressed_record(torch.randn(pool, 512, generator=g)).to(d),
                    comp_idx=comp_idx.to(d), sink=rn(64, dt=torch.float32),
                    scale=512 ** -0.5)
    if op in ("topk_rows", "candidate_mask"):
        n = 20000
        nv = torch.randint(1, n + 1, (t,), generator=g)
        logits = torch.randn(t, n, generator=g).masked_fill(torch.arange(n) >= nv[:, None],
                                                            -torch.inf)
        kw = dict(logits=logits.to(d), n_visible=nv.to(d))
        return {**kw, "k": 512} if op == "topk_rows" else {**kw, "block_size": 8,
                                                           "topk_blocks": 2048}
    if op in ("swa_write", "compressed_write", "index_k_write"):
        dim = 128 if op == "index_k_write" else 512
        nbytes = {"swa_write": 528, "compressed_write": 288, "index_k_write": 68}[op]
        return dict(x=rn(t, dim), cache=torch.zeros(4 * t, nbytes, dtype=torch.uint8,
                                                    device=d),
                    rows=torch.randperm(4 * t, generator=g)[:t].to(d))
    if op == "index_q_quant":
        return dict(q=rn(t, 32, 128))
    if op == "rope_tail":
        return dict(x=rn(t, 64, 512), positions=torch.randint(0, 1 << 20, (t,), generator=g).to(d),
                    params=RopeParams(64, 160000.0, 16.0, 65536))
    if op == "rmsnorm":
        return dict(x=rn(t, 5120, scale=3.0), weight=rn(5120, scale=0.1) + 1, eps=1e-20)
    if op == "hc_coeffs":
        return dict(stream=rn(t, 4, 5120), fn=rn(24, 20480, dt=torch.float32, scale=0.01),
                    scale=torch.tensor([0.1, 0.1, 0.1], device=d),
                    base=rn(24, dt=torch.float32), norm_eps=1e-20, hc_eps=1e-6, iters=20)
    if op == "hc_collapse_norm":
        return dict(stream=rn(t, 4, 5120), pre=torch.rand(t, 4, generator=g).to(d),
                    weight=rn(5120, scale=0.1) + 1, eps=1e-20)
    if op == "hc_post":
        return dict(y=rn(t, 5120), stream=rn(t, 4, 5120),
                    post=torch.rand(t, 4, generator=g).to(d) * 2,
                    comb=torch.rand(t, 4, 4, generator=g).to(d))
    if op == "router":
        return dict(x=rn(t, 5120), weight=rn(384, 5120, scale=5120 ** -0.5),
                    bias=rn(384, dt=torch.float32, scale=0.1), k=6, route_scale=1.5)
    if op == "moe_mxfp4":
        e, dim, inter = 32, 5120, 2304
        w13, s13 = quant_mxfp4(torch.randn(e, 2 * inter, dim, generator=g) / dim ** 0.5)
        w2, s2 = quant_mxfp4(torch.randn(e, dim, inter, generator=g) / inter ** 0.5)
        ids = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(t)])
        return dict(x=rn(t, dim), ids=ids.to(d), weights=torch.rand(t, 6, generator=g).to(d),
                    w13=w13.to(d), w13_scale=s13.to(d), w2=w2.to(d), w2_scale=s2.to(d),
                    limit=10.0)
    if op == "act_quant_fp8":
        return dict(x=rn(t, 5120), block=32)
    raise SystemExit(f"no probe for {op}")


def main() -> None:
    op_arg = sys.argv[1]
    op = op_arg.partition("@")[0]
    load_backends()
    impl = REGISTRY.impl("triton", op)
    g = torch.Generator().manual_seed(0)
    kw = inputs(op_arg, g)
    if impl.supports is not None and not impl.supports(**kw):
        print(f"FAIL {op_arg}: the Triton backend declines this shape (supports() is False)")
        sys.exit(1)
    ref_kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    try:
        out = impl.fn(**kw)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - report any fault of the kernel
        print(f"FAIL {op_arg}: {type(exc).__name__}: {str(exc)[:200]}")
        sys.exit(1)
    ref = REGISTRY.impl("reference", op).fn(**ref_kw)
    if out is None:  # in-place writers: compare the caches
        out, ref = kw["cache"], ref_kw["cache"]
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    errs = []
    for a, b in zip(outs, refs, strict=True):
        if a.dtype in (torch.float8_e4m3fn,):
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        if a.is_floating_point():
            fin = torch.isfinite(b)
            errs.append(float((a.float() - b.float())[fin].abs().max()) if fin.any() else 0.0)
        else:
            errs.append(float((a.long() != b.long()).float().mean()))  # mismatch fraction
    print(f"OK {op_arg} max_err/mismatch {errs}")


if __name__ == "__main__":
    main()
