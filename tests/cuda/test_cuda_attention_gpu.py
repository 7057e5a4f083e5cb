"""The CUDA sparse decode attention (ops/cuda/sparse_attn.py, backend "cuda") on the H100 / H200:
within the op's tolerance of the reference at the model's width (D = 512) over odd shapes (heads,
partial and empty index blocks, -1 keys, no compressed list, one program per row or splits of
1-10 blocks) into poisoned memory, in its three modes; a row's bits the same alone, in a batch
and with padded trailing index blocks; a CUDA graph replays the eager result; SWA lists that
would share a block with compressed rows are declined."""

from __future__ import annotations

import pytest
import torch

from support.error_map import mapped_failure
from support.graphs import replayed

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs CUDA sm_90")]

D = 512


def _inputs(t: int, h: int, n_swa: int, n_comp: int, seed: int, pool: int = 900) -> dict:
    from shoal.quant.records import pack_compressed_record, pack_swa_record

    g = torch.Generator(device="cuda").manual_seed(seed)
    swa = pack_swa_record(torch.randn(pool, D, device="cuda", generator=g))
    comp = pack_compressed_record(torch.randn(pool, D, device="cuda", generator=g) * 3)
    swa_idx = torch.randint(-1, pool, (t, n_swa), device="cuda", generator=g, dtype=torch.int32)
    comp_idx = torch.randint(-1, pool, (t, n_comp), device="cuda", generator=g,
                             dtype=torch.int32)
    if t > 1:
        swa_idx[1] = -1  # a row without SWA keys
        comp_idx[1, : n_comp // 2] = -1
    if t > 2 and n_comp >= 64:
        comp_idx[2, :64] = -1  # a whole empty block between live ones
    q = (torch.randn(t, h, D, device="cuda", generator=g) * 0.7).to(torch.bfloat16)
    return dict(q=q, swa_cache=swa, swa_idx=swa_idx, comp_cache=comp if n_comp else None,
                comp_idx=comp_idx if n_comp else None,
                sink=torch.randn(h, device="cuda", generator=g), scale=D**-0.5)


def _poison() -> None:
    blob = torch.full((256 << 20,), 0xFF, dtype=torch.uint8, device="cuda")
    del blob


SHAPES = [(1, 64, 128, 512), (5, 64, 128, 512), (64, 64, 128, 512), (65, 64, 128, 512),
          (130, 64, 128, 512), (7, 5, 64, 70), (9, 64, 128, 0), (3, 64, 0, 130), (2, 1, 64, 8),
          (33, 17, 128, 200), (6, 8, 37, 0)]


@pytest.mark.parametrize("wgmma", [0, 1, 2], ids=["mma", "wgmma1", "wgmma2"])
@pytest.mark.parametrize("per", [1, 2, 3, 10])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}xH{}-swa{}-comp{}".format(*s))
def test_matches_the_reference(shape: tuple[int, int, int, int], per: int, wgmma: int) -> None:
    from shoal.ops.compare import check_output
    from shoal.ops.cuda import sparse_attn as cuda_attn
    from shoal.ops.reference import attention as ref_attn
    from shoal.ops.registry import REGISTRY

    kw = _inputs(*shape, seed=sum(shape) + per)
    assert cuda_attn._supports(**kw)
    state = cuda_attn.SparseAttnState(per, wgmma)
    state.module(torch.device("cuda"))  # loaded before the poison
    _poison()
    got = cuda_attn.sparse_attn_sink(**kw, state=state)
    torch.cuda.synchronize()
    want = ref_attn.sparse_attn_sink(**kw)
    op = REGISTRY.ops["sparse_attn_sink"]
    tol = op.tolerances[torch.bfloat16]
    with mapped_failure(got, want, atol=tol.atol, rtol=tol.rtol, row_group=shape[1]):
        check_output(op, "out", got, want, f"cuda sparse_attn {shape} per={per} wgmma={wgmma}")


@pytest.mark.parametrize("wgmma", [0, 1, 2], ids=["mma", "wgmma1", "wgmma2"])
def test_rows_do_not_depend_on_the_batch_or_padding(wgmma: int) -> None:
    from shoal.ops.cuda import sparse_attn as cuda_attn

    state = cuda_attn.SparseAttnState(wgmma=wgmma)
    kw = _inputs(64, 64, 128, 300, seed=11)
    whole = cuda_attn.sparse_attn_sink(**kw, state=state)
    rows_of = {"q", "swa_idx", "comp_idx"}
    for rows in (slice(0, 1), slice(5, 6), slice(0, 16), slice(3, 40)):
        part = {k: (v[rows] if k in rows_of else v) for k, v in kw.items()}
        got = cuda_attn.sparse_attn_sink(**part, state=state)
        assert torch.equal(got, whole[rows]), rows
    for extra in (20, 64, 148):  # a wider (graph-padded) compressed list: trailing -1 keys
        pad = torch.full((64, extra), -1, dtype=torch.int32, device="cuda")
        wide = dict(kw, comp_idx=torch.cat([kw["comp_idx"], pad], dim=1))
        assert torch.equal(cuda_attn.sparse_attn_sink(**wide, state=state), whole), extra


def test_graph_replay_equals_eager() -> None:
    from shoal.ops.cuda import sparse_attn as cuda_attn

    state = cuda_attn.SparseAttnState()
    kw = _inputs(16, 64, 128, 512, seed=5)
    want = cuda_attn.sparse_attn_sink(**kw, state=state)
    assert torch.equal(replayed(lambda: cuda_attn.sparse_attn_sink(**kw, state=state)), want)


def test_declines_a_block_across_the_pools() -> None:
    """An SWA list that does not fill whole blocks beside a compressed one: the reference's
    blocks of the concatenated list would mix the pools, which this kernel does not do."""
    from shoal.ops.cuda import sparse_attn as cuda_attn

    assert not cuda_attn._supports(**_inputs(3, 8, 37, 70, seed=1))
    assert cuda_attn._supports(**_inputs(3, 8, 37, 0, seed=1))
