"""Sparse-attention (`sparse_attn_sink`) benchmark at the Flash decode shape (64 heads x 512,
128 SWA + 512 compressed rows per token) over the kernel's knob variants (ATTN_VARIANTS; "op" is
what the registered op runs): a correctness line per variant, then time, FLOPs, bytes and the
fraction of floor per (T, variant). Run through bench_ops.py (--only attn or attn=V1+V2).
Variants "cuda[-wgmmaM][-perN]" run the CUDA kernel (ops/cuda/sparse_attn.py; N index blocks per
split at decode sizes; M = 1: the scores by wgmma, 2: P.V too).
"""

from __future__ import annotations

import torch
from op_bench import BF16_PEAK, HBM, bench, copies, log, record, rel_err

from shoal.ops.cuda import sparse_attn as cuda_attn
from shoal.ops.reference import attention as ref_attn
from shoal.ops.triton import attention as tri_attn
from shoal.quant.records import pack_compressed_record, pack_swa_record


def attn_inputs(t: int, n_swa: int, n_comp: int, h: int = 64, d: int = 512, gen=None):
    """Decode-like inputs: every token reads its own SWA rows and distinct compressed rows."""
    dev = torch.device("cuda")
    swa = pack_swa_record(torch.randn(t * n_swa, d, device=dev, generator=gen))
    comp_pool = max(4 * n_comp, 1)
    comp = pack_compressed_record(torch.randn(t * comp_pool, d, device=dev, generator=gen))
    swa_idx = torch.arange(t * n_swa, dtype=torch.int32, device=dev).view(t, n_swa)
    sel = torch.rand(t, comp_pool, device=dev, generator=gen).argsort(dim=1)[:, :n_comp]
    sel = (sel + torch.arange(t, device=dev)[:, None] * comp_pool).to(torch.int32)
    q = (torch.randn(t, h, d, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
    sink = torch.randn(h, device=dev, generator=gen)
    return dict(q=q, swa_cache=swa, swa_idx=swa_idx, comp_cache=comp, comp_idx=sel, sink=sink,
                scale=d**-0.5)


DECODE_ROWS = tri_attn.DECODE_MAX_TOKENS

ATTN_VARIANTS = {
    # name: sparse_attn knobs (see tri_attn.sparse_attn); "op" is what the registered op runs
    "op": dict(tri_attn.OP_KNOBS),
    "flat": dict(),
    "flat-d2-qloop": dict(block_n=64, dsplit=2, q_in_loop=True),
    "chunked": dict(variant="chunked"),
    "chunked-d2": dict(variant="chunked", dsplit=2),
    "pmem": dict(variant="chunked", p_mem=True),  # "op" before keep_k / q_res became automatic
    "pmem-bn32": dict(variant="chunked", p_mem=True, block_n=32),
    "pmem-d2": dict(variant="chunked", p_mem=True, dsplit=2),
    "pmem-bn32-s1": dict(variant="chunked", p_mem=True, block_n=32, split=1),
    "pmem-qres": dict(variant="chunked", p_mem=True, q_res=True),
    "pmem-qres-bn32": dict(variant="chunked", p_mem=True, q_res=True, block_n=32),
    "pmem-s2": dict(variant="chunked", p_mem=True, num_stages=2),
    "pmem-d4": dict(variant="chunked", p_mem=True, dsplit=4),
    "pmem-per1": dict(variant="chunked", p_mem=True, split=10),  # 1 block per program (10 blocks)
    "pmem-d2-per1": dict(variant="chunked", p_mem=True, dsplit=2, split=10),
    "pmem-keepk-qres": dict(variant="chunked", p_mem=True, keep_k=True, q_res=True),
    "pmem-sp2": dict(variant="chunked", p_mem=True, split=2),  # fewer, longer programs
    "op-sp3": dict(tri_attn.OP_KNOBS, split=3),  # 4 + 4 + 2 of 10 blocks
    "op-sp4": dict(tri_attn.OP_KNOBS, split=4),  # 3 + 3 + 3 + 1
}


CUDA_VARIANTS = ("cuda", "cuda-per1", "cuda-per3", "cuda-per5", "cuda-per10", "cuda-wgmma1",
                 "cuda-wgmma2", "cuda-wgmma2-per5", "cuda-wgmma2-per10")


def _variant(name: str):
    """(run(inputs, split) -> out, splits(T, n_swa, n_comp)) of a variant."""
    if name.startswith("cuda"):
        per = int(name.partition("-per")[2] or cuda_attn.BLOCKS_PER_SPLIT)
        mode = name.partition("-wgmma")[2][:1]
        state = cuda_attn.SparseAttnState(per, wgmma=int(mode or 0))
        return (lambda kw, split=None: cuda_attn.sparse_attn_sink(**kw, state=state),
                lambda t, n_swa, n_comp: tri_attn.partition(t, _blocks(n_swa, n_comp, 64),
                                                            per=per)[0])
    opts = ATTN_VARIANTS[name]
    bn = opts.get("block_n", 64)
    return (lambda kw, split=None: tri_attn.sparse_attn(**kw, **{"split": split, **opts}),
            lambda t, n_swa, n_comp: tri_attn.partition(t, _blocks(n_swa, n_comp, bn),
                                                        opts.get("split"))[0])


def _blocks(n_swa: int, n_comp: int, block_n: int) -> int:
    return -(-n_swa // block_n) + -(-n_comp // block_n)


def bench_attention(batches: list[int], names: list[str] | None = None) -> None:
    """sparse_attn_sink at the Flash decode shape, every variant in `names` (default: all of
    ATTN_VARIANTS): a correctness line per variant (T=8, split 1 and the automatic split),
    then one timing line per (T, variant), then the best variant per T."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    h, d, n_swa, n_comp = 64, 512, 128, 512
    kw = attn_inputs(8, n_swa, n_comp, gen=gen)
    ref = ref_attn.sparse_attn_sink(**kw)
    variants = [(n, _variant(n)) for n in (names or [*ATTN_VARIANTS, *CUDA_VARIANTS])]
    wide = attn_inputs(DECODE_ROWS + 3, n_swa, n_comp, gen=gen)  # one program per row
    wide_ref = ref_attn.sparse_attn_sink(**wide)
    ok = []
    for vname, (run, splits) in variants:
        good = True
        for split in (1, None, "wide"):
            try:
                got = run(wide) if split == "wide" else run(kw, split)
                torch.cuda.synchronize()
            except Exception as exc:  # a variant that fails to compile is reported, not fatal
                log(f"check sparse_attn_sink[{vname}]: failed {type(exc).__name__}: "
                    f"{exc!s:.200}")
                good = False
                break
            want = wide_ref if split == "wide" else ref
            err = rel_err(got, want)
            good &= err < 2e-2
            log(f"check sparse_attn_sink[{vname}] T={got.shape[0]} split={split or 'auto'}: rel "
                f"err {err:.2e}, max abs {float((got.float() - want.float()).abs().max()):.2e}")
        if good:
            ok.append((vname, run, splits))
        else:
            log(f"sparse_attn_sink[{vname}]: WRONG or failed, not timed")
    best: dict[int, tuple[float, str]] = {}
    for t in batches:
        rec_bytes = t * (n_swa * 528 + n_comp * 288)
        sets = [attn_inputs(t, n_swa, n_comp, gen=gen) for _ in range(copies(rec_bytes))]
        flops = 4.0 * t * h * (n_swa + n_comp) * d
        nbytes = rec_bytes + 2 * t * h * d * 2 + t * (n_swa + n_comp) * 4
        for vname, run, splits in ok:
            try:
                ms = bench([lambda s=s, r=run: r(s) for s in sets])
            except Exception as exc:  # a variant that fails to compile is reported, not fatal
                log(f"sparse_attn_sink {vname} T{t}: failed: {type(exc).__name__}: {exc}"[:300])
                continue
            split = splits(t, n_swa, n_comp)
            record(f"sparse_attn[{vname}]", f"T{t}xH{h}xD{d} swa{n_swa}+comp{n_comp}", ms,
                   flops, nbytes, BF16_PEAK, split=split,
                   frac_hbm=round(nbytes / HBM / (ms * 1e-3), 3))
            if t not in best or ms < best[t][0]:
                best[t] = (ms, vname)
    for t, (ms, vname) in best.items():
        log(f"best sparse_attn T{t}: {vname} {ms * 1e3:.1f} us")
