"""Triton attention-path kernels (norm, rope, mHC, cache writers, indexer) against the reference
on inputs the conformance grid does not stress: wide magnitude ranges and exact quantiser ties
(records must be bit-identical), and exact top-k ties (lowest index wins).

Runs on CUDA (sm_90), or on the CPU under the Triton interpreter (TRITON_INTERPRET=1 set before
the run). Under the interpreter three of its defects are patched for this module only: fp32->bf16
casts truncate (the GPU rounds to nearest even), bf16 `tl.dot` multiplies the raw uint16 bits,
and a scalar's `__index__` fails with NumPy 2 (runtime `range` bounds).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
INTERP = os.environ.get("TRITON_INTERPRET", "") == "1"
pytestmark = pytest.mark.skipif(not (ON_GPU or INTERP),
                                reason="needs sm_90 or TRITON_INTERPRET=1")
DEV = torch.device("cuda" if ON_GPU else "cpu")

from shoal.ops.reference import cache as rcache  # noqa: E402
from shoal.ops.reference import indexer as rindexer  # noqa: E402
from shoal.ops.triton import cache as tcache  # noqa: E402
from shoal.ops.triton import indexer as tindexer  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_shims(monkeypatch: pytest.MonkeyPatch) -> None:
    if ON_GPU or not INTERP:
        return
    import triton.language as tl
    from triton.runtime import interpreter as ip

    orig_conv, orig_dot, orig_plt = ip._convert_float, ip.InterpreterBuilder.create_dot, \
        ip._patch_lang_tensor

    def conv(data, src, dst, rounding):
        if src == tl.float32 and dst == tl.bfloat16:
            f = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return f.to(torch.bfloat16).view(torch.uint16).numpy()
        return orig_conv(data, src, dst, rounding)

    def up(h):
        if h.dtype != tl.bfloat16:
            return h
        return ip.TensorHandle((np.ascontiguousarray(h.data).astype(np.uint32) << 16)
                               .view(np.float32), tl.float32)

    def dot(self, a, b, d, precision, max_imprecise):
        return orig_dot(self, up(a), up(b), d, precision, max_imprecise)

    def plt(tensor, scope):
        orig_plt(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    monkeypatch.setattr(ip, "_convert_float", conv)
    monkeypatch.setattr(ip.InterpreterBuilder, "create_dot", dot)
    monkeypatch.setattr(ip, "_patch_lang_tensor", plt)


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


def test_index_q_quant_bit_exact_on_hard_values() -> None:
    q = _hard_values(24, 64, torch.bfloat16).view(6, 4, 64)
    want = rindexer.index_q_quant(q=q)
    got = tindexer.index_q_quant(q=q.to(DEV)).cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


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


def test_candidate_mask_ties_and_pinned_block() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randint(-2, 3, (5, 203), generator=g).float()
    n = torch.tensor([203, 150, 1, 0, 97])
    logits = logits.masked_fill(torch.arange(203) >= n.unsqueeze(1), -torch.inf)
    want = rindexer.candidate_mask(logits=logits, n_visible=n, block_size=8, topk_blocks=7)
    got = tindexer.candidate_mask(logits=logits.to(DEV), n_visible=n.to(DEV), block_size=8,
                                  topk_blocks=7).cpu()
    assert torch.equal(got, want)
