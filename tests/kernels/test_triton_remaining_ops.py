"""Triton kernels of the last reference-only ops (engram_hash, engram_gather, engram_mix, compress_pool,
swa_indices, mask_logits, paged_rows) against the reference: every case of the ops' conformance grids
(contiguous and strided), then larger and harder inputs the grids do not cover (D 512 pooling
over several requests with chunks starting at odd positions and a state entry that is read and
re-parked in one step, row ids across several close-kernel blocks, all 256 e4m3 codes and the UE8M0
extremes, Engram Dh 256 x n 24 x T 37).

Runs on CUDA (sm_90), or on the CPU under the Triton interpreter (TRITON_INTERPRET=1 set before
the run). Under the interpreter one of its defects is patched for this module: a scalar's
`__index__` fails with NumPy 2 (runtime `range` bounds). The kernels round fp32 -> bf16 on the
bits themselves, so the interpreter's truncating cast is not involved.
"""

from __future__ import annotations

import zlib

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

from shoal.ops import reference  # noqa: E402, F401  (registers the definitions)
from shoal.ops.reference import engram as rengram  # noqa: E402
from shoal.ops.registry import REGISTRY, OpDef  # noqa: E402
from shoal.ops.triton import engram as tengram  # noqa: E402
from shoal.ops.triton import pool as tpool  # noqa: E402
from shoal.quant.fp8 import quant_fp8_act  # noqa: E402

OPS = ("engram_hash", "engram_gather", "engram_mix", "compress_pool", "swa_indices",
       "mask_logits", "paged_rows")


@pytest.fixture(autouse=True)
def _interpreter_shims(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERP and not ON_GPU:
        patch_interpreter(monkeypatch, bf16=False)


# ----------------------------------------------------------------------------- helpers


def _to(kw: dict, device: torch.device) -> dict:
    return {k: v.detach().to(device).clone() if isinstance(v, torch.Tensor) else v
            for k, v in kw.items()}


def _strided(kw: dict, skip: tuple[str, ...]) -> dict:
    """Float tensors of >= 2 dims -> same values in transposed storage (as in conformance)."""
    out = {}
    for k, v in kw.items():
        if (k not in skip and isinstance(v, torch.Tensor) and v.dtype.is_floating_point
                and v.dim() >= 2 and v.shape[-1] > 1 and v.shape[-2] > 1 and v.numel()):
            v = v.transpose(-1, -2).contiguous().transpose(-1, -2)
        out[k] = v
    return out


def _outs(op: OpDef, result, kw: dict) -> list[tuple[str, torch.Tensor]]:
    res = list(result) if isinstance(result, (tuple, list)) else [result]
    return [(f"out[{i}]", r) for i, r in enumerate(res)] + [(n, kw[n]) for n in op.inplace]


def _assert_close(op: OpDef, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.detach().cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{name}: {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}")
    if not want.dtype.is_floating_point:
        assert torch.equal(got, want), f"{name}: {(got != want).sum()} elements differ"
        return
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan()), f"{name}: NaN positions differ"
    assert torch.equal(g.isinf() & (g > 0), w.isinf() & (w > 0)), f"{name}: +inf differs"
    assert torch.equal(g.isinf() & (g < 0), w.isinf() & (w < 0)), f"{name}: -inf differs"
    fin = w.isfinite()
    tol = op.tolerances.get(want.dtype)
    if tol is None or (tol.atol == 0 and tol.rtol == 0):
        assert torch.equal(g[fin], w[fin]), f"{name}: {(g[fin] != w[fin]).sum()} differ (exact)"
        return
    err = (g - w).abs()[fin]
    lim = tol.atol + tol.rtol * w.abs()[fin]
    assert (err <= lim).all(), f"{name}: worst excess {(err - lim).max():.3g}"


def _run_both(name: str, kw: dict, strided: bool = False) -> None:
    """Triton on DEV vs the reference on CPU for the same inputs (in-place kwargs compared
    whole: entries the op must not write hold the same garbage in both)."""
    op = REGISTRY.ops[name]
    impl = REGISTRY.impl("triton", name)
    ref_kw = _to(kw, torch.device("cpu"))
    run_kw = _to(kw, DEV)
    if strided:
        run_kw = _strided(run_kw, op.inplace)
    assert impl.supports(**run_kw), f"{name}: triton declined the inputs"
    got = impl.fn(**run_kw)
    want = op.reference(**ref_kw)
    for (n, g), (_, w) in zip(_outs(op, got, run_kw), _outs(op, want, ref_kw), strict=True):
        _assert_close(op, f"{name}/{n}", g, w)


def _poison(kw: dict, names: tuple[str, ...], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    for n in names:
        t = kw[n]
        t.copy_((torch.randn(t.shape, generator=g) * 1e3 + 7.0).to(t.dtype))
    return kw


# ----------------------------------------------------------------------------- case grids


def _grid() -> list:
    params = []
    for name in OPS:
        for case in REGISTRY.ops[name].cases:
            for strided in (False, True):
                params.append(pytest.param(name, case, strided,
                                           id=f"{name}-{case.name}{'-strided' * strided}"))
    return params


@pytest.mark.parametrize("name,case,strided", _grid())
def test_case_grid(name: str, case, strided: bool) -> None:
    seed = zlib.crc32(f"{name}/{case.name}".encode()) & 0x7FFFFFFF
    kw = case.make(torch.Generator().manual_seed(seed), torch.device("cpu"))
    _run_both(name, _poison(kw, REGISTRY.ops[name].inplace, seed ^ 0x5A5A), strided)


def test_triton_implements_every_op() -> None:
    for name in OPS:
        assert REGISTRY.impl("triton", name) is not None, name


# ----------------------------------------------------------------------------- compress_pool


def _pool_inputs(seed: int, lengths, starts, ratio: int, dim: int, order=None,
                 ring: int | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    slot = torch.cat([torch.full((n,), 2 * i + 1) for i, n in enumerate(lengths)])  # sparse
    if order is not None:
        pos, slot = pos[order], slot[order]
    s = 2 * len(lengths) + 1
    return {"kv": torch.randn(t, dim, generator=g) * 3,
            "score": torch.randn(t, dim, generator=g) * 4,
            "positions": pos, "slots": slot,
            "state_kv": torch.randn(s, ring or ratio, dim, generator=g) * 3,
            "state_score": torch.randn(s, ring or ratio, dim, generator=g) * 4, "ratio": ratio}


@pytest.mark.parametrize("lengths,starts,ratio,dim,ring", [
    ((9, 1, 6, 4, 3), (3, 7, 1, 0, 5), 2, 512, None),  # odd starts close the parked group
    ((8, 3, 5), (2, 9, 0), 4, 512, None),  # entries 0, 1 read by group 0, re-parked by 8, 9
    ((7, 5, 2), (1, 4, 2), 3, 96, None),  # ratio and D not powers of two
    ((1, 1, 1, 1), (1, 2, 7, 0), 2, 64, None),  # decode rows
    ((13, 2, 6), (5, 8, 1), 2, 512, 7),  # ring of 7 > r: the last 7 positions parked
    ((11, 4), (3, 2), 4, 64, 9),  # ring 9, ratio 4: read entries overwritten this step
])
def test_compress_pool_several_requests(lengths, starts, ratio, dim, ring) -> None:
    _run_both("compress_pool", _pool_inputs(11, lengths, starts, ratio, dim, ring=ring))


def test_compress_pool_multi_block_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens span several close-kernel blocks (block shrunk to 8): row ids and each slot's last
    position (atomic max across blocks)."""
    monkeypatch.setattr(tpool, "SCAN_BLOCK", 8)
    _run_both("compress_pool", _pool_inputs(12, (21, 2, 17, 9), (3, 0, 6, 11), 2, 32))


def test_compress_pool_interleaved_tokens() -> None:
    """Token order need not group requests: members are matched by (slot, position) and the
    parked group by each slot's last position, as in the reference."""
    order = torch.randperm(20, generator=torch.Generator().manual_seed(5))
    _run_both("compress_pool", _pool_inputs(13, (7, 6, 7), (1, 0, 4), 2, 64, order=order))


@pytest.mark.parametrize("ring", [2, 7])
def test_compress_pool_chunked_equals_whole(ring: int) -> None:
    """A request prefilled in odd-sized chunks through the carried state pools the same rows as
    one whole pass (independent of the reference)."""
    g = torch.Generator().manual_seed(21)
    n, d, r = 23, 512, 2
    kv, score = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    pos = torch.arange(n)

    def run(bounds):
        st_kv = torch.zeros(1, ring, d, device=DEV)
        st_sc = torch.full((1, ring, d), -torch.inf, device=DEV)
        pooled, rows = [], []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            p, j = tpool.compress_pool(
                kv=kv[a:b].to(DEV), score=score[a:b].to(DEV), positions=pos[a:b].to(DEV),
                slots=torch.zeros(b - a, dtype=torch.long, device=DEV), state_kv=st_kv,
                state_score=st_sc, ratio=r)
            keep = j.cpu() >= 0  # tokens closing a group
            pooled.append(p.cpu()[keep])
            rows.append(j.cpu()[keep])
        return torch.cat(pooled), torch.cat(rows)

    whole = run([0, n])
    chunked = run([0, 3, 4, 9, 10, 11, 16, n])
    assert torch.equal(whole[1], torch.arange(n // r))
    assert torch.equal(chunked[1], whole[1])
    assert torch.equal(chunked[0].view(torch.int16), whole[0].view(torch.int16))


def test_compress_pool_empty_and_no_closing() -> None:
    _run_both("compress_pool", _pool_inputs(14, (0,), (4,), 2, 32))
    _run_both("compress_pool", _pool_inputs(15, (1, 1), (0, 4), 2, 32))  # nothing closes


# ----------------------------------------------------------------------------- engram


def test_engram_gather_large() -> None:
    g = torch.Generator().manual_seed(31)
    rows, dh, t, n = 3000, 256, 37, 24
    codes, scales = quant_fp8_act(torch.randn(rows, dh, generator=g) * 5, 32)
    ids = torch.randint(0, rows, (t, n), generator=g)
    _run_both("engram_gather", {"table": codes, "table_scale": scales, "row_ids": ids})
    _run_both("engram_gather", {"table": codes, "table_scale": scales,
                                "row_ids": ids.to(torch.int32)})


@pytest.mark.filterwarnings("ignore:overflow encountered")  # byte 254: inf on purpose
def test_engram_gather_every_code_and_scale_bit_exact() -> None:
    """All 256 e4m3 codes (subnormals, +/-0, NaN codes) under UE8M0 bytes 0 (subnormal scale,
    products round onto the bf16 subnormal grid), 1, 100, 127, 134, 254 (overflow to inf) and
    255 (NaN), compared bit for bit (NaN as NaN)."""
    exps = torch.tensor([0, 1, 100, 127, 134, 254, 255], dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.uint8).repeat(len(exps), 1)  # [7, 256]
    scales = exps.unsqueeze(1).repeat(1, 8)
    ids = torch.arange(len(exps)).flip(0).view(1, -1)
    table = codes.view(torch.float8_e4m3fn)
    want = rengram.engram_gather(table=table, table_scale=scales, row_ids=ids)
    got = tengram.engram_gather(table=table.to(DEV), table_scale=scales.to(DEV),
                                row_ids=ids.to(DEV)).cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert (want[~nan].float().abs() < 2**-126).any()  # the subnormal rounding was exercised


@pytest.mark.skipif(not ON_GPU, reason="needs a table of > 2^31 bytes on the device")
def test_engram_gather_int64_offsets() -> None:
    rows, dh = (1 << 23) + 1000, 256  # byte offsets beyond 2^31
    table = torch.randint(0, 0x7E, (rows, dh), dtype=torch.uint8, device=DEV)
    scales = torch.randint(100, 140, (rows, dh // 32), dtype=torch.uint8, device=DEV)
    ids = torch.tensor([[rows - 1, 0, rows - 7, (1 << 23) + 3]], device=DEV)
    got = tengram.engram_gather(table=table.view(torch.float8_e4m3fn), table_scale=scales,
                                row_ids=ids)
    want = rengram.engram_gather(table=table.view(torch.float8_e4m3fn), table_scale=scales,
                                 row_ids=ids)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def _mix_inputs(seed: int, t: int, d: int, masked: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    kw = {"stream": (torch.randn(t, 4, d, generator=g) * 2).to(bf),
          "kv": torch.randn(t, 5 * d, generator=g).to(bf),
          "q_weight": (torch.randn(4, d, generator=g) * 0.1 + 1).to(bf),
          "k_weight": (torch.randn(4, d, generator=g) * 0.1 + 1).to(bf), "eps": 1e-20,
          "gate_mask": (torch.rand(t, generator=g) > 0.3) if masked else None}
    # near-orthogonal rows: |dot| lands at the 1e-6 clamp; a zero key row (eps only)
    kw["kv"][0, :d] = 0
    kw["stream"][1, 2] = 0
    return kw


@pytest.mark.parametrize("t,d,masked", [(37, 1024, True), (37, 96, False), (5, 4096, True)])
def test_engram_mix_larger(t: int, d: int, masked: bool) -> None:
    _run_both("engram_mix", _mix_inputs(41, t, d, masked))


def test_engram_mix_gate_values() -> None:
    """Where R = 0 and value = 1 the output is bf16(gate): the fp32 gate rounds to the fp64
    gate's bf16 value or a neighbour (1 ulp), and is exactly 0 at masked tokens."""
    d = 256
    kw = _mix_inputs(42, 23, d)
    kw["stream"][:, :, d // 2:] = 0
    kw["kv"][:, 4 * d:] = 1.0
    got = tengram.engram_mix(**_to(kw, DEV)).cpu()[:, :, d // 2:]
    want = rengram.engram_mix(**kw)[:, :, d // 2:]
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert ulps.max() <= 1, f"gate off by {ulps.max()} bf16 ulps"
    assert (got[~kw["gate_mask"]] == 0).all()
    assert (got[kw["gate_mask"]] > 0).all()


# ----------------------------------------------------------------------------- metadata


def test_swa_indices_larger() -> None:
    g = torch.Generator().manual_seed(51)
    t, window, ring = 300, 128, 133
    pos = torch.randint(0, 600, (t,), generator=g)
    kw = {"positions": pos, "token_index": torch.arange(t),
          "chunk_start": (pos - torch.randint(0, 200, (t,), generator=g)).clamp_min(0),
          "ring_base": torch.randint(0, 9, (t,), generator=g) * ring,
          "floor": torch.randint(-5, 500, (t,), generator=g), "window": window,
          "ring_size": ring, "scratch_base": 9 * ring}
    _run_both("swa_indices", kw)
    _run_both("swa_indices", {**kw, "window": 7, "ring_size": 12})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_logits_special_values(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(61)
    logits = torch.randn(19, 1500, generator=g)
    logits[::3, ::7] = torch.nan
    logits[1::3, ::5] = torch.inf
    logits[2::3, ::4] = -torch.inf
    mask = (torch.rand(1500, 19, generator=g) > 0.4).t()  # strided mask
    _run_both("mask_logits", {"logits": logits.to(dtype), "mask": mask})


def test_engram_hash_flash_constants() -> None:
    """The Flash hash constants (primes near 16M, 99092 compressed ids, n = 4, 8 heads, 2
    layers) on sequences with dead tokens and sequence starts, against the model's definition."""
    from shoal.model.engram_hash import engram_constants, engram_hash, modulo_token_map
    from shoal.model.presets import get_preset

    cfg = get_preset("flash")
    g = torch.Generator().manual_seed(5)
    tmap = modulo_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
    consts = engram_constants(cfg, tmap)
    t, n_hist = 257, cfg.engram_max_ngram_size - 1
    tok = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    pos = torch.randint(0, 5, (t,), generator=g)
    hist = torch.randint(0, cfg.vocab_size, (t, n_hist), generator=g)
    hist = torch.where(torch.rand(t, n_hist, generator=g) < 0.05, -1, hist)
    dead = torch.rand(t, generator=g) < 0.05
    want = engram_hash(tok, pos, hist, dead, tmap, consts)
    ids = torch.cat([tok.unsqueeze(1), hist], dim=1)
    c = consts.to(DEV)
    got = tengram.engram_hash(ids=ids.to(DEV), positions=pos.to(DEV), dead=dead.to(DEV),
                              token_map=tmap.to(DEV), multipliers=c.multipliers, primes=c.primes,
                              offsets=c.offsets, pad_id=c.pad_id).cpu()
    assert torch.equal(got, want)
    assert (want < torch.tensor(consts.rows_per_layer).view(1, -1, 1)).all()
