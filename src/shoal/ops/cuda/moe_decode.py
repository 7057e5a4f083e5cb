"""CUDA decode MoE: `moe_mxfp4` (backend "cuda") with its two grouped GEMMs in CUDA C++
(moe_decode.cu, fp16 mma.sync m16n8k16 over 8-row tiles of routed rows, compiled by NVRTC) and
the rest of the Triton pipeline (routing, the folded activation quantiser, the combine:
ops/triton/moe.py).

Numerics: the Triton kernels' fold (activations and weights re-encoded relative to their row's
largest block scale, one fp32 scale per row and weight row in the epilogue); the folded e4m3
values are multiplied exactly in fp16 MMAs and their fp32 sums chain over the whole K. The op
is held to the reference's MoE tolerance (`_moe_compare`); its bits are not the 16-row Triton
tiles' (it is not in the batch-invariant table). A row's result does not depend on the batch
(fixed K order, no split).

Layouts and the lane mapping: the comment at the top of moe_decode.cu; measurements:
docs/perf/moe.md. `run_grouped` is the pipeline
around a kernel family's two GEMMs, shared with the prefill kernels (moe_prefill.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from shoal.ops.cuda.driver import Module
from shoal.ops.cuda.nvrtc import available, compile_file
from shoal.ops.registry import REGISTRY
from shoal.ops.tensor_memo import TensorMemo
from shoal.ops.triton.fp4_tiles import lut_table
from shoal.ops.triton.moe import _combine, _quant_folded, empty_result
from shoal.ops.triton.moe_route import route

TILE_M, THREADS, CHUNK_K, LUT_ROWS = 8, 128, 128, 32
WARPS = THREADS // 32
W13_COLUMNS, W2_COLUMNS = 32, 64  # output columns per CTA (4 warps x 8 / x 16)
MAX_ROWS = 1024  # routed rows (T x top-k) this path takes: decode batches
DEPTH = 2  # 128-K chunks of weight loads in flight per lane (docs/perf/moe.md)


class DecodeMoEState:
    """Per op table: the loaded module and each weight's row maxima of its block scales
    ([E, rows] int32, computed on first use, dropped with the scale tensor). depth: the
    kernel's MOE_DEPTH (benchmarks sweep it)."""

    def __init__(self, depth: int = DEPTH) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self._module: Module | None = None
        self._lut: torch.Tensor | None = None
        self._wmax = TensorMemo()

    def module(self, device: torch.device) -> Module:
        if self._module is None:
            options = (f"-DMOE_DEPTH={self.depth}",)
            cubin = compile_file("moe_decode.cu", options=options).cubin
            self._module = Module(cubin, device)
        return self._module

    def lut(self, device: torch.device) -> torch.Tensor:
        if self._lut is None:
            self._lut = lut_table(device)[:LUT_ROWS].contiguous()
        return self._lut

    def row_max(self, scale: torch.Tensor) -> torch.Tensor:
        return self._wmax.get((scale,), "row_max",
                              lambda: scale.amax(dim=-1).to(torch.int32).contiguous())


def _supports(*, x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              **_) -> bool:
    if not (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)):
        return False
    d, inter = x.shape[1], w2.shape[2] * 2
    return (available() and x.shape[0] * ids.shape[1] <= MAX_ROWS and d % CHUNK_K == 0
            and inter % CHUNK_K == 0 and d % 16 == 0 and inter % 16 == 0)


@REGISTRY.implement("cuda", "moe_mxfp4", supports=_supports, state=DecodeMoEState)
def moe_mxfp4(*, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
              w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
              shared: torch.Tensor | None = None,
              state: DecodeMoEState | None = None) -> torch.Tensor:
    """Same contract as the reference op (see the module docstring for the numerics)."""
    if (empty := empty_result(x, shared)) is not None:
        return empty
    state = state or DecodeMoEState()
    return run_grouped(Family("decode", state.module(x.device), TILE_M, W13_COLUMNS, W2_COLUMNS,
                              THREADS, 0, 1, fp16=True),
                       state, x, ids, weights, w13, w13_scale, w2, w2_scale, limit, shared)


@dataclass(frozen=True)
class Family:
    """A kernel family's launch: entry points moe_w13_<name> / moe_w2_<name> of `module`, routed
    rows per tile, output columns per CTA of each GEMM, threads per CTA, dynamic shared memory,
    the byte alignment its scale copies need, and whether it takes the folded activations as
    fp16 values (else as e4m3 codes)."""

    name: str
    module: Module
    tile_rows: int
    w13_columns: int
    w2_columns: int
    threads: int
    smem: int
    scale_align: int
    fp16: bool


def run_grouped(fam: Family, state: DecodeMoEState, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                w2: torch.Tensor, w2_scale: torch.Tensor, limit: float,
                shared: torch.Tensor | None) -> torch.Tensor:
    """The pipeline around a family's two grouped GEMMs: routing, the folded quantisers, both
    launches (h = w13's SwiGLU rows, y = w2's rows at their output rows), the combine."""
    t, d = x.shape
    k = ids.shape[1]
    e, two_i, _ = w13.shape
    inter = two_i // 2
    lut = state.lut(x.device)
    w13, w2 = w13.contiguous(), w2.contiguous()
    s13, s2 = w13_scale.contiguous(), w2_scale.contiguous()
    wmax13, wmax2 = state.row_max(s13), state.row_max(s2)
    s13, s2 = (sc if sc.data_ptr() % fam.scale_align == 0 else sc.clone() for sc in (s13, s2))
    tok, orow, rw, counts = route(ids, weights, e)
    rows = t * k
    m_tiles = triton.cdiv(rows, fam.tile_rows) + min(e, rows)

    def folded(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = _quant_folded(v)  # (fp16 holds the e4m3 values exactly)
        return (q.to(torch.float16) if fam.fp16 else q.view(torch.uint8)), s

    xq, xs = folded(x)
    h = torch.empty(rows, inter, dtype=torch.bfloat16, device=x.device)
    fam.module.kernel(f"moe_w13_{fam.name}")(
        (triton.cdiv(inter, fam.w13_columns), m_tiles), (fam.threads,), xq, xs,
        tok, h, rw, w13, s13, wmax13, lut, counts, inter, e, d, float(limit), shared=fam.smem)
    hq, hs = folded(h)
    y = torch.empty(rows, d, dtype=torch.bfloat16, device=x.device)
    fam.module.kernel(f"moe_w2_{fam.name}")(
        (triton.cdiv(d, fam.w2_columns), m_tiles), (fam.threads,), hq, hs, y,
        orow, w2, s2, wmax2, lut, counts, d, e, inter, shared=fam.smem)
    return _combine(y, t, k, d, shared)
