"""Batch invariance of the reference ops: row i of an op applied to a batch is bit-identical to
the op applied to row i alone (the property that makes chunked prefill, decode and batch N
agree exactly). Generated from the registry's case grids; every op must be listed."""

from __future__ import annotations

import random

import pytest
import torch

from shoal.ops.registry import REGISTRY, load_backends

load_backends()

# op -> kwargs that carry one entry per row (sliced); everything else is shared
ROW_ARGS: dict[str, tuple[str, ...]] = {
    "act_quant_fp8": ("x",), "candidate_mask": ("logits", "n_visible"),
    "confidence": ("hidden", "markov_embed"), "embed": ("ids",),
    "engram_gather": ("row_ids",), "engram_hash": ("ids", "positions", "dead"),
    "engram_mix": ("stream", "kv", "gate_mask"),
    "gemm_bf16": ("x",), "gemm_fp8": ("x",), "gemm_grouped_w8a16": ("o",),
    "hc_coeffs": ("stream",), "hc_collapse": ("stream", "pre"),
    "hc_collapse_norm": ("stream", "pre"), "hc_post": ("y", "stream", "post", "comb"),
    "index_q_quant": ("q",), "index_scores": ("q", "weights", "req", "n_visible"),
    "lm_head": ("h",), "paged_rows": ("logical", "req"), "markov_bias": ("prev",), "mask_logits": ("logits", "mask"),
    "moe_mxfp4": ("x", "ids", "weights", "shared"), "rmsnorm": ("x",), "rope_tail": ("x", "positions"),
    "router": ("x",), "sparse_attn_sink": ("q", "swa_idx", "comp_idx"),
    "stream_mean": ("stream",), "swiglu_clamp": ("gate", "up", "weight"),
    "swa_indices": ("positions", "token_index", "chunk_start", "ring_base", "floor"),
    "topk_rows": ("logits", "n_visible"),
}
# ops whose rows are not independent by definition (pooling across a request's tokens, cache
# writers whose effect is the cache)
NOT_ROWWISE = {"compress_pool", "swa_write", "compressed_write", "index_k_write"}


def test_every_op_is_classified():
    assert set(REGISTRY.ops) == set(ROW_ARGS) | NOT_ROWWISE


def _cases():
    for name in sorted(ROW_ARGS):
        for case in REGISTRY.ops[name].cases:
            if not case.heavy:
                yield pytest.param(name, case, id=f"{name}-{case.name}")


def _rows(value, i):
    return value[i:i + 1] if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("name,case", list(_cases()))
def test_row_alone_equals_row_in_batch(name, case):
    seed = random.randrange(1 << 30)
    kwargs = case.make(torch.Generator().manual_seed(seed), torch.device("cpu"))
    rows = ROW_ARGS[name]
    n = kwargs[rows[0]].shape[0]
    if n < 2:
        pytest.skip("single-row case")
    fn = REGISTRY.ops[name].reference
    whole = fn(**kwargs)
    whole = whole if isinstance(whole, tuple) else (whole,)
    for i in random.Random(seed).sample(range(n), min(n, 6)):
        alone = fn(**{k: (_rows(v, i) if k in rows else v) for k, v in kwargs.items()})
        alone = alone if isinstance(alone, tuple) else (alone,)
        for a, w in zip(alone, whole, strict=True):
            assert torch.equal(a[0], w[i]), f"{name} row {i} differs alone (seed {seed})"


# Triton ops of the default table that promise the same property on the GPU (their reduction
# order depends only on weight shapes, never on the number of rows): they must take every case.
TRITON_INVARIANT = ("confidence", "embed", "engram_hash", "gemm_bf16", "hc_coeffs", "lm_head",
                    "markov_bias", "router", "stream_mean", "swiglu_clamp")
HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _gpu_cases():
    for name in sorted(ROW_ARGS):
        for case in REGISTRY.ops[name].cases:
            yield pytest.param(name, case, id=f"{name}-{case.name}")


@pytest.mark.skipif(not HAS_SM90, reason="triton backend: CUDA sm_90")
@pytest.mark.parametrize("name,case", list(_gpu_cases()))
def test_batch_invariant_table_row_alone_equals_row_in_batch(name, case):
    """What `batch_invariant=True` promises: every row-wise op of its table (backend
    "triton_invariant" where it has one, else "triton") gives a row the same bits alone as in
    its batch (heavy cases included). scripts/probe_row_invariance.py checks the same at the
    real shapes, up to 8192 rows."""
    impl = REGISTRY.impl("triton_invariant", name) or REGISTRY.impl("triton", name)
    assert impl is not None, name
    seed = random.randrange(1 << 30)
    kwargs = case.make(torch.Generator().manual_seed(seed), torch.device("cuda"))
    rows = ROW_ARGS[name]
    n = kwargs[rows[0]].shape[0] if kwargs.get(rows[0]) is not None else 0
    if n < 2:
        pytest.skip("single-row case")
    if not impl.supports(**kwargs):
        assert name not in TRITON_INVARIANT, f"{name}: triton declined {case.name}"
        pytest.skip(f"{name}: the fast op declines {case.name} (the reference serves it)")
    whole = impl.fn(**kwargs)
    whole = whole if isinstance(whole, tuple) else (whole,)
    for i in random.Random(seed).sample(range(n), min(n, 6)):
        alone = impl.fn(**{k: (_rows(v, i) if k in rows else v) for k, v in kwargs.items()})
        alone = alone if isinstance(alone, tuple) else (alone,)
        for a, w in zip(alone, whole, strict=True):
            assert torch.equal(_bits(a[0]), _bits(w[i])), \
                f"{name} row {i} differs alone (seed {seed})"


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Bytes of a float tensor (NaN payloads and -0 compared too), else the tensor."""
    x = x.cpu().contiguous()
    return x.reshape(-1).view(torch.uint8) if x.is_floating_point() else x
