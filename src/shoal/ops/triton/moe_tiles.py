"""Tile configurations of the routed-experts grouped GEMM (moe.py): `TileConfig` and the
choice per batch size for W4A8 (`default_configs`) and the W4A16 baseline (`w4a16_configs`),
with the reason behind each choice (measurements: docs/perf/moe.md); `SWAP_DECODE`, the opt-in
swap-AB tiles.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    """Tile shape of one grouped GEMM launch (BLOCK_K a multiple of 32)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False
    """Compute the transposed tile W . A^T: the converted weight tile is the left (M >= 64,
    wgmma) operand, the BLOCK_M routed rows the right one (any BLOCK_M >= 16). Same products and
    the same K order as the plain orientation."""
    f16: bool = False
    """Decode the weights straight to fp16 (`fp4_tiles.w_f16`) and widen the e4m3 activations
    to fp16 once per K step: for the 16-row mma.sync tiles, whose FP8 operands Triton widens to
    fp16 anyway (same operand values, same bits; sm_90 SASS of the decode w13 loop: 716 -> 590
    instructions per K step, no F2FP on the weights). Plain tiles only."""
    promote: bool = False
    """Form each BLOCK_K step's product from zero and add it to the fp32 accumulator, instead of
    chaining the accumulator through the MMA: sm_90's FP8 wgmma adds in reduced precision, so a
    chained accumulator drifts over K (DeepGEMM promotes every 128). The default for the
    128-row prefill tiles (see `default_configs`; a small cost at large T)."""
    fused_gate_up: bool = False
    """w13 only (plain W4A8 e4m3 tiles): gate and up rows interleaved in one [2 BLOCK_N,
    BLOCK_K] weight tile and one MMA chain per step instead of two (same products, same K
    order). Not on the f16 decode tiles, where it saves nothing (sm_90 SASS: 3.98 loop
    instructions per weight element against 3.87)."""
    maxnreg: int | None = None
    """Cap ptxas's registers per thread (None: its own choice), to fit more programs per SM."""


def default_configs(rows: int, experts: int) -> tuple[TileConfig, TileConfig]:
    """(w13 config, w2 config) for `rows` = T * k routed rows over `experts` experts.

    Up to 40 rows per expert on average (decode and small batches: bandwidth-bound): plain
    16-row tiles on mma.sync (exact fp32 accumulation), 16 x 64 x 128 fp16-weight tiles with
    2 warps per program for both GEMMs (the best of the decode tile sweep). Warps, BLOCK_N
    and BLOCK_K move rows, columns and loop steps between programs, not the K order of a sum,
    so the bits are those of any other 16-row tile (GPU test); above, plain 128-row wgmma tiles
    (one weight conversion per 128 rows; BLOCK_N 64 for both GEMMs) with promoted accumulation:
    FP8 wgmma adds into a chained accumulator in reduced precision, so every BLOCK_K product
    starts from zero and is added in fp32. Unpromoted, those tiles put outputs of a tiny-model
    call over the op's tolerance in situ on the H200, and benchmarks/fold_loss.py's CPU model
    of the accumulator reproduces that; promotion costs little. The swap-AB wgmma tiles
    (`SWAP_DECODE`) are faster but less accurate even promoted (relative error 3.2e-3,
    unpromoted 9.4e-3, 16-row tiles 1.7e-4). Still open: decode-size and prefill-size batches
    use different MMA instructions, so a token's MoE output is not bitwise batch-invariant
    across the 40-rows-per-expert boundary. The prefill w13 tile steps BLOCK_K 256, so its
    promotion adds come every 256 K (fewer loop instructions, faster); register caps and K
    slices across the warps of a program on the decode tiles were no faster: removed.

    The prefill w13 tile interleaves gate and up rows in one [128, 256] weight tile
    (`fused_gate_up`): one MMA chain and one wgmma wait per step instead of two, the A tile
    read from shared memory once; faster, same bits (GPU test). Two CTAs per SM were slower.
    (measurements: docs/perf/moe.md)"""
    if rows / max(experts, 1) <= 40:
        return TileConfig(16, 64, 128, 2, 4, f16=True), TileConfig(16, 64, 128, 2, 4, f16=True)
    return (TileConfig(128, 64, 256, 8, 3, promote=True, fused_gate_up=True),
            TileConfig(128, 64, 128, 8, 3, promote=True))


# Batch-invariant mode (`RunnerConfig.batch_invariant`, backend "triton_invariant"): tiles of
# the mma.sync family only (fp16 operands, fp32 sums chained along K in ascending steps), whose
# bits do not depend on BLOCK_M (< 64 rows), BLOCK_N, warps or BLOCK_K >= 64 (BLOCK_K 32 gives
# other bits), so a token's bits never change with the batch. Above 40 rows per expert the
# 32-row tiles halve the weight conversions (measurements: benchmarks/bench_moe_invariant.py).
INVARIANT_DECODE = (TileConfig(16, 64, 128, 2, 4, f16=True),) * 2
INVARIANT_PREFILL = (TileConfig(32, 64, 64, 2, 6, f16=True),) * 2


def invariant_configs(rows: int, experts: int) -> tuple[TileConfig, TileConfig]:
    """(w13, w2) tiles of the batch-invariant op: same bits at every size."""
    return INVARIANT_DECODE if rows / max(experts, 1) <= 40 else INVARIANT_PREFILL


def w4a16_configs(rows: int, experts: int) -> tuple[TileConfig, TileConfig]:
    """The W4A16 baseline's own tiles: 16 x 32 x 128 decode tiles (the W4A8 16 x 64 tiles are
    slower for it at T = 1; docs/perf/moe.md), 128-row bf16 wgmma tiles above, unpromoted
    (bf16 wgmma accumulates in fp32)."""
    if rows / max(experts, 1) <= 40:
        return TileConfig(16, 32, 128, 2, 4), TileConfig(16, 32, 128, 2, 4)
    return TileConfig(128, 64, 128, 8, 3), TileConfig(128, 128, 128, 8, 3)


# Swap-AB decode tiles (faster, less accurate; see default_configs): pass as `configs=`.
SWAP_DECODE = (TileConfig(16, 64, 256, 4, 4, swap_ab=True),
               TileConfig(16, 64, 256, 4, 4, swap_ab=True))
