"""Candidate tile configurations of the routed-experts grouped GEMM that `bench_moe.py --sweep`
times (and `sass_moe.py` compiles): (w13, w2) pairs around the defaults of
`shoal.ops.triton.moe_tiles.default_configs`, each with the H200 or sm_90 SASS measurements
that kept or dropped it.
"""

from __future__ import annotations

from shoal.ops.triton import moe_tiles as tiles

V0_DECODE = (tiles.TileConfig(16, 32, 256, 4, 4), tiles.TileConfig(16, 64, 256, 4, 4))


def _swap(bm: int, bn: int, bk: int, warps: int, stages: int) -> tiles.TileConfig:
    return tiles.TileConfig(bm, bn, bk, warps, stages, swap_ab=True)


DECODE_CFGS = {
    "swap16x64k256s4": (_swap(16, 64, 256, 4, 4),) * 2,
    "swap16x64k128s6": (_swap(16, 64, 128, 4, 6),) * 2,
    "swap16x64k512s3": (_swap(16, 64, 512, 4, 3),) * 2,
    "swap16x128k256w4": (_swap(16, 128, 256, 4, 3),) * 2,
    "swap16x128k256w8": (_swap(16, 128, 256, 8, 3),) * 2,
    "swap32x64k256s4": (_swap(32, 64, 256, 4, 4),) * 2,
    "v0_plain": V0_DECODE,
}
# plain (exact fp32 mma.sync) decode tiles with fp16 weights around the default, `--sweep
# decode-plain` (the e4m3-weight candidates of 2026-11-29 chose the 2-warp 16 x 32 x 128 tile)


def _f16(bn: int, bk: int, warps: int, stages: int,
         maxnreg: int | None = None) -> tiles.TileConfig:
    return tiles.TileConfig(16, bn, bk, warps, stages, f16=True, maxnreg=maxnreg)


PLAIN_DECODE_CFGS = {
    "f16_default": (_f16(32, 128, 2, 4),) * 2,
    "f16_s3": (_f16(32, 128, 2, 3),) * 2,
    "f16_s6": (_f16(32, 128, 2, 6),) * 2,
    "f16_k256": (_f16(32, 256, 2, 4),) * 2,
    "f16_k64s8": (_f16(32, 64, 2, 8),) * 2,
    "f16_n64": (_f16(64, 128, 2, 4),) * 2,
    "f16_w4n64": (_f16(64, 128, 4, 4),) * 2,
    "f16_n16": (_f16(16, 128, 2, 4),) * 2,
    "f16_w1n16": (_f16(16, 128, 1, 4),) * 2,
    "f16_w2n64": (_f16(32, 128, 2, 4), _f16(64, 128, 2, 4)),
    "f16_n64s3": (_f16(64, 128, 2, 3),) * 2,
    "f16_n64s6": (_f16(64, 128, 2, 6),) * 2,
    "f16_n128w4": (_f16(128, 128, 4, 4),) * 2,
    "f16_n64w2n128": (_f16(64, 128, 2, 4), _f16(128, 128, 4, 4)),
    "f16_n64k64": (_f16(64, 64, 2, 6),) * 2,
    # ptxas register caps (sm_90 builds: w13 197 -> 168 or 160 registers, no spills in the
    # loop: 3 instead of 2 warps per scheduler; w2 140 -> 128: 4 instead of 3)
    "f16_n64_r168_r128": (_f16(64, 128, 2, 4, 168), _f16(64, 128, 2, 4, 128)),
    "f16_n64_r160_r128": (_f16(64, 128, 2, 4, 160), _f16(64, 128, 2, 4, 128)),
    "f16_n64_r128w2": (_f16(64, 128, 2, 4), _f16(64, 128, 2, 4, 128)),
}
# promoted wgmma prefill tiles around the default (`--sweep prefill`; sm_90 builds without
# spills: 128 x 64 / 128 x 128 at 3 or 4 stages; 128 x 128 w13, 256-row and 4-warp tiles spill)
_PP = tiles.TileConfig
PREFILL_CFGS = {
    "p_default": (_PP(128, 64, 128, 8, 3, promote=True), _PP(128, 128, 128, 8, 3, promote=True)),
    "p_s4": (_PP(128, 64, 128, 8, 4, promote=True), _PP(128, 128, 128, 8, 4, promote=True)),
    "p_w2n64": (_PP(128, 64, 128, 8, 3, promote=True), _PP(128, 64, 128, 8, 3, promote=True)),
    "p_w2n64s4": (_PP(128, 64, 128, 8, 4, promote=True), _PP(128, 64, 128, 8, 4, promote=True)),
    "p_s2": (_PP(128, 64, 128, 8, 2, promote=True), _PP(128, 128, 128, 8, 2, promote=True)),
    # BLOCK_K 256: one promotion add per 256 K (sm_90 SASS: 6.39 -> 5.39 loop instructions per
    # converted w13 element; 255 registers, no spills). p_k256w13 was `default_configs`' prefill
    # pair in sessions 12-14, p_fused is since session 15 ("p_default" is the session-9 pair,
    # its w2 at BLOCK_N 128)
    "p_k256": (_PP(128, 64, 256, 8, 3, promote=True), _PP(128, 64, 256, 8, 3, promote=True)),
    "p_k256s2": (_PP(128, 64, 256, 8, 2, promote=True), _PP(128, 64, 256, 8, 2, promote=True)),
    "p_k256w13": (_PP(128, 64, 256, 8, 3, promote=True), _PP(128, 64, 128, 8, 3, promote=True)),
    # two CTAs per SM (session 15; ncu of p_k256w13's w13 at T = 8192: one 8-warp CTA per SM,
    # 2 warps per scheduler, issue slots 31% busy: each step's conversion and its wgmma run one
    # after the other). sm_90 SASS: w13 128 x 32 x 256 at 2 stages 142 registers (1 CTA),
    # capped at 128 16 B of stack, 86 KB smem, 6.08 loop instructions per element (5.39)
    "p_n32": (_PP(128, 32, 256, 8, 2, promote=True), _PP(128, 64, 128, 8, 3, promote=True)),
    "p_n32_2cta": (_PP(128, 32, 256, 8, 2, promote=True, maxnreg=128),
                   _PP(128, 64, 128, 8, 3, promote=True)),
    "p_w2k256_2cta": (_PP(128, 64, 256, 8, 3, promote=True),
                      _PP(128, 64, 256, 8, 2, promote=True, maxnreg=128)),
    "p_w2s2": (_PP(128, 64, 256, 8, 3, promote=True), _PP(128, 64, 128, 8, 2, promote=True)),
    "p_2cta_both": (_PP(128, 32, 256, 8, 2, promote=True, maxnreg=128),
                    _PP(128, 64, 256, 8, 2, promote=True, maxnreg=128)),
    # gate and up in one weight tile and one MMA chain per step (TileConfig.fused_gate_up;
    # sm_90 SASS at 128 x 64 x 256: 616 loop instructions per step against 690, one wgmma wait
    # per step against two, 246 registers, 180 KB smem)
    "p_fused": (_PP(128, 64, 256, 8, 3, promote=True, fused_gate_up=True),
                _PP(128, 64, 128, 8, 3, promote=True)),
    "p_fused_k128s4": (_PP(128, 64, 128, 8, 4, promote=True, fused_gate_up=True),
                       _PP(128, 64, 128, 8, 3, promote=True)),
    "p_fused_n32s4": (_PP(128, 32, 256, 8, 4, promote=True, fused_gate_up=True),
                      _PP(128, 64, 128, 8, 3, promote=True)),
}
