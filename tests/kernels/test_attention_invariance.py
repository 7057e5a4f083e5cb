"""A row's bits in the Triton sparse attention do not depend on the batch: the decode partition
(alone, in a batch, with the compressed list padded to a wider batch's width), the output-column
groups, and the batch-invariant variant at every size (`sparse_attn_sink_invariant`). Runs on
sm_90, or the small cases under the Triton interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.test_triton_attention_path import _attn_inputs  # noqa: E402
from support.triton_interpreter import (  # noqa: E402
    DEV,
    INTERP,
    ON_GPU,
    needs_kernels,
    patch_interpreter,
)


@needs_kernels
@pytest.mark.parametrize("knobs", [{}, {"variant": "chunked", "p_mem": True}],
                         ids=["flat", "op-knobs"])
def test_sparse_attn_decode_rows_do_not_depend_on_the_batch(monkeypatch, knobs) -> None:
    """The op's decode partition (fixed index blocks per split, counted from the first block):
    a row's output is bitwise the same alone, in a batch, and with its compressed index list
    padded by -1 columns to a wider batch's width (what a longer request or a CUDA graph's
    context bound adds), though the padding changes the number of splits."""
    from shoal.ops.triton import attention as tattn

    if INTERP:
        patch_interpreter(monkeypatch)
    # 1 SWA + 3 compressed blocks; padded: 4 compressed blocks. The former SM-count split
    # (4 splits of 1 block here, 2 of 2 when padded or in a batch of 20) failed this.
    kw = _attn_inputs(20, 4, 128, 64, 192, seed=77)
    dev = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    whole = tattn.sparse_attn(**dev, **knobs).cpu()
    wide = dict(dev, comp_idx=torch.nn.functional.pad(dev["comp_idx"], (0, 64), value=-1))
    assert tattn.partition(20, 5)[0] != tattn.partition(20, 4)[0]  # really more splits
    assert torch.equal(tattn.sparse_attn(**wide, **knobs).cpu(), whole)
    for i in (3,) if INTERP else (1, 3, 17):  # (the interpreter is slow; one row suffices)
        alone = {k: (v[i:i + 1] if k in ("q", "swa_idx", "comp_idx") else v)
                 for k, v in dev.items()}
        assert torch.equal(tattn.sparse_attn(**alone, **knobs).cpu(), whole[i:i + 1]), i


@needs_kernels
def test_sparse_attn_column_groups_do_not_change_bits(monkeypatch) -> None:
    """The op picks 1, 2 or 4 output-column groups per (token, split) by the SM count
    (`column_split`); every group recomputes the same scores and sums its columns the same
    way, so the bits are those of one group."""
    from shoal.ops.triton import attention as tattn

    if INTERP:
        patch_interpreter(monkeypatch)
    kw = _attn_inputs(2, 4, 128, 13, 70, seed=91)
    dev = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    outs = [tattn.sparse_attn(**dev, **tattn.OP_KNOBS, dsplit=g).cpu() for g in (1, 2, 4)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # the automatic choice (H200, or its 132 SMs off the GPU): 4 groups for a lone decode row
    assert tattn.column_split(1, 5, torch.device(DEV)) == 4
    assert tattn.column_split(64, 5, torch.device(DEV)) == 1


def test_invariant_partition_is_the_decode_partition_at_every_size() -> None:
    from shoal.ops.triton import attention as tattn

    for nb in (3, 5, 10, 33):
        want = tattn.partition(1, nb)
        assert want[1] == tattn.BLOCKS_PER_SPLIT
        for t in (1, 64, 65, 8192):
            assert tattn.partition(t, nb, invariant=True) == want, (t, nb)
    # one or two blocks: still two splits of BLOCKS_PER_SPLIT (the second empty), the layout
    # those blocks have inside a wider batch's rows
    assert tattn.partition(1, 1, invariant=True) == (2, tattn.BLOCKS_PER_SPLIT)
    assert tattn.partition(300, 2, invariant=True) == (2, tattn.BLOCKS_PER_SPLIT)


@pytest.mark.skipif(not ON_GPU, reason="rows above the decode size: slow under the interpreter")
def test_invariant_op_rows_do_not_depend_on_the_batch(monkeypatch) -> None:
    """`sparse_attn_sink_invariant`: a row's bits are the same alone, in a call of 80 rows
    (above DECODE_MAX_TOKENS, where the default op runs one program per row), in row chunks,
    and with a short row's lists padded to a wide batch's width; decode steps are the default
    op's bits."""
    from shoal.ops.triton import attention as tattn

    kw = _attn_inputs(80, 8, 512, 64, 192, seed=123)
    dev = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    rows = ("q", "swa_idx", "comp_idx")
    whole = tattn.sparse_attn_sink_invariant(**dev)
    for i in (0, 1, 3, 64, 79):
        alone = {k: (v[i:i + 1] if k in rows else v) for k, v in dev.items()}
        assert torch.equal(tattn.sparse_attn_sink_invariant(**alone), whole[i:i + 1]), i
    decode = {k: (v[:20] if k in rows else v) for k, v in dev.items()}
    assert torch.equal(tattn.sparse_attn_sink_invariant(**decode),
                       tattn.sparse_attn_sink(**decode))
    monkeypatch.setattr(tattn, "INVARIANT_PARTIAL_BYTES", 7 * 2 * 8 * 512 * 4)  # 7-row chunks
    assert torch.equal(tattn.sparse_attn_sink_invariant(**dev), whole)
    short = dict(dev, comp_idx=None, comp_cache=None)  # one SWA block: nb = 1
    padded = dict(short, comp_cache=dev["comp_cache"],
                  comp_idx=torch.full((80, 128), -1, dtype=torch.int32, device=DEV))
    assert torch.equal(tattn.sparse_attn_sink_invariant(**short),
                       tattn.sparse_attn_sink_invariant(**padded))
