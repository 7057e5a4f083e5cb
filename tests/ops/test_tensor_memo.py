"""`TensorMemo` (ops/tensor_memo.py), the memo behind every op's prepared values: a value is
built once per (sources, tag), again after an in-place change or for another tensor with the same
values, never kept for inference tensors, and its entry dies with its first source."""

from __future__ import annotations

import gc

import torch

from shoal.ops.tensor_memo import TensorMemo


def test_built_once_then_again_when_a_source_changes() -> None:
    memo, calls = TensorMemo(), []
    w, s = torch.arange(6.0), torch.ones(2)

    def build():
        calls.append(1)
        return {"sum": float(w.sum() + s.sum())}  # any value, not only tensors

    first = memo.get((w, s), "t", build)
    assert memo.get((w, s), "t", build) is first and len(calls) == 1
    assert memo.get((w, s), "other tag", build) is not first and len(calls) == 2
    s.add_(1)  # in place: the version moves
    assert memo.get((w, s), "t", build)["sum"] == 19.0 and len(calls) == 3
    memo.get((w, s.clone()), "t", build)  # the same values in another tensor: rebuilt
    assert len(calls) == 4 and len(memo) == 2


def test_entries_die_with_their_source_and_inference_tensors_are_not_kept() -> None:
    memo = TensorMemo()
    w = torch.randn(4)
    memo.get((w,), "t", lambda: torch.ones(4))
    del w
    gc.collect()
    assert len(memo) == 0 and memo.bytes == 0
    with torch.inference_mode():
        x = torch.randn(4)
    calls = []
    for _ in range(2):
        memo.get((x,), "t", lambda: calls.append(1) or x * 2)
    assert len(calls) == 2 and len(memo) == 0


def test_a_budget_keeps_what_fits() -> None:
    memo = TensorMemo(budget_bytes=40)
    a, b = torch.zeros(8), torch.zeros(8)  # 32 bytes each
    memo.get((a,), "t", lambda: a + 1)
    memo.get((b,), "t", lambda: b + 1)
    assert len(memo) == 1 and memo.bytes == 32
