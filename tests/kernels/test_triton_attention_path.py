"""Triton attention-path kernels (norm, rope, mHC, cache writers, indexer) against the reference
on inputs the conformance grid does not stress: wide magnitude ranges and exact quantiser ties
(records must be bit-identical), and exact top-k ties (lowest index wins).

Runs on CUDA (sm_90), or on the CPU under the Triton interpreter (TRITON_INTERPRET=1 set before
the run). Under the interpreter three of its defects are patched for this module only: fp32->bf16
casts truncate (the GPU rounds to nearest even), bf16 `tl.dot` multiplies the raw uint16 bits,
and a scalar's `__index__` fails with NumPy 2 (runtime `range` bounds).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from shoal.ops.reference import cache as rcache  # noqa: E402
from shoal.ops.reference import indexer as rindexer  # noqa: E402
from shoal.ops.triton import cache as tcache  # noqa: E402
from shoal.ops.triton import indexer as tindexer  # noqa: E402
from shoal.ops.triton.attention_chunked import _e2m1_pair  # noqa: E402
from shoal.quant.fp4 import E2M1_VALUES  # noqa: E402
from shoal.quant.records import (  # noqa: E402
    pack_compressed_record,
    pack_index_k_record,
    pack_swa_record,
)
from support.triton_interpreter import (  # noqa: E402
    DEV,
    INTERP,
    ON_GPU,
    needs_kernels,
    patch_interpreter,
)


@pytest.fixture(autouse=True)
def _interpreter_shims(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERP and not ON_GPU:
        patch_interpreter(monkeypatch)


def _hard_values(t: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows spanning 2^-30..2^30, half of them exact multiples of 1/8 (quantiser ties), zeros
    and negative zeros, and some tiny rows (amax floors)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(t, d, generator=g) * torch.exp2(torch.randint(-30, 30, (t, 1), generator=g)
                                                      .float())
    ties = torch.randint(-48, 49, (t, d), generator=g).float() / 8
    x[t // 2:] = (ties * torch.exp2(torch.randint(-12, 12, (t, 1), generator=g).float()))[t // 2:]
    x[::7, :5] = 0.0
    x[::11, 3] = -0.0
    x[::13] *= 1e-6
    return x.to(dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["swa_write", "compressed_write", "index_k_write"])
def test_records_bit_exact_on_hard_values(name: str, dtype: torch.dtype) -> None:
    t, d = 160, 64
    x = _hard_values(t, d, dtype)
    ref_fn, tri_fn = getattr(rcache, name), getattr(tcache, name)
    width = {"swa_write": d + d // 32, "compressed_write": d // 2 + d // 16,
             "index_k_write": d // 2 + d // 32}[name]
    rows = torch.randperm(t + 5, generator=torch.Generator().manual_seed(1))[:t]
    want = torch.full((t + 5, width), 0xA5, dtype=torch.uint8)
    got = want.to(DEV)
    ref_fn(x=x, cache=want, rows=rows)
    tri_fn(x=x.to(DEV), cache=got, rows=rows.to(DEV))
    bad = (got.cpu() != want).any(1).nonzero().flatten()
    assert bad.numel() == 0, f"{name}: {bad.numel()} records differ, first row {bad[:3].tolist()}"


@needs_kernels
def test_index_q_quant_bit_exact_on_hard_values() -> None:
    q = _hard_values(24, 64, torch.bfloat16).view(6, 4, 64)
    want = rindexer.index_q_quant(q=q)
    got = tindexer.index_q_quant(q=q.to(DEV)).cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_kernels
def test_topk_rows_exact_ties_go_to_lower_index() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 4, (6, 300), generator=g).float()  # massive exact ties
    logits[:, ::5] = 0.0
    logits[:, 1::5] = -0.0
    logits[2, 100:] = -torch.inf
    n = torch.tensor([300, 299, 300, 5, 0, 40])
    logits = logits.masked_fill(torch.arange(300) >= n.unsqueeze(1), -torch.inf)
    want = rindexer.topk_rows(logits=logits, n_visible=n, k=64)
    got = tindexer.topk_rows(logits=logits.to(DEV), n_visible=n.to(DEV), k=64).cpu()
    assert torch.equal(got, want)


@needs_kernels
def test_candidate_mask_ties_and_pinned_block() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randint(-2, 3, (5, 203), generator=g).float()
    n = torch.tensor([203, 150, 1, 0, 97])
    logits = logits.masked_fill(torch.arange(203) >= n.unsqueeze(1), -torch.inf)
    want = rindexer.candidate_mask(logits=logits, n_visible=n, block_size=8, topk_blocks=7)
    got = tindexer.candidate_mask(logits=logits.to(DEV), n_visible=n.to(DEV), block_size=8,
                                  topk_blocks=7).cpu()
    assert torch.equal(got, want)


def _scores_inputs(t: int, h: int, d: int, n_req: int, rows: int, rpb: int, seed: int,
                   one_request: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    nb = (rows + rpb - 1) // rpb
    table = torch.randperm(n_req * nb + 3, generator=g)[:n_req * nb].view(n_req, nb)
    keys = torch.randn((n_req * nb + 3) * rpb, d, generator=g)
    keys[::5] *= 2.0 ** -100  # small UE8M0 scales (subnormal-range products)
    keys[1::7] *= 2.0 ** 40
    cache = pack_index_k_record(keys)
    req = (torch.zeros(t, dtype=torch.long) if one_request
           else torch.randint(0, n_req, (t,), generator=g))
    nv = torch.randint(0, rows + 1, (t,), generator=g)
    if t:
        nv[0] = rows
    return {"q": torch.randn(t, h, d, generator=g).to(torch.bfloat16),
            "weights": torch.randn(t, h, generator=g).bfloat16().float(), "k_cache": cache,
            "block_table": table.to(torch.int32), "req": req, "n_visible": nv,
            "num_rows": rows, "rows_per_block": rpb}


def _assert_within_bf16_ulps(got: torch.Tensor, want: torch.Tensor, kw: dict) -> None:
    """Equal up to the bf16 rounding of a per-head dot whose fp32 sum lands on a rounding
    boundary in one summation order and not the other (the kernel's mma order vs the
    reference's exact sum): each such head moves the logit by one bf16 ulp of its term, so the
    bound is 2^-6 of sum_h |w_h| relu(s_h), the same scores with |w|."""
    scale = rindexer.index_scores(**{**kw, "weights": kw["weights"].abs()})
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs()
    assert bool((err <= scale[fin] * 2.0 ** -6 + 1e-30).all()), float(err.max())


@needs_kernels
@pytest.mark.parametrize("t,h,d,n_req,rows,rpb,tb,one", [
    (1, 32, 128, 1, 200, 16, None, False),   # decode, RPB % 16 == 0 (the faulting case)
    (7, 3, 128, 2, 77, 4, None, False),      # odd heads (HP padding), odd rows
    (9, 32, 128, 1, 130, 64, 4, True),       # prefill tiling: 4 tokens share a key tile
    (11, 8, 128, 3, 100, 16, 4, False),      # mixed requests in a token block: fallback
    (5, 4, 256, 2, 70, 16, 2, False),        # Di = 256 (two scale words)
    (0, 32, 128, 1, 64, 16, None, False),    # empty batch
    (3, 32, 128, 1, 0, 16, None, False),     # no rows
])
def test_index_scores_matches_reference(t, h, d, n_req, rows, rpb, tb, one) -> None:
    kw = _scores_inputs(t, h, d, n_req, rows, rpb, seed=1000 + t * 7 + rows, one_request=one)
    want = rindexer.index_scores(**kw)
    dev_kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    assert tindexer._supports_scores(**dev_kw)
    got = tindexer.index_scores_tuned(**dev_kw, tb=tb).cpu()
    assert got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    assert torch.isfinite(got[fin]).all()
    _assert_within_bf16_ulps(got, want, kw)


@needs_kernels
@pytest.mark.parametrize("tb,bn,warps", [(None, 64, None), (4, 64, None), (32, 64, None),
                                         (8, 128, 8)])
def test_index_scores_causal_prefill_chunk(tb, bn, warps) -> None:
    """A prefill chunk's staircase of visible rows (token i sees (i + 1) // 2 rows, as with a
    ratio-2 source) spanning many 64-row tiles: the tiles above every token of a block are
    stored as -inf without a product (the -inf pattern equals the reference's), the rest match;
    each token alone gives the bits it has inside the chunk (batch invariance)."""
    t, rows = 150, 75
    kw = _scores_inputs(t, 32, 128, 1, rows, 16, seed=77, one_request=True)
    kw["n_visible"] = (torch.arange(t) + 1) // 2
    want = rindexer.index_scores(**kw)
    dev_kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    got = tindexer.index_scores_tuned(**dev_kw, tb=tb, bn=bn, num_warps=warps).cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    _assert_within_bf16_ulps(got, want, kw)
    for i in (0, 77, t - 1):
        one = {**dev_kw, **{k: dev_kw[k][i:i + 1] for k in ("q", "weights", "req",
                                                            "n_visible")}}
        alone = tindexer.index_scores_tuned(**one, bn=bn, num_warps=warps).cpu()
        assert torch.equal(alone[0], got[i]), f"token {i}"


def test_index_scores_kernel_emits_no_vector_loads_of_records() -> None:
    """Compile the scores kernel for sm_90 (PTX only: no GPU needed) with the launcher's
    specialisation at the probe shape (pointers and multiples of 16 get tt.divisibility 16,
    except the kernel's do_not_specialize arguments) and check that no global load is wider
    than 4 bytes. q/w/table strides are left unspecialised so that only the key records could
    be vectorised: a 16-byte load at a 68-byte record offset is the misaligned-address fault."""
    if INTERP:
        pytest.skip("compiles PTX: run without TRITON_INTERPRET")
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = tindexer._scores_kernel
    names = kern.arg_names
    ptrs = {"q_ptr": "*bf16", "w_ptr": "*fp32", "kw_ptr": "*i32", "bt_ptr": "*i32",
            "req_ptr": "*i64", "nv_ptr": "*i64", "o_ptr": "*fp32"}
    ints = {"T": 256, "H": 32, "N": 2048, "RPB": 256, "sq_t": 4096, "sq_h": 128, "sq_d": 3,
            "sw_t": 32, "sw_h": 3, "bt_r": 8, "bt_c": 3}
    consts = {"HP": 32, "DI": 128, "BN": 64, "TB": 4}
    skip = {names[i] if isinstance(i, int) else i for i in kern.do_not_specialize or ()}
    assert "RPB" in skip
    sig = {n: ptrs.get(n, "i32") if n not in consts else "constexpr" for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n in ptrs or (n in ints and n not in skip and ints[n] % 16 == 0)}
    src = ASTSource(fn=kern, signature=sig, attrs=attrs,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    loads = set(re.findall(r"ld\.global[\w.]*", ptx))
    assert loads and not any(".v2" in x or ".v4" in x for x in loads), loads


def _attn_inputs(t: int, h: int, d: int, n_swa: int, n_comp: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    pool = 97
    keys = torch.randn(pool, d, generator=g)
    keys[::9] *= 2.0 ** -20  # wide scale range across records
    keys[1::11] *= 30.0
    swa_idx = torch.randint(-1, pool, (t, n_swa), generator=g, dtype=torch.int32)
    comp_idx = torch.randint(-1, pool, (t, n_comp), generator=g, dtype=torch.int32)
    if t:
        swa_idx[0] = -1
        comp_idx[0] = -1  # an all-empty row: output 0
    if t > 1:
        swa_idx[1, 3:] = -1  # a row with only a few keys
    return {"q": (torch.randn(t, h, d, generator=g) * 2).to(torch.bfloat16),
            "swa_cache": pack_swa_record(keys),
            "swa_idx": swa_idx, "comp_cache": pack_compressed_record(keys.flip(0)),
            "comp_idx": comp_idx if n_comp else None,
            "sink": torch.randn(h, generator=g), "scale": d ** -0.5}


ATTN_VARIANTS = [
    ("flat", {}), ("flat-d2-qloop", {"dsplit": 2, "q_in_loop": True}),
    ("flat-bn32-nobcast", {"block_n": 32, "scale_bcast": False}),
    ("chunked", {"variant": "chunked"}), ("chunked-keep", {"variant": "chunked", "keep_k": True}),
    ("chunked-d2", {"variant": "chunked", "dsplit": 2}),
    ("chunked-d4-bn32", {"variant": "chunked", "dsplit": 4, "block_n": 32}),
    ("chunked-pmem", {"variant": "chunked", "p_mem": True}),
    ("chunked-pmem-d2-bn32", {"variant": "chunked", "p_mem": True, "dsplit": 2, "block_n": 32}),
    ("chunked-pmem-qres", {"variant": "chunked", "p_mem": True, "q_res": True}),
    ("chunked-qres-d4", {"variant": "chunked", "q_res": True, "dsplit": 4}),
]


def _attn_grid() -> list:
    """Every variant on the main case and a split case with an empty split; a few on the
    others (the interpreter is slow). An SWA list of 13 beside a compressed one puts both pools
    in the first block (the flat kernel's boundary block; chunked variants fall back to it)."""
    few = {"flat", "chunked-pmem-qres", "chunked-qres-d4"}
    grid = []
    for shape, names in [((3, 4, 128, 64, 70, 1), None), ((3, 4, 128, 64, 70, 4), None),
                         ((3, 4, 128, 13, 70, 1), {"flat", "flat-d2-qloop"}),
                         ((3, 4, 128, 13, 70, 4), {"flat", "flat-bn32-nobcast"}),
                         ((2, 5, 256, 64, 0, 2), few), ((0, 4, 128, 8, 8, None), few)]:
        grid += [pytest.param(v, o, *shape, id=f"{v}-T{shape[0]}D{shape[2]}s{shape[5]}")
                 for v, o in ATTN_VARIANTS if names is None or v in names]
    return grid


@needs_kernels
@pytest.mark.parametrize("vname,opts,t,h,d,n_swa,n_comp,split", _attn_grid())
def test_sparse_attn_variants_match_reference(vname, opts, t, h, d, n_swa, n_comp,
                                              split) -> None:
    from shoal.ops.reference import attention as rattn
    from shoal.ops.triton import attention as tattn

    kw = _attn_inputs(t, h, d, n_swa, n_comp, seed=500 + t + d + n_comp)
    if kw["comp_idx"] is None:
        kw["comp_cache"] = None
    want = rattn.sparse_attn_sink(**kw)
    dev_kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    got = tattn.sparse_attn(**dev_kw, split=split, **opts).cpu()
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    if t:
        assert not got[0].any(), "an all-empty row must give 0"
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_kernels
@pytest.mark.parametrize("split", [None, 1], ids=["decode", "one-program"])
def test_sparse_attn_keep_k_and_q_res_do_not_change_bits(monkeypatch, split) -> None:
    """keep_k (the score pass's decoded key chunks reused by P.V) and q_res (q loaded once per
    program) feed the same dots the same values, so both families' bits equal those of the
    kernel that decodes every chunk twice and reloads q per block; the op's automatic choice
    (keep_k None) takes them with one column group."""
    from shoal.ops.triton import attention as tattn

    if INTERP:
        patch_interpreter(monkeypatch)
    kw = _attn_inputs(3, 16, 256, 128, 150, seed=5)
    dev = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    base = dict(variant="chunked", p_mem=True, dsplit=1, split=split)
    plain = tattn.sparse_attn(**dev, **base, keep_k=False, q_res=False).cpu()
    for keep_k, q_res in ((True, False), (True, True), (False, True), (None, None)):
        got = tattn.sparse_attn(**dev, **base, keep_k=keep_k, q_res=q_res).cpu()
        assert torch.equal(got, plain), (keep_k, q_res)
    if split is None:
        assert torch.equal(tattn.sparse_attn(**dev, **tattn.OP_KNOBS, dsplit=1).cpu(), plain)


@triton.jit
def _decode_bytes(p_ptr, lo_ptr, hi_ptr):
    offs = tl.arange(0, 256)
    lo, hi = _e2m1_pair(tl.load(p_ptr + offs).to(tl.int32))
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


@needs_kernels
def test_e2m1_decode_of_every_byte() -> None:
    """The attention kernels' e2m1 decode (`attention_chunked._e2m1_pair`: both codes of a byte
    placed as an fp16 pair by two multiplies and two masks, widened) gives value * 2^-14
    exactly for both nibbles of all 256 bytes (loaded as uint8, as the kernels load them)."""
    byte = torch.arange(256, dtype=torch.int32)
    lo = torch.empty(256, dtype=torch.float32, device=DEV)
    hi = torch.empty_like(lo)
    _decode_bytes[(1,)](byte.to(torch.uint8).to(DEV), lo, hi)
    vals = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], dtype=torch.float32)
    assert torch.equal(lo.cpu(), vals[byte & 0xF] * 2.0**-14)
    assert torch.equal(hi.cpu(), vals[byte >> 4] * 2.0**-14)
    assert torch.equal(torch.signbit(lo.cpu()), (byte & 8) != 0)  # -0.0 for code 8
    assert torch.equal(torch.signbit(hi.cpu()), (byte & 128) != 0)
