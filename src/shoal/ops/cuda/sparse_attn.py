"""CUDA sparse decode attention: `sparse_attn_sink` (backend "cuda") at D = 512 and up to 64
heads, in CUDA C++ (sparse_attn.cu: bf16 mma.sync m16n8k16, or the scores and P.V by wgmma,
the records copied by cp.async while the previous block computes, compiled by NVRTC), with the
Triton combine pass (ops/triton/attention_combine.py) where a token's blocks are split.

Partition: a token's index blocks (SWA first, then compressed, 64 keys each) go to splits of
`per` blocks counted from the first block, one CTA each, when the step has at most
DECODE_MAX_TOKENS rows and more than `per` blocks; otherwise one CTA per token. As in the Triton
op, a row's partition depends only on its own index lists (padded trailing blocks are empty
splits, which add exact zeros), so its bits do not depend on the batch.

Numerics: the reference's (per-block online softmax from -1e30, exp in fp64 rounded to fp32, the
block's sum of p in fp64, P rounded to bf16 before P.V, keys dequantised exactly), with the
scores and P.V summed by fp32 MMAs in their order: within the op's tolerance, not bitwise. Layout
and the warp tiling: the comment at the top of sparse_attn.cu.
"""

from __future__ import annotations

import torch

from shoal.ops.cuda.driver import Module
from shoal.ops.cuda.nvrtc import available, compile_file
from shoal.ops.registry import REGISTRY
from shoal.ops.triton.attention import index_blocks, partition
from shoal.ops.triton.attention_combine import combine

D, MAX_HEADS, BLOCK_N, THREADS = 512, 64, 64, 256
SWA_REC, COMP_REC = D + D // 32, D // 2 + D // 16
# sparse_attn.cu's SMEM_BYTES: Q and K (64 rows x 1 KB each), the raw records, P, the scores
# (64 x 72 fp32), two index lists, alpha, (m, l)
SMEM_BYTES = 2 * 64 * 2 * D + BLOCK_N * SWA_REC + 64 * BLOCK_N * 2 + 64 * 72 * 4 + 2 * 64 * 4 \
    + 64 * 4 + 64 * 8 + 1024  # (+ the slack that aligns the slabs to 1024 bytes)
BLOCKS_PER_SPLIT = 2  # the Triton op's decode partition (benchmarks sweep it)


WGMMA = 0  # ATTN_WGMMA: 1 the scores by wgmma, 2 P.V too (bench variants cuda-wgmmaN)


class SparseAttnState:
    """Per op table: the loaded module; per: index blocks per split at decode sizes; wgmma: the
    kernel's ATTN_WGMMA (benchmarks sweep both)."""

    def __init__(self, per: int = BLOCKS_PER_SPLIT, wgmma: int = WGMMA) -> None:
        if wgmma not in (0, 1, 2):
            raise ValueError(f"wgmma must be 0, 1 or 2, got {wgmma}")
        self.per, self.wgmma = per, wgmma
        self._module: Module | None = None

    def module(self, device: torch.device) -> Module:
        if self._module is None:
            cubin = compile_file("sparse_attn.cu", options=(f"-DATTN_WGMMA={self.wgmma}",))
            self._module = Module(cubin.cubin, device)
        return self._module


def _aligned(x: torch.Tensor) -> bool:
    return x.data_ptr() % 16 == 0


def _supports(*, q: torch.Tensor, swa_cache: torch.Tensor, swa_idx: torch.Tensor,
              comp_cache: torch.Tensor | None, comp_idx: torch.Tensor | None, **_) -> bool:
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return False
    t, h, d = q.shape
    caches = [swa_cache] + ([comp_cache] if comp_cache is not None else [])
    # the kernel's blocks follow each pool, which are the reference's blocks of the concatenated
    # list only when the SWA list fills whole blocks (the model's window: 128)
    whole = swa_idx.shape[1] % BLOCK_N == 0 or comp_idx is None or comp_idx.shape[1] == 0
    return (available() and whole and d == D and 1 <= h <= MAX_HEADS
            and q.dtype == torch.bfloat16
            and swa_cache.shape[-1] == SWA_REC
            and (comp_cache is None or comp_cache.shape[-1] == COMP_REC)
            and all(c.dtype == torch.uint8 and c.is_contiguous() and _aligned(c)
                    for c in caches))


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.int32)
    return x if x.stride(-1) == 1 else x.contiguous()


@REGISTRY.implement("cuda", "sparse_attn_sink", supports=_supports, state=SparseAttnState)
def sparse_attn_sink(*, q: torch.Tensor, swa_cache: torch.Tensor, swa_idx: torch.Tensor,
                     comp_cache: torch.Tensor | None, comp_idx: torch.Tensor | None,
                     sink: torch.Tensor, scale: float,
                     state: SparseAttnState | None = None) -> torch.Tensor:
    """Same contract as the reference op (q [T, H, D] bf16 -> o [T, H, D] bf16)."""
    state = state or SparseAttnState()
    t, h, d = q.shape
    out = torch.empty(t, h, d, dtype=torch.bfloat16, device=q.device)
    if t == 0:
        return out
    if q.stride(2) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or not _aligned(q):
        q = q.contiguous()
    has_comp = comp_idx is not None and comp_idx.shape[1] > 0
    swa_idx = _rows(swa_idx)
    if has_comp:
        comp_idx = _rows(comp_idx)
    else:
        comp_idx, comp_cache = swa_idx, swa_cache  # not read (no compressed blocks)
    n_swa, n_comp = swa_idx.shape[1], (comp_idx.shape[1] if has_comp else 0)
    split, per = partition(t, index_blocks(swa_idx, comp_idx if has_comp else None, BLOCK_N),
                           per=state.per)
    sink = sink.float().contiguous()
    if split > 1:
        part = torch.empty(t, split, h, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(t, split, h, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # not written
    state.module(q.device).kernel("sparse_attn_decode")(
        (t, split), (THREADS,), q, swa_cache, swa_idx, comp_cache, comp_idx, sink, out, part,
        ml, h, n_swa, n_comp, per, float(scale), q.stride(0), q.stride(1), swa_idx.stride(0),
        comp_idx.stride(0), shared=SMEM_BYTES)
    if split > 1:
        combine(part, ml, sink, out)
    return out
