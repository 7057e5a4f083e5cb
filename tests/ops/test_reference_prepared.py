"""The reference ops' per-table memo (`ops/reference/_prepared.py`): a call with the memo gives
the bits of a call without it, on first use and on every later one (every case of every op that
keeps one, contiguous and strided); an entry is rebuilt when its sources change in place or are
other tensors, and dies with its source; the budget and the device rule hold; each resolved
table has its own memo."""

from __future__ import annotations

import gc
import zlib

import pytest
import torch

from shoal.ops.compare import op_outputs
from shoal.ops.reference._prepared import Prepared
from shoal.ops.reference.gemm import gemm_fp8
from shoal.ops.registry import REGISTRY, load_backends
from shoal.quant.fp8 import quant_fp8_weight

load_backends()

STATEFUL = sorted(name for name, op in REGISTRY.ops.items() if op.state is not None)


def _bits(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().contiguous()
    return x.view(torch.uint8) if x.dtype.is_floating_point else x


def _strided(kwargs: dict) -> dict:
    return {k: v.transpose(-1, -2).contiguous().transpose(-1, -2)
            if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.dim() >= 2
            and min(v.shape[-2:]) > 1 else v for k, v in kwargs.items()}


def test_the_weight_ops_keep_a_memo():
    assert {"gemm_fp8", "gemm_grouped_w8a16", "moe_mxfp4", "rope_tail"} <= set(STATEFUL)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("name", STATEFUL)
def test_a_memo_gives_the_bits_of_no_memo(name: str, strided: bool):
    op = REGISTRY.ops[name]
    for case in (c for c in op.cases if not c.heavy):
        seed = zlib.crc32(f"{name}/{case.name}".encode())
        kwargs = case.make(torch.Generator().manual_seed(seed), torch.device("cpu"))
        if strided:
            kwargs = _strided(kwargs)
        want = op_outputs(op, op.reference(**kwargs), kwargs)
        memo = op.state()
        for call in ("first", "memoised"):
            got = op_outputs(op, op.reference(**kwargs, state=memo), kwargs)
            for (out, g), (_, w) in zip(got, want, strict=True):
                assert torch.equal(_bits(g), _bits(w)), f"{name} {case.name} {out} ({call})"


def _weight(seed: int, n: int = 64, k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return quant_fp8_weight(torch.randn(n, k, generator=g) * 0.1)


def test_an_entry_follows_its_weight():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    w, s = _weight(2)
    memo = Prepared()
    assert torch.equal(gemm_fp8(x=x, weight=w, weight_scale=s, state=memo),
                       gemm_fp8(x=x, weight=w, weight_scale=s))
    assert len(memo._map) == 1 and memo.bytes > 0
    other_w, other_s = _weight(3)
    w.copy_(other_w)  # in place: the next call sees the new values
    s.copy_(other_s)
    assert torch.equal(gemm_fp8(x=x, weight=w, weight_scale=s, state=memo),
                       gemm_fp8(x=x, weight=other_w, weight_scale=other_s))
    scale_copy = s.clone()  # the same values in another tensor: its own key
    assert torch.equal(gemm_fp8(x=x, weight=w, weight_scale=scale_copy, state=memo),
                       gemm_fp8(x=x, weight=w, weight_scale=s))
    assert len(memo._map) == 1
    del w, s, scale_copy
    gc.collect()
    assert not memo._map and memo.bytes == 0  # the entry died with its weight


def test_budget_and_devices():
    x = torch.randn(1, 64).bfloat16()
    w, s = _weight(4)
    nothing = Prepared(budget_bytes=0)
    gemm_fp8(x=x, weight=w, weight_scale=s, state=nothing)
    assert not nothing._map and nothing.bytes == 0
    with torch.inference_mode():
        wi, si = w.clone(), s.clone()  # inference tensors keep no version counter
    memo = Prepared()
    gemm_fp8(x=x, weight=wi, weight_scale=si, state=memo)
    assert not memo._map
    assert memo.value("k", torch.device("meta"), lambda: torch.ones(2)) is not memo.value(
        "k", torch.device("meta"), lambda: torch.ones(2))  # kept on the CPU only
    one = memo.value("k", torch.device("cpu"), lambda: torch.ones(2))
    assert memo.value("k", torch.device("cpu"), lambda: torch.zeros(2)) is one


def test_each_table_has_its_own_memo():
    a, b = REGISTRY.resolve(["reference"]), REGISTRY.resolve(["reference"])
    for name in STATEFUL:
        sa, sb = a.fns[name].keywords["state"], b.fns[name].keywords["state"]
        assert isinstance(sa, Prepared) and sa is not sb
