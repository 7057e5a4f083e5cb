"""The Triton FP8 GEMM (ops/triton/gemm.py: folded scales, promoted FP8 wgmma) against the exact
blockwise sum and the reference op, including rows whose 32-blocks span many binades (where
folding rounds or flushes the small blocks), and the grouped W8A16 projection (gemm_grouped.py)
against its reference. Runs on sm_90 or under the Triton interpreter (the sm_90 builds of their
tiles: test_sm90_builds.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from shoal.ops.reference import gemm as ref_gemm  # noqa: E402
from shoal.quant.fp8 import (  # noqa: E402
    dequant_fp8_act,
    dequant_fp8_weight,
    quant_fp8_act,
    quant_fp8_weight,
)
from support.triton_interpreter import DEV, INTERP, needs_kernels, patch_interpreter  # noqa: E402

# (M, N, K, tile or None = autotuned, split)
CASES = [(1, 96, 256, (64, 64, 64, 4, 2), 1), (5, 64, 128, (64, 64, 128, 4, 2), 2),
         (37, 100, 320, (64, 64, 64, 4, 2), 3), (70, 33, 64, (128, 64, 64, 8, 2), 1)]


def _inputs(m: int, n: int, k: int, seed: int, spread: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if spread:  # per-block magnitudes over 2^-12 .. 2^12: folding would flush the small blocks
        x = x * torch.exp2(torch.randint(-12, 13, (m, k // 32), generator=g).float()
                           ).repeat_interleave(32, 1)
    w = torch.randn(n, k, generator=g) / k**0.5
    if spread:
        w = w * torch.exp2(torch.randint(-8, 9, (1, k // 32), generator=g).float()
                           ).repeat_interleave(32, 1)
    xb = x.to(torch.bfloat16)
    q, qs = quant_fp8_act(xb, 32)
    wc, ws = quant_fp8_weight(w, 32)
    return xb, q, qs, wc, ws


def _exact(q, qs, wc, ws) -> torch.Tensor:
    """The blockwise sum in fp64 (every product exact)."""
    a = dequant_fp8_act(q, qs, 32).double()
    b = dequant_fp8_weight(wc, ws, 32).double()
    return a @ b.T


@needs_kernels
@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("m,n,k,tile,split", CASES)
def test_fp8_gemm_near_exact_sum(monkeypatch, m, n, k, tile, split, spread) -> None:
    """Products are exact and every <= 128-K partial sum is promoted to fp32, so the error is the
    wgmma's reduced-precision adds inside one BLOCK_K (about 14 bits kept: DeepSeek-V3 report,
    section 3.3.2), bounded here by 2^-11 of the sum of |terms|, plus the fold's flushed codes
    (blocks >= 2^6 below their row's largest: far smaller) and one bf16 rounding."""
    from shoal.ops.triton import gemm as tg

    if INTERP:
        patch_interpreter(monkeypatch)
    xb, q, qs, wc, ws = _inputs(m, n, k, 7 * m + n + spread, spread)
    fq, rs = _fold_act(q, qs)
    prepared = tg.prepare_fp8_weight(wc.to(DEV), ws.to(DEV))
    out = torch.full((m, n), float("nan"))  # poisoned: every element must be written
    got = tg.gemm_fp8_folded(fq.to(DEV), rs.to(DEV), prepared, tg.PROMOTED, split=split,
                             tile=tile if INTERP else None).float().cpu()
    out.copy_(got)
    assert torch.isfinite(out).all()
    want = _exact(q, qs, wc, ws)
    terms = dequant_fp8_act(q, qs, 32).double().abs() @ dequant_fp8_weight(wc, ws, 32
                                                                           ).double().abs().T
    lim = want.abs() * 2.0**-8 + terms * 2.0**-11 + 1e-30
    bad = (out.double() - want).abs() > lim
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements off the exact sum"


def _fold_act(q: torch.Tensor, qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fold of `act_quant(fold=True)` applied to reference codes (CPU, RNE)."""
    e = qs.to(torch.int32)
    top = e.amax(dim=1, keepdim=True)
    f = torch.exp2((e - top).clamp_min(-126).float()).repeat_interleave(32, dim=1)
    return ((q.float() * f).to(torch.float8_e4m3fn),
            torch.exp2((top.squeeze(1) - 127).float()))


@needs_kernels
def test_gemm_fp8_op_matches_reference(monkeypatch) -> None:
    """The registered op (act quant + weight fold + kernel; no table, so no cache) on odd shapes."""
    from shoal.ops.triton import gemm as tg

    if not torch.cuda.is_available():
        pytest.skip("the op quantises with the CUDA-only fused kernel")
    xb, q, qs, wc, ws = _inputs(37, 100, 320, 3, False)
    got = tg.gemm_fp8(x=xb.to(DEV), weight=wc.to(DEV), weight_scale=ws.to(DEV)).float().cpu()
    ref = ref_gemm.gemm_fp8(x=xb, weight=wc, weight_scale=ws).float()
    terms = dequant_fp8_act(q, qs, 32).abs() @ dequant_fp8_weight(wc, ws, 32).abs().T
    assert ((got - ref).abs() <= ref.abs() * 2.0**-7 + terms * 2.0**-10).all()


@needs_kernels
@pytest.mark.parametrize("byte,expect", [(0, 2.0**-127), (127, 1.0), (200, 2.0**73)])
def test_weight_scale_bytes_decode_like_the_reference(monkeypatch, byte: int,
                                                      expect: float) -> None:
    """UE8M0 0 is the subnormal 2^-127 (not 0); NaN (255) blocks give NaN outputs."""
    from shoal.ops.triton import gemm as tg

    if INTERP:
        patch_interpreter(monkeypatch)
    a = torch.ones(1, 32).to(torch.float8_e4m3fn)
    w = torch.ones(64, 32).to(torch.float8_e4m3fn)
    w_s = torch.tensor([[byte], [255]], dtype=torch.uint8)
    prepared = tg.prepare_fp8_weight(w.to(DEV), w_s.to(DEV))
    got = tg.gemm_fp8_folded(a.to(DEV), torch.ones(1, device=DEV), prepared, split=1,
                             tile=(64, 64, 32, 4, 2)).float().cpu()
    want = torch.tensor(32.0 * expect).to(torch.bfloat16).float()
    assert torch.equal(got[0, :32], want.expand(32)) and torch.isnan(got[0, 32:]).all()


@needs_kernels
@pytest.mark.parametrize("t", [1, 5, 40])
def test_grouped_w8a16_matches_reference(monkeypatch, t: int) -> None:
    """wo_a's grouped projection (exactly dequantised FP8 weight tiles, bf16 products exact in
    fp32): decode-size (16-row tiles) and larger T against the reference, output poisoned."""
    from shoal.ops.triton import gemm_grouped as tgg

    if INTERP:
        patch_interpreter(monkeypatch)
    g = torch.Generator().manual_seed(t)
    groups, rank, k = 4, 64, 256
    o = torch.randn(t, groups, k, generator=g).to(torch.bfloat16)
    wc, ws = quant_fp8_weight(torch.randn(groups * rank, k, generator=g) / k**0.5, 32)
    ref = ref_gemm.gemm_grouped_w8a16(o=o, weight=wc, weight_scale=ws).float()
    w = dequant_fp8_weight(wc, ws, 32).double().abs().view(groups, rank, k)
    terms = torch.einsum("tgk,grk->tgr", o.double().abs(), w).reshape(t, -1)
    small = min(triton.next_power_of_2(t), 4096) <= 16
    tiles = [c for c in tgg._GROUPED_TILES if (c[0] == 16) == small] if INTERP else [None]
    for tile in tiles:  # the interpreter cannot autotune: every tile the pruner would offer
        out = torch.full((t, groups * rank), float("nan"), dtype=torch.bfloat16)
        out.copy_(tgg.grouped_w8a16(o.to(DEV), wc.to(DEV), ws.to(DEV), tile=tile).cpu())
        lim = ref.double().abs() * 2.0**-8 + terms * 2.0**-20
        bad = (out.double() - ref.double()).abs() > lim
        assert not bad.any(), f"{tile}: {int(bad.sum())} of {bad.numel()} elements off"


@needs_kernels
@pytest.mark.parametrize("t", [1, 40])
def test_grouped_w8a16_scale_bytes_decode_like_the_reference(monkeypatch, t: int) -> None:
    """Both tile families of the grouped projection (16-row decode tiles with one scale per
    32-block, wide tiles with a scale per element) read UE8M0 byte 0 as 2^-127 and 255 as NaN,
    as the reference: exact equality, NaN where the reference has NaN."""
    from shoal.ops.triton import gemm_grouped as tgg

    if INTERP:
        patch_interpreter(monkeypatch)
    groups, rank, k = 2, 64, 128
    o = torch.ones(t, groups, k).to(torch.bfloat16)
    wc = torch.ones(groups * rank, k).to(torch.float8_e4m3fn)
    ws = torch.tensor([[0, 127, 200, 120], [127, 255, 127, 127], [130, 0, 1, 127],
                       [127, 127, 127, 127]], dtype=torch.uint8)  # [row blocks, K blocks]
    ref = ref_gemm.gemm_grouped_w8a16(o=o, weight=wc, weight_scale=ws).float()
    small = min(triton.next_power_of_2(t), 4096) <= 16
    tiles = [c for c in tgg._GROUPED_TILES if (c[0] == 16) == small] if INTERP else [None]
    for tile in tiles:
        got = tgg.grouped_w8a16(o.to(DEV), wc.to(DEV), ws.to(DEV), tile=tile).float().cpu()
        assert torch.equal(got.isnan(), ref.isnan()) and ref.isnan().any(), tile
        assert torch.equal(got.nan_to_num(), ref.nan_to_num()), tile


@pytest.mark.skipif(INTERP or not torch.cuda.is_available(), reason="sm_90 wgmma bits")
@pytest.mark.parametrize("m", [5, 200])
def test_promoted_tiles_agree_bitwise(m: int) -> None:
    """Every tile the autotuner may pick for a promoted GEMM gives the same bits, so which tile
    wins the timing (per process) cannot change a result: run-to-run determinism."""
    from shoal.ops.triton import gemm as tg

    n, k = 384, 1536
    xb, q, qs, wc, ws = _inputs(m, n, k, 11 * m, False)
    fq, rs = _fold_act(q, qs)
    prepared = tg.prepare_fp8_weight(wc.to(DEV), ws.to(DEV))
    split = tg.split_k(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    bucket = min(triton.next_power_of_2(m), 4096)
    tiles = [t for t in tg._TILES if tg._tile_ok(t[0], t[1], t[2], t[3], bucket, k, split,
                                                 tg.PROMOTED)]
    assert len(tiles) >= 2, tiles
    outs = [tg.gemm_fp8_folded(fq.to(DEV), rs.to(DEV), prepared, tg.PROMOTED, split=split,
                               tile=t) for t in tiles]
    for t, o in zip(tiles[1:], outs[1:], strict=True):
        assert torch.equal(o, outs[0]), f"tile {t} differs from {tiles[0]} at M = {m}"


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 15])
def test_padded_decode_rows_give_the_same_bits(monkeypatch, m: int) -> None:
    """The op pads fewer than 16 activation rows to 16 (`rows=`): the padding (poisoned here with
    NaN codes) changes no stored bit, and nothing is written beyond row m; each row equals the
    same row computed inside a 16-row batch (one tile, same split)."""
    from shoal.ops.triton import gemm as tg

    if INTERP:
        patch_interpreter(monkeypatch)
    n, k = 96, 256
    xb, q, qs, wc, ws = _inputs(16, n, k, 40 + m, False)
    fq, rs = _fold_act(q, qs)
    prepared = tg.prepare_fp8_weight(wc.to(DEV), ws.to(DEV))
    kw = dict(split=2, tile=(64, 64, 128, 4, 2))
    whole = tg.gemm_fp8_folded(fq.to(DEV), rs.to(DEV), prepared, tg.PROMOTED, **kw).cpu()
    padded = fq.clone()
    padded[m:] = torch.full((16 - m, k), float("nan")).to(torch.float8_e4m3fn)
    got = tg.gemm_fp8_folded(padded.to(DEV), rs[:m].contiguous().to(DEV), prepared,
                             tg.PROMOTED, rows=m, **kw).cpu()
    alone = tg.gemm_fp8_folded(fq[:m].contiguous().to(DEV), rs[:m].contiguous().to(DEV),
                               prepared, tg.PROMOTED, **kw).cpu()
    assert got.shape == (m, n) and not got.isnan().any()
    assert torch.equal(got, whole[:m]) and torch.equal(alone, whole[:m])
    with pytest.raises(ValueError, match="rows"):
        tg.gemm_fp8_folded(fq.to(DEV), rs.to(DEV), prepared, rows=17, **kw)


def test_decode_sizes_never_take_the_persistent_kernel() -> None:
    """Every decode size (M <= 64, the split pointer kernel's range) stays on the pointer
    kernel, even for a weight with enough tile steps at M = 1 (mini's Engram wkv); prefill
    sizes of the large shapes take the persistent kernel."""
    from shoal.ops.triton.gemm_persistent import persistent_ok

    engram_wkv, wq_b, wo_b = (25600, 6144), (32768, 1280), (5120, 8192)
    for n, k in (engram_wkv, wq_b, wo_b):
        assert not any(persistent_ok(m, n, k, 132) for m in range(1, 65))
        assert persistent_ok(4096, n, k, 132)
    assert persistent_ok(65, *engram_wkv, 132)


@needs_kernels
@pytest.mark.parametrize("m,n,k", [(200, 136, 320), (130, 64, 256), (600, 520, 1152)])
@pytest.mark.parametrize("promote", [0, 1])
def test_persistent_kernel_gives_the_pointer_kernels_bits(monkeypatch, m, n, k,
                                                          promote) -> None:
    """The persistent TMA kernel (large M) with a 128-K tile adds the same 128-K partials in the
    same order as the pointer kernel, so both give the same bits, with tails in M, N and K (TMA
    zero-fills the loads and clips the store). Its default 256-K tile (promotion every 256 K)
    is as close to the exact product of the same codes as the pointer kernel (norm-wise), and
    the default choice between the kernels is one of the two results."""
    from shoal.ops.triton import gemm as tg
    from shoal.ops.triton.device import sm_count
    from shoal.ops.triton.gemm_persistent import persistent_ok

    if INTERP:
        if m > 256:
            pytest.skip("interpreter: the small shapes cover the tails")
        patch_interpreter(monkeypatch)
    xb, q, qs, wc, ws = _inputs(m, n, k, 5 * m + k, promote == 1)
    fq, rs = _fold_act(q, qs)
    prepared = tg.prepare_fp8_weight(wc.to(DEV), ws.to(DEV))
    k128 = (128, 128, 128, 8, 4)
    ptr = tg.gemm_fp8_folded(fq.to(DEV), rs.to(DEV), prepared, promote, split=1,
                             tile=k128 if INTERP else None, persistent=False)
    got = tg.gemm_fp8_folded(fq.to(DEV), rs.to(DEV), prepared, promote, tile=k128,
                             persistent=True)
    assert got.shape == (m, n) and torch.isfinite(got.float()).all()
    assert torch.equal(got, ptr)
    tile = k128 if INTERP else None
    default = tg.gemm_fp8_folded(fq.to(DEV), rs.to(DEV), prepared, promote, tile=tile,
                                 persistent=True)
    exact = (fq.double() * rs.double()[:, None]) @ (
        prepared.codes.cpu().double() * prepared.col_scale.cpu().double()[:, None]).T

    def rel(out: torch.Tensor) -> float:
        return ((out.cpu().double() - exact).norm() / exact.norm()).item()

    # bf16 output rounding alone gives ~1.1e-3 (H200 at mini shapes, M = 1024: 128-K 1.665e-3,
    # 256-K 1.673e-3, chained 2.6e-3 at K = 8192)
    assert rel(ptr) < 2.5e-3 and rel(default) < 1.1 * rel(ptr) + 1e-5, (rel(ptr), rel(default))
    chosen = tg.gemm_fp8_folded(fq.to(DEV), rs.to(DEV), prepared, promote, tile=tile)
    assert torch.equal(chosen, default if persistent_ok(m, n, k, sm_count(DEV)) else ptr)
    with pytest.raises(ValueError, match="persistent"):
        tg.gemm_fp8_folded(fq.to(DEV), rs.to(DEV), prepared, promote, split=2, persistent=True)


@needs_kernels
@pytest.mark.parametrize("k,segments", [(640, 2), (640, 3), (608, 2)])
def test_segments_give_the_bits_of_the_split(monkeypatch, k: int, segments: int) -> None:
    """`segments=s` (one program adding the partial sums of an s-way K split in order) stores
    the bits of `split=s` (s programs and the fixed-order reduce), with a ragged last block."""
    from shoal.ops.triton import gemm as tg

    if INTERP:
        patch_interpreter(monkeypatch)
    m, n = 70, 64
    xb, q, qs, wc, ws = _inputs(m, n, k, 60 + k + segments, True)
    fq, rs = _fold_act(q, qs)
    prepared = tg.prepare_fp8_weight(wc.to(DEV), ws.to(DEV))
    args = (fq.to(DEV), rs.to(DEV), prepared, tg.PROMOTED)
    tile = (64, 64, 128, 4, 2)
    split = tg.gemm_fp8_folded(*args, split=segments, tile=tile, persistent=False).cpu()
    one = tg.gemm_fp8_folded(*args, segments=segments, tile=tile, persistent=False).cpu()
    assert torch.equal(one.view(torch.int16), split.view(torch.int16))
    with pytest.raises(ValueError, match="segments"):
        tg.gemm_fp8_folded(*args, segments=segments, split=2)


@pytest.mark.skipif(INTERP or not torch.cuda.is_available(), reason="sm_90 wgmma bits")
def test_invariant_op_rows_do_not_depend_on_the_row_count() -> None:
    """The batch-invariant op: a row's bits are the same alone, in a decode-sized call and in
    calls of 65 .. 2048 rows (where the default op changes split and kernel), and decode sizes
    give exactly the default op's bits."""
    from shoal.ops.triton import gemm as tg

    n, k = 1024, 5120  # splits 8 ways at decode sizes on an H200
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2048, k, generator=g).to(torch.bfloat16).to(DEV)
    wc, ws = quant_fp8_weight(torch.randn(n, k, generator=g) / k**0.5, 32)
    kw = dict(weight=wc.to(DEV), weight_scale=ws.to(DEV), block=32)
    assert tg.split_k(1, n, k, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    whole = tg.gemm_fp8_invariant(x=x, **kw)
    for r in (1, 7, 64, 65, 300):
        part = tg.gemm_fp8_invariant(x=x[:r], **kw)
        assert torch.equal(part.view(torch.int16), whole[:r].view(torch.int16)), r
    assert torch.equal(tg.gemm_fp8_invariant(x=x[:33], **kw), tg.gemm_fp8(x=x[:33], **kw))


@pytest.mark.skipif(INTERP or not torch.cuda.is_available(), reason="sm_90 MMA bits")
def test_grouped_invariant_rows_do_not_depend_on_the_row_count() -> None:
    """The 16-row (mma.sync) decode tiles and the wide (wgmma) tiles of the grouped projection
    give different bits; the batch-invariant op keeps the wide tiles, so a row's bits are the
    same alone and among 256 rows."""
    from shoal.ops.triton import gemm_grouped as tgg

    g = torch.Generator().manual_seed(9)
    o = torch.randn(256, 8, 512, generator=g).to(torch.bfloat16).to(DEV)
    wc, ws = quant_fp8_weight(torch.randn(8 * 256, 512, generator=g) / 512**0.5, 32)
    kw = dict(weight=wc.to(DEV), weight_scale=ws.to(DEV))
    whole = tgg.gemm_grouped_w8a16_invariant(o=o, **kw)
    for r in (1, 3, 16, 17, 64):
        part = tgg.gemm_grouped_w8a16_invariant(o=o[:r], **kw)
        assert torch.equal(part.view(torch.int16), whole[:r].view(torch.int16)), r
