"""Triton MoE kernels (src/shoal/ops/triton/moe.py) against independent computations.

Runs on CUDA (sm_90), or on the CPU under the Triton interpreter (TRITON_INTERPRET=1 set before
the run; the portable non-asm weight conversion is used there). Skipped otherwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from support.triton_interpreter import (  # noqa: E402
    DEV,
    INTERP,
    ON_GPU,
    needs_kernels,
    patch_interpreter,
)

pytestmark = needs_kernels

from shoal.ops.reference import moe as ref  # noqa: E402
from shoal.ops.triton import moe as tmoe  # noqa: E402
from shoal.ops.triton import moe_route as troute  # noqa: E402
from shoal.ops.triton import moe_tiles as tiles  # noqa: E402
from shoal.ops.triton import router as trouter  # noqa: E402
from shoal.quant.fp4 import dequant_mxfp4, quant_mxfp4  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_shims(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERP and not ON_GPU:  # the MoE kernels' bf16 dots (range bound)
        patch_interpreter(monkeypatch)


def _weights(g: torch.Generator, e: int, n: int, k: int, spread: int = 0):
    """MXFP4 weights [e, n, k]; spread > 0 multiplies random 32-blocks by 2^-U(0, spread)."""
    w = torch.randn(e, n, k, generator=g) / k**0.5
    if spread:
        pw = torch.randint(0, spread + 1, (e, n, k // 32), generator=g).float()
        w = w * torch.exp2(-pw).repeat_interleave(32, -1)
    p, s = quant_mxfp4(w, 32)
    return p.to(DEV), s.to(DEV)


def _case(seed: int, t: int, d: int, inter: int, e: int, k: int, spread: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w13, s13 = _weights(g, e, 2 * inter, d, spread)
    w2, s2 = _weights(g, e, d, inter, spread)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    x = (torch.randn(t, d, generator=g) * 2).to(torch.bfloat16)
    return {"x": x.to(DEV), "ids": ids.to(DEV), "weights": torch.rand(t, k, generator=g).to(DEV),
            "w13": w13, "w13_scale": s13, "w2": w2, "w2_scale": s2, "limit": 10.0}


def _cpu(kw: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


# On sm_90 the FP8 wgmma tiles (swap-AB, and plain tiles of >= 64 rows) add products in
# reduced precision (~14 fraction bits kept when aligning to the largest, DeepSeek-V3 report
# §3.3.2), and h is re-quantised to e4m3 before w2, where a last-bit change of h can move an
# element by one e4m3 step (2^-3 relative). Measured on the H200 (2026-11-29): relative error 0.0047
# (mma.sync tiles) vs 0.0075 (wgmma tiles) on the spread-9 case, single elements off by 3% of
# their value. The interpreter is exact, so the tight bounds hold there.
ON_DEVICE_TOL = (5e-2, 5e-2, 1e-2) if ON_GPU else (2e-2, 2e-2, 5e-3)


def _check(got: torch.Tensor, want: torch.Tensor):
    atol, rtol, rel_max = ON_DEVICE_TOL
    got = got.cpu()
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    err = (got - want).abs()
    assert (err <= atol + rtol * want.abs()).all(), f"max err {err.max():.4g}"
    rel = (got - want).norm() / want.norm()
    assert rel < rel_max, f"relative error {rel:.3g}"

SWAP = (tiles.TileConfig(16, 64, 256, 4, 4, swap_ab=True),) * 2
PLAIN = (tiles.TileConfig(16, 32, 256, 4, 4), tiles.TileConfig(16, 64, 256, 4, 4))
PLAIN_2WARPS = tuple(dataclasses.replace(c, num_warps=2) for c in PLAIN)
BIG = (tiles.TileConfig(128, 64, 128, 8, 3), tiles.TileConfig(128, 128, 128, 8, 3))
BIG_SWAP = (tiles.TileConfig(64, 64, 128, 4, 3, swap_ab=True),) * 2
SWAP_PROMOTED = (tiles.TileConfig(16, 64, 256, 4, 4, swap_ab=True, promote=True),) * 2
BIG_PROMOTED = (tiles.TileConfig(128, 64, 128, 8, 3, promote=True),
                tiles.TileConfig(128, 128, 128, 8, 3, promote=True))
PREFILL_DEFAULT = tiles.default_configs(8192 * 6, 384)  # w13 at BLOCK_K 256


@pytest.mark.parametrize("t,d,inter,e,k,spread", [(1, 64, 32, 4, 2, 0), (7, 128, 64, 8, 2, 0),
                                                   (83, 128, 64, 8, 3, 0), (19, 256, 96, 6, 3, 6)])
def test_w4a8_matches_reference(t: int, d: int, inter: int, e: int, k: int, spread: int) -> None:
    kw = _case(1000 + t, t, d, inter, e, k, spread)
    want = ref.moe_mxfp4(**_cpu(kw))
    got = tmoe.moe_experts(**kw)
    _check(got, want)


@pytest.mark.parametrize("t", [0, 1, 19])
def test_w4a8_with_shared_addend_rounds_once(t: int) -> None:
    """`shared` (the shared expert's bf16 output) is added to the fp32 routed sum in the combine
    and the total rounded once to bf16: equal to bf16(moe_experts(...) + shared) bit for bit,
    and within tolerance of the reference op called the same way."""
    kw = _case(3000 + t, t, 128, 64, 8, 3) if t else {
        **_case(3000, 1, 128, 64, 8, 3), "x": torch.zeros(0, 128, dtype=torch.bfloat16,
                                                          device=DEV),
        "ids": torch.zeros(0, 3, dtype=torch.long, device=DEV),
        "weights": torch.zeros(0, 3, device=DEV)}
    shared = (torch.randn(t, 128, generator=torch.Generator().manual_seed(t)) * 3).to(
        torch.bfloat16).to(DEV)
    got = tmoe.moe_experts(**kw, shared=shared)
    assert got.dtype == torch.bfloat16 and got.shape == (t, 128)
    routed = tmoe.moe_experts(**kw)
    assert torch.equal(got, (routed + shared.float()).to(torch.bfloat16))
    want = ref.moe_mxfp4(**_cpu(kw), shared=shared.cpu())
    assert want.dtype == torch.bfloat16
    if t:
        _check(got.float(), want.float())
    with pytest.raises(ValueError, match="shared"):
        tmoe.moe_experts(**kw, shared=shared[:, :64])


@pytest.mark.parametrize("name,configs", [("swap", SWAP), ("plain", PLAIN), ("big", BIG),
                                          ("big_swap", BIG_SWAP), ("swap_promoted", SWAP_PROMOTED),
                                          ("big_promoted", BIG_PROMOTED),
                                          ("prefill_default", PREFILL_DEFAULT)])
def test_w4a8_tile_families_match_reference(name: str, configs: tuple) -> None:
    """Every tile orientation (swap-AB or plain) and size, with N and K not multiples of the
    tile and several row blocks per expert (D 512 for the default prefill pair, so that its
    w13 steps K by 256)."""
    d = 512 if name == "prefill_default" else 160
    kw = _case(2000 + len(name), 25, d, 96, 4, 3, spread=4)
    want = ref.moe_mxfp4(**_cpu(kw))
    _check(tmoe.moe_experts(**kw, configs=configs), want)


@pytest.mark.parametrize("rows_k", [(1, 1), (1, 6), (7, 2), (83, 3), (200, 6)])
def test_route_kernel_equals_stable_argsort(rows_k: tuple[int, int]) -> None:
    """The one-launch counting sort gives exactly torch's stable argsort permutation and the
    scatter-add counts (many ties, experts with no rows, E not a multiple of the block)."""
    t, k = rows_k
    e = 70
    g = torch.Generator().manual_seed(31 * t + k)
    ids = torch.randint(0, 9 if t > 50 else e, (t, k), generator=g)  # heavy ties when large
    w = torch.rand(t, k, generator=g)
    got = troute.route(ids.to(DEV), w.to(DEV), e)
    want = troute.route(ids.to(DEV), w.to(DEV), e, max_kernel_rows=0)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    assert int(got[3].sum()) == t * k


def test_route_puts_rows_of_no_expert_last_and_counts_them_nowhere() -> None:
    """id E (expert parallelism's padding rows): both sorts agree, the real rows come first in
    the same order as without the padding, and the counts are the real rows'."""
    e, g = 16, torch.Generator().manual_seed(5)
    real = torch.randint(0, e, (37, 1), generator=g)
    ids = torch.cat([real, torch.full((20, 1), e)])[torch.randperm(57, generator=g)]
    w = torch.rand(57, 1, generator=g)
    got = troute.route(ids.to(DEV), w.to(DEV), e)
    want = troute.route(ids.to(DEV), w.to(DEV), e, max_kernel_rows=0)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    tok, counts = got[0].cpu(), got[3].cpu()
    assert torch.equal(counts, torch.bincount(real.flatten(), minlength=e).int())
    assert torch.equal(tok[:37], torch.argsort(ids.flatten(), stable=True)[:37].int())


@pytest.mark.skipif(not ON_GPU, reason="prmt inline asm needs the device")
@pytest.mark.parametrize("variant", [None, 1, 2, 3])
@pytest.mark.parametrize("name,configs", [("default", None), ("swap", SWAP), ("plain", PLAIN),
                                          ("plain_2warps", PLAIN_2WARPS),
                                          ("big", BIG), ("big_swap", BIG_SWAP)])
def test_w4a8_asm_equals_portable_conversion(name: str, configs, variant) -> None:
    """Both prmt conversions on every tile family give the portable conversion's bits (the asm
    relies on 4 packed elements being 4 consecutive K of one weight row; spread = 9 makes every
    row's 32-blocks use different LUTs, so a wrong packing shows)."""
    kw = _case(7, 40, 512, 256, 16, 6, spread=9)
    if variant == 2 and not (configs or tiles.default_configs(40 * 6, 16))[0].swap_ab:
        # variant 2 assumes 4 consecutive K per register; the H200 gave wrong bits on 128-row
        # plain tiles, so it is refused there
        with pytest.raises(ValueError, match="swap-AB"):
            tmoe.moe_experts(**kw, use_asm=True, asm_variant=variant, configs=configs)
        return
    if variant == 3 and not (configs or tiles.default_configs(40 * 6, 16))[0].f16:
        with pytest.raises(ValueError, match="f16 tiles"):
            tmoe.moe_experts(**kw, use_asm=True, asm_variant=variant, configs=configs)
        return
    a = tmoe.moe_experts(**kw, use_asm=True, asm_variant=variant, configs=configs)
    b = tmoe.moe_experts(**kw, use_asm=False, configs=configs)
    assert torch.equal(a, b)
    _check(a, ref.moe_mxfp4(**_cpu(kw)))


@pytest.mark.parametrize("bk", [128, pytest.param(256, marks=pytest.mark.skipif(
    INTERP, reason="the same tile logic as 128 on the interpreter; the device runs both"))])
def test_fused_gate_up_gives_the_split_tiles_bits(bk: int) -> None:
    """`TileConfig.fused_gate_up` (gate and up rows interleaved in one weight tile, one MMA
    chain per step) forms every output from the same products in the same K order as the split
    gate / up chains, so h and y are bit-equal; N (96) is not a multiple of BLOCK_N and experts
    span several 128-row blocks. Only plain W4A8 w13 tiles take it."""
    split = (tiles.TileConfig(128, 64, bk, 8, 3, promote=True),
             tiles.TileConfig(128, 64, 128, 8, 3, promote=True))
    fused = (dataclasses.replace(split[0], fused_gate_up=True), split[1])
    kw = _case(4000 + bk, 300, 512, 96, 3, 2, spread=4)
    got = tmoe.moe_experts(**kw, configs=fused)
    assert torch.equal(got, tmoe.moe_experts(**kw, configs=split))
    _check(got, ref.moe_mxfp4(**_cpu(kw)))
    with pytest.raises(ValueError, match="fused_gate_up"):
        tmoe.moe_experts(**kw, configs=(dataclasses.replace(SWAP[0], fused_gate_up=True),
                                        SWAP[1]))


@needs_kernels
@pytest.mark.parametrize("use_asm", [False, True])
def test_f16_tiles_give_the_e4m3_tiles_bits(use_asm: bool) -> None:
    """The decode tiles' fp16 weight path (`TileConfig.f16`, the default) feeds the MMA the same
    fp16 operand values as the e4m3 path wherever both are exact (every block within 8 binades
    of its row's largest: spread 4 here), so the bits are equal; with blocks up to 12 binades
    down (spread 12) the fp16 path stays exact where e4m3 rounds, and both pass the op's check."""
    if use_asm and not ON_GPU:
        pytest.skip("prmt inline asm needs the device")
    f16 = tuple(dataclasses.replace(c, f16=True) for c in PLAIN)
    e4m3 = tuple(dataclasses.replace(c, f16=False) for c in PLAIN)
    kw = _case(13, 9, 256, 128, 8, 6, spread=4)
    a = tmoe.moe_experts(**kw, use_asm=use_asm, configs=f16)
    assert torch.equal(a, tmoe.moe_experts(**kw, use_asm=use_asm, configs=e4m3))
    kw = _case(14, 9, 256, 128, 8, 6, spread=12)
    want = ref.moe_mxfp4(**_cpu(kw))
    _check(tmoe.moe_experts(**kw, use_asm=use_asm, configs=f16), want)
    with pytest.raises(ValueError, match="f16 tiles"):
        tmoe.moe_experts(**kw, configs=(dataclasses.replace(SWAP[0], f16=True),) * 2)


@pytest.mark.skipif(not ON_GPU, reason="a property of the device's mma.sync")
@pytest.mark.parametrize("configs", [
    PLAIN_2WARPS, None, (tiles.TileConfig(16, 16, 128, 2, 4), tiles.TileConfig(16, 32, 128, 2, 4)),
    (tiles.TileConfig(16, 32, 64, 2, 8), tiles.TileConfig(16, 64, 128, 2, 4)),
    tiles.INVARIANT_PREFILL], ids=["2warps", "default", "n16k128", "n32k64", "invariant_prefill"])
def test_plain_tiles_bits_do_not_depend_on_the_tile(configs) -> None:
    """Warps per program, BLOCK_N, BLOCK_K (>= 64) and BLOCK_M (< 64) of the mma.sync tiles
    move rows, columns and loop steps between programs, never the K order of a sum (mma.sync
    chained along K in ascending steps), so the bits are those of the 4-warp 16x32x256 tiles."""
    kw = _case(11, 40, 512, 256, 16, 6, spread=3)
    assert torch.equal(tmoe.moe_experts(**kw, configs=configs),
                       tmoe.moe_experts(**kw, configs=PLAIN))


@pytest.mark.skipif(not ON_GPU, reason="a property of the device's tensor cores")
@pytest.mark.xfail(reason="known, open: decode tiles (mma.sync, exact accumulation) and prefill "
                   "tiles (FP8 wgmma, reduced-precision accumulation) give different bits; "
                   "needs promoted wgmma accumulation (see moe.default_configs)", strict=False)
def test_batch_invariance() -> None:
    """A token's output is bitwise the same alone (T = 1, 3), in a T = 40 batch (15 rows per
    expert) and in a T = 120 batch (45 rows per expert: plain 128-row tiles), default configs
    (the op's path: asm conversion)."""
    kw = _case(9, 120, 512, 256, 16, 6, spread=3)
    full = tmoe.moe_experts(**kw)
    for t in (1, 3, 40):
        part = {n: (v[:t] if n in ("x", "ids", "weights") else v) for n, v in kw.items()}
        got = tmoe.moe_experts(**part)
        assert torch.equal(got, full[:t]), (t, float((got - full[:t]).abs().max()))


def test_invariant_backend_is_batch_invariant() -> None:
    """The batch-invariant backend (`RunnerConfig.batch_invariant`): the same token alone and in
    batches of 3, 60 and 90 (45 rows per expert, where the default op takes its wgmma tiles)
    gets the same bits, and they are those of the default op's 16-row tiles."""
    kw = _case(9, 90, 128, 64, 4, 2, spread=3)
    full = tmoe.moe_mxfp4_invariant(**kw)
    for t in (1, 3, 60):
        part = {n: (v[:t] if n in ("x", "ids", "weights") else v) for n, v in kw.items()}
        assert torch.equal(tmoe.moe_mxfp4_invariant(**part), full[:t]), t
        if t == 60:  # 30 rows per expert: the default op's 16-row tiles
            assert torch.equal(tmoe.moe_mxfp4(**part), full[:t])


def test_w4a16_matches_fp32_bf16_computation() -> None:
    """Baseline: bf16 activations x exactly dequantised weights (no activation quantisation)."""
    kw = _case(5, 9, 128, 64, 4, 2)
    c = _cpu(kw)
    out = torch.zeros(9, 128)
    inter = 64
    for ti in range(9):
        for j in range(2):
            ex = int(c["ids"][ti, j])
            gu = c["x"][ti].float() @ dequant_mxfp4(c["w13"][ex], c["w13_scale"][ex]).t()
            gu = gu.to(torch.bfloat16).float()
            h = ref.swiglu_clamp(gate=gu[None, :inter], up=gu[None, inter:],
                                 weight=c["weights"][ti, j:j + 1], limit=10.0)
            y = h.float() @ dequant_mxfp4(c["w2"][ex], c["w2_scale"][ex]).t()
            out[ti] += y[0].to(torch.bfloat16).float()
    _check(tmoe.moe_w4a16(**kw), out)


def test_empty_batch() -> None:
    g = torch.Generator().manual_seed(0)
    w13, s13 = _weights(g, 4, 64, 64)
    w2, s2 = _weights(g, 4, 64, 32)
    out = tmoe.moe_experts(torch.zeros(0, 64, dtype=torch.bfloat16, device=DEV),
                           torch.zeros(0, 2, dtype=torch.long, device=DEV),
                           torch.zeros(0, 2, device=DEV), w13, s13, w2, s2, 10.0)
    assert out.shape == (0, 64) and out.dtype == torch.float32


def test_router_matches_reference_and_pins_ties() -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(37, 256, generator=g).to(torch.bfloat16)
    w = (torch.randn(64, 256, generator=g) / 16).to(torch.bfloat16)
    bias = torch.randn(64, generator=g) * 0.1
    bias[5] = bias[9] = 50.0  # far above every score, and w[5] == w[9]: a tie on every row
    w[9] = w[5]
    ids, wt = trouter.router(x=x.to(DEV), weight=w.to(DEV), bias=bias.to(DEV), k=6,
                          route_scale=1.5)
    rids, rwt = ref.router(x=x, weight=w, bias=bias, k=6, route_scale=1.5)
    assert torch.equal(ids.cpu(), rids)
    assert (ids[:, 0] == 5).all() and (ids[:, 1] == 9).all()
    assert torch.equal(wt.cpu(), rwt)  # fp64 logits, softplus and renormalisation: same bits


@pytest.mark.parametrize("t", [1, 5, 33])
def test_router_logit_groups_sum_to_the_fp64_logits(t) -> None:
    """The router's fp64 workspace: one row per group of 128-column K slices (11 slices, the last
    partial, in 6 groups of 2 at D = 1300), whose in-order sum is the fp64 logit (products of
    bf16 are exact in fp64, so only the summation order separates it from an fp64 matmul)."""
    g = torch.Generator().manual_seed(1000 + t)
    d, e = 1300, 70
    x = (torch.randn(t, d, generator=g) * 2).to(torch.bfloat16)
    w = (torch.randn(e, d, generator=g) / 8).to(torch.bfloat16)
    ws = trouter.logit_partials(x.to(DEV), w.to(DEV)).cpu()
    assert ws.shape == (6, t, e) and ws.dtype == torch.float64
    logits = torch.zeros(t, e, dtype=torch.float64)
    for row in ws:
        logits = logits + row
    assert torch.allclose(logits, x.double() @ w.double().T, rtol=1e-12, atol=1e-12)
    for grp in range(6):  # each row is its own group's columns
        cols = slice(256 * grp, min(256 * grp + 256, d))
        assert torch.allclose(ws[grp], x[:, cols].double() @ w[:, cols].double().T,
                              rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t", [3, 150])
def test_router_logit_tile_does_not_change_bits(t) -> None:
    """The logits kernel's (tokens, experts, warps, stages) tile moves rows and columns between
    programs, never the K order of a logit: the wide tile's fp64 workspace equals the default's
    bit for bit (D 1300: a partial last slice; E 70: a partial expert tile)."""
    g = torch.Generator().manual_seed(77 + t)
    d, e = 1300, 70
    x = (torch.randn(t, d, generator=g) * 2).to(torch.bfloat16).to(DEV)
    w = (torch.randn(e, d, generator=g) / 8).to(torch.bfloat16).to(DEV)
    base = trouter.logit_partials(x, w)
    for tile in (trouter.WIDE_TILE, trouter.MID_TILE, (32, 64, 4, 2)):
        assert torch.equal(trouter.logit_partials(x, w, tile), base), tile


def test_router_is_batch_invariant_across_its_tile_switch() -> None:
    """The op takes the wide logits tile from WIDE_FROM tokens on: a token routes the same
    (ids and weights bit for bit) alone, in a small batch and in a batch past the switch."""
    g = torch.Generator().manual_seed(5)
    t, d, e = trouter.WIDE_FROM + 7, 640, 70
    x = (torch.randn(t, d, generator=g) * 2).to(torch.bfloat16).to(DEV)
    w = (torch.randn(e, d, generator=g) / 8).to(torch.bfloat16).to(DEV)
    bias = (torch.randn(e, generator=g) * 0.1).to(DEV)
    assert trouter.logits_tile(t) == trouter.WIDE_TILE != trouter.logits_tile(3)
    big = trouter.router(x=x, weight=w, bias=bias, k=6, route_scale=1.5)
    small = trouter.router(x=x[-3:], weight=w, bias=bias, k=6, route_scale=1.5)
    one = trouter.router(x=x[-1:], weight=w, bias=bias, k=6, route_scale=1.5)
    for got in (small, one):
        n = got[0].shape[0]
        assert torch.equal(got[0], big[0][-n:]) and torch.equal(got[1], big[1][-n:])


@pytest.mark.parametrize("t,e,k,temp", [(1, 64, 6, 1.0), (29, 70, 6, 0.7), (5, 256, 8, 1.0),
                                        (3, 16, 1, 2.0), (0, 64, 6, 1.0)])
def test_router_selection_kernel_matches_reference(t, e, k, temp) -> None:
    """The one-launch selection (`_select_kernel`) against the reference router: logits of
    both signs and up to |40| (softplus's x > 20 pass-through and its tiny-exp branch), many
    equal scores (ties go to the lower id), odd E; weights bit for bit."""
    g = torch.Generator().manual_seed(100 * t + e)
    x = (torch.randn(t, 128, generator=g) * 4).to(torch.bfloat16)
    w = (torch.randn(e, 128, generator=g) / 4).to(torch.bfloat16)
    w[1::3] = w[0]  # equal rows: equal scores, ties on every token
    bias = torch.zeros(e)
    bias[::5] = torch.randn(len(bias[::5]), generator=g) * 0.5
    ids, wt = trouter.router(x=x.to(DEV), weight=w.to(DEV), bias=bias.to(DEV), k=k,
                          route_scale=1.5, gate_temp=temp)
    rids, rwt = ref.router(x=x, weight=w, bias=bias, k=k, route_scale=1.5, gate_temp=temp)
    assert ids.dtype == torch.int64 and ids.shape == (t, k) and wt.shape == (t, k)
    assert torch.equal(ids.cpu(), rids)
    assert torch.equal(wt.cpu(), rwt)

