"""GEMM ops: FP8 activation quantisation, FP8 x FP8 block-scaled GEMM, the grouped `wo_a`
projection (FP8 weights, bf16 activations) and plain bf16/fp32 linears.

Invariant (model.md §5.2): every FP8 GEMM quantises its bf16 activation per token and per 32
contiguous K values with a power-of-two (UE8M0) scale, exactly as the official reference, and
accumulates in fp32; the output is bf16. Reference results are computed in fp32 on any device.
"""

from __future__ import annotations

import torch

from shoal.ops.reference._cases import fp8_weight, randn
from shoal.ops.reference._math import blockwise_matmul_blocks, einsum, matmul_nt, weight_blocks
from shoal.ops.reference._prepared import Prepared
from shoal.ops.registry import REGISTRY, OpCase, Tolerance
from shoal.quant.fp8 import dequant_fp8_act, dequant_fp8_weight, quant_fp8_act

BF16_TOL = {torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2),
            torch.float32: Tolerance(atol=1e-4, rtol=1e-4)}


def _act_case(t: int, k: int, heavy: bool = False) -> OpCase:
    return OpCase(f"T{t}xK{k}", lambda g, d: {"x": randn(g, t, k, device=d), "block": 32},
                  heavy=heavy)


@REGISTRY.define("act_quant_fp8", cases=[_act_case(1, 32), _act_case(7, 64), _act_case(83, 1280),
                                         _act_case(0, 512), _act_case(769, 5120, heavy=True)])
def act_quant_fp8(*, x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] bf16 -> (codes [T, K] float8_e4m3fn, scales [T, K // block] uint8 UE8M0).

    Per token and block: amax = max(|x|, 1e-4); s = 2^ceil(log2(amax / 448)); q = e4m3(x / s)
    (round-to-nearest-even, saturating). Bit-exact with the official `act_quant`.
    """
    return quant_fp8_act(x, block)


def _gemm_case(t: int, n: int, k: int, heavy: bool = False) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        w, s = fp8_weight(g, n, k, d)
        return {"x": randn(g, t, k, device=d), "weight": w, "weight_scale": s, "block": 32}

    return OpCase(f"T{t}xN{n}xK{k}", make, heavy=heavy)


@REGISTRY.define("gemm_fp8", tolerances=BF16_TOL, state=Prepared, cases=[
    _gemm_case(1, 32, 32), _gemm_case(7, 96, 64), _gemm_case(83, 200, 128), _gemm_case(0, 64, 64),
    _gemm_case(5, 769, 96), _gemm_case(4, 1280, 5120, heavy=True),  # wq_a
    _gemm_case(16, 32768, 1280, heavy=True),  # wq_b
    _gemm_case(16, 5120, 8192, heavy=True)])  # wo_b
def gemm_fp8(*, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             block: int = 32, state: Prepared | None = None) -> torch.Tensor:
    """y = x @ W^T for an FP8 weight with 32x32 UE8M0 blocks.

    x [T, K] bf16 (quantised inside, as `act_quant_fp8`); weight [N, K] float8_e4m3fn;
    weight_scale [ceil(N/32), K/32] uint8. Returns [T, N] bf16. Same rounding as the official
    kernel: the exact block dot products scaled by s_a * s_w, added in fp32 in K order.
    `state`: the op table's memo of dequantised weights.
    """
    codes, scales = quant_fp8_act(x, block)
    a = dequant_fp8_act(codes, scales, block)

    def blocks() -> torch.Tensor:
        return weight_blocks(dequant_fp8_weight(weight, weight_scale, block), block)

    wb = blocks() if state is None else state.get((weight, weight_scale), ("fp8", block), blocks)
    return blockwise_matmul_blocks(a, wb).to(torch.bfloat16)


def _grouped_case(t: int, groups: int, rank: int, k: int, heavy: bool = False) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        w, s = fp8_weight(g, groups * rank, k, d)
        return {"o": randn(g, t, groups, k, device=d), "weight": w, "weight_scale": s,
                "block": 32}

    return OpCase(f"T{t}xG{groups}xR{rank}xK{k}", make, heavy=heavy)


@REGISTRY.define("gemm_grouped_w8a16", tolerances=BF16_TOL, state=Prepared, cases=[
    _grouped_case(1, 2, 32, 128), _grouped_case(7, 2, 32, 128), _grouped_case(0, 2, 32, 64),
    _grouped_case(83, 4, 64, 96), _grouped_case(4, 8, 1024, 4096, heavy=True)])
def gemm_grouped_w8a16(*, o: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       block: int = 32, state: Prepared | None = None) -> torch.Tensor:
    """Grouped low-rank output projection `wo_a` (model.md §2.5 step 9).

    o [T, G, Kg] bf16 (attention output, G groups of heads_per_group * head_dim values);
    weight [G * R, Kg] float8_e4m3fn with 32x32 UE8M0 scales, viewed as [G, R, Kg]
    (block-diagonal). Returns z [T, G * R] bf16 with z_g = o_g @ W_g^T. Activations are NOT
    quantised (the reference upcasts wo_a to bf16 and runs in bf16 with fp32 accumulation).
    `state`: the op table's memo of dequantised weights.
    """
    t, g, k = o.shape

    def grouped() -> torch.Tensor:  # fp64, as einsum reads it
        return dequant_fp8_weight(weight, weight_scale, block).view(g, -1, k).double()

    w = grouped() if state is None else state.get((weight, weight_scale), ("grouped", g, block),
                                                  grouped)
    z = einsum("tgk,grk->tgr", o.float(), w)
    return z.to(torch.bfloat16).reshape(t, z.shape[1] * z.shape[2])


def _bf16_case(t: int, n: int, k: int, x_dtype, out_dtype) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        return {"x": randn(g, t, k, dtype=x_dtype, device=d),
                "weight": randn(g, n, k, scale=k**-0.5, device=d), "out_dtype": out_dtype}

    return OpCase(f"T{t}xN{n}xK{k}-{str(out_dtype)[6:]}", make)


@REGISTRY.define("gemm_bf16", tolerances=BF16_TOL, cases=[
    _bf16_case(1, 8, 32, torch.bfloat16, torch.bfloat16),
    _bf16_case(7, 83, 128, torch.float32, torch.float32),
    _bf16_case(0, 16, 64, torch.bfloat16, torch.float32),
    _bf16_case(769, 32, 128, torch.bfloat16, torch.bfloat16),
    _bf16_case(5, 19, 100, torch.float32, torch.bfloat16),  # odd N and K
    _bf16_case(3, 512, 5120, torch.float32, torch.float32),  # ratio-2 compressor wkv / wgate
    _bf16_case(2, 32, 5120, torch.bfloat16, torch.bfloat16)])  # indexer weights_proj
def gemm_bf16(*, x: torch.Tensor, weight: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = x @ W^T with a bf16 weight [N, K], computed in fp32, cast to `out_dtype`.

    Used by the router (fp32 out), the ratio-2 compressor (fp32 in and out: the reference
    promotes those weights to fp32), `weights_proj`, `indexer.wk` and ratio-1 `wkv` (bf16 out).
    """
    return matmul_nt(x.float(), weight.float()).to(out_dtype)
