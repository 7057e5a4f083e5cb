"""Ahead-of-time sm_90 builds of the Triton GEMM and MoE kernels at their real tiles and the
mini shapes, on the CPU (Triton's bundled ptxas): no register spills, FP8 wgmma where expected.
Catches a kernel that no longer compiles for Hopper, or a tile that spills, without a GPU."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from support.sm90 import H200_SMEM, sm90_build, sm90_compile, stack_bytes  # noqa: E402
from support.triton_interpreter import INTERP  # noqa: E402

pytestmark = pytest.mark.skipif(INTERP, reason="sm_90 builds: run without TRITON_INTERPRET")


def test_gemm_tiles_build_without_spills() -> None:
    """Every promoted FP8 GEMM tile and every grouped W8A16 tile builds for sm_90 without
    register spills (stack 0); the FP8 GEMM runs FP8 wgmma (QGMMA); split-K on 64-row tiles."""
    from shoal.ops.triton import gemm as tg
    from shoal.ops.triton import gemm_grouped as tgg

    ptrs = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "ws_ptr": "*fp32",
            "rs_ptr": "*fp32", "cs_ptr": "*fp32"}
    for bm, bn, bk, warps, stages in tg._TILES:
        if not tg._tile_ok(bm, bn, bk, warps, 64 if bm == 64 else 4096, 8192, 1, tg.PROMOTED):
            continue
        for split in ((1, 4) if bm == 64 else (1,)):
            consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
                      "SPLIT_K": split, "EVEN_K": True, "PROMOTE": tg.PROMOTED}
            usage, sass = sm90_build(tg._gemm_fp8_fixed.fn, ptrs, consts, warps, stages)
            tag = f"{consts} warps {warps} stages {stages}"
            assert stack_bytes(usage) == 0, f"{tag}: spills ({usage.strip()})"
            assert "QGMMA" in sass, f"{tag}: no FP8 wgmma"
    ptrs = {"o_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "z_ptr": "*bf16"}
    for bm, bn, bk, warps, stages in tgg._GROUPED_TILES:
        consts = {"G": 8, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "stride_ok": 1}
        usage, _ = sm90_build(tgg._grouped_w8a16_kernel.fn, ptrs, consts, warps, stages,
                              ("R", "K", "stride_om", "stride_og"))
        assert stack_bytes(usage) == 0, f"grouped {consts} {warps} warps: spills"


def test_moe_kernels_build_without_spills() -> None:
    """The grouped GEMM at the default decode and prefill tiles and the combine build for sm_90
    (no GPU needed) without register spills, at the mini shapes (D 5120, I 2304, 384 experts)."""
    from shoal.ops.triton import aot
    from shoal.ops.triton import moe as tmoe
    from shoal.ops.triton import moe_tiles as tiles

    if not aot.has_tools():
        pytest.skip("Triton's bundled cuobjdump is missing")
    for rows in (6, 8192 * 6):
        for cfg, swiglu, k in zip(tiles.default_configs(rows, 384), (True, False), (5120, 2304),
                                  strict=True):
            usage, _ = aot.usage_and_sass(aot.moe_gemm(cfg, swiglu, k, 1))
            assert stack_bytes(usage) == 0, f"{cfg} {'w13' if swiglu else 'w2'}: spills"
    for shared in (False, True):
        usage, _ = sm90_build(tmoe._combine_kernel, {"y_ptr": "*bf16", "shared_ptr": "*bf16",
                                                     "out_ptr": "*bf16" if shared else "*fp32"},
                              {"KTOP": 6, "SHARED": shared, "BLOCK": 1024}, 4, 2)
        assert stack_bytes(usage) == 0


def _packs_consecutive_k(ttgir: str) -> list[bool]:
    """For each inline-asm op (the prmt conversions, pack = 4): do a thread's registers come in
    groups of 4 consecutive K of one weight row? Linear layouts: the first two register bases
    are K + 1 and K + 2; blocked: K-major with a multiple of 4 elements per thread along K;
    wgmma register operands (dot_op): kWidth a multiple of 4."""
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*)$", ttgir, re.M))
    verdicts = []
    for line in ttgir.splitlines():
        tile = re.search(r"-> tensor<\d+x\d+x(?:i8|f16), (.*)>", line)
        if "elementwise_inline_asm" not in line or tile is None:  # (pdl_wait's are scalar)
            continue
        lay = tile.group(1)
        lay = layouts.get(lay, lay)
        if lay.startswith("#ttg.linear"):
            regs = re.search(r"register = \[(.*?)\], lane", lay).group(1)
            verdicts.append(regs.replace(" ", "").startswith("[0,1],[0,2]"))
        elif lay.startswith("#ttg.dot_op"):
            verdicts.append(int(re.search(r"kWidth = (\d+)", lay).group(1)) % 4 == 0)
        else:
            spt = [int(v) for v in re.search(r"sizePerThread = \[(.*?)\]", lay).group(1).split(",")]
            order = re.search(r"order = \[(.*?)\]", lay).group(1).replace(" ", "")
            verdicts.append(order == "1,0" and spt[1] % 4 == 0)
    return verdicts


def test_prmt_operands_pack_consecutive_k() -> None:
    """The prmt conversions (fp4_tiles.w_e4m3 CONVERT 1 / 2, w_f16) treat 4 packed elements as 4
    consecutive K of one row (one 32-block, one LUT); conversion 3 (w_f16_perm with a_f16_perm)
    permutes K inside those 4 on both operands. Triton picks the register layout, so this
    checks it in the sm_90 IR of every default MoE tile (decode and prefill) and the swap-AB
    decode tiles, for each conversion `_launch` allows there; and that the combination
    `_launch` refuses (variant 2 on plain 128-row tiles: wrong bits on the H200) fails it."""
    from shoal.ops.triton import aot
    from shoal.ops.triton import moe_tiles as tiles

    def verdicts(cfg, swiglu: bool, k: int, convert: int) -> list[bool]:
        return _packs_consecutive_k(aot.moe_gemm(cfg, swiglu, k, convert).asm["ttgir"])

    pairs = [*tiles.default_configs(6, 384), *tiles.default_configs(8192 * 6, 384),
             *tiles.SWAP_DECODE]
    for i, cfg in enumerate(pairs):
        swiglu, k = (True, 5120) if i % 2 == 0 else (False, 2304)
        for convert in ((1, 2) if cfg.swap_ab else (1, 3) if cfg.f16 else (1,)):
            got = verdicts(cfg, swiglu, k, convert)
            assert got and all(got), f"{cfg} convert {convert}: prmt operand layout {got}"
    big = tiles.default_configs(8192 * 6, 384)[0]
    assert not all(verdicts(big, True, 5120, 2)), "the refused combination should fail"


def test_router_logits_build_on_fp64_tensor_cores() -> None:
    """The router's fp64 logit slices (default and wide tile) build for sm_90 as FP64
    tensor-core MMAs (DMMA) without spills. A plain bf16 -> fp64 conversion of the dot
    operands aborts the sm_90 build ("fp64 don't support largeK MMA"); the kernel's inline-asm
    conversion step avoids it."""
    from shoal.ops.triton import aot
    from shoal.ops.triton import router as tr

    for bt, be, warps, stages in (tr.DEFAULT_TILE, tr.WIDE_TILE, tr.MID_TILE):
        built = sm90_compile(tr._logits_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16",
                                                 "ws_ptr": "*fp64"},
                             {"BT": bt, "BE": be, "SLICE": tr.SLICE_K, "ASM": True}, warps,
                             stages, ("D", "stride_xt", "stride_we"))
        usage, sass = aot.usage_and_sass(built)
        assert "DMMA" in sass, f"router logits {bt}x{be}: no fp64 tensor-core MMA"
        assert stack_bytes(usage) <= 32, f"router logits {bt}x{be}: {usage.strip()}"
        assert built.metadata.shared <= H200_SMEM, (bt, be, stages, built.metadata.shared)


def test_paged_rows_kernel_builds() -> None:
    """`paged_rows` builds for sm_90 for both logical-row dtypes the model passes (int32 top-k
    rows, int64 compressor rows), without a stack."""
    from shoal.ops.triton import attention_meta as tam

    for logical in ("*i32", "*i64"):
        usage, _ = sm90_build(tam._paged_kernel, {"l_ptr": logical, "r_ptr": "*i64",
                                                  "t_ptr": "*i32", "o_ptr": "*i32"},
                              {"BLOCK": 1024}, 4, 1, ())
        assert stack_bytes(usage) == 0


def test_sparse_attention_blocks_run_without_spills() -> None:
    """The registered sparse-attention kernel (chunked, P through scratch) at the Flash shape
    (64 heads x 512) builds for sm_90 with wgmma and no local-memory traffic inside its two
    block loops (SWA and compressed rows) at every decode configuration (splits with 1, 2 or
    4 column groups; what spills, <= 24 bytes, is outside the loops), and at most one reload
    in the prefill configuration's loops (one program per row). Before the e2m1 decode went
    through fp16 bits: one spill or reload in each decode loop, three in the prefill one."""
    from shoal.ops.triton import aot
    from shoal.ops.triton import attention as ta
    from shoal.ops.triton import attention_chunked as tac

    ptrs = {"q_ptr": "*bf16", "swa_ptr": "*u8", "swa_idx_ptr": "*i32", "comp_ptr": "*u8",
            "comp_idx_ptr": "*i32", "sink_ptr": "*fp32", "o_ptr": "*bf16", "part_ptr": "*fp32",
            "ml_ptr": "*fp32", "scale": "fp32", "scr_ptr": "*bf16"}
    knobs = ta.OP_KNOBS
    assert knobs["variant"] == "chunked" and knobs["p_mem"]
    for nsplit, dsplit in ((5, 1), (5, 2), (5, 4), (1, 1)):
        consts = {"H": 64, "HP": 64, "D": 512, "BLOCK_N": 64, "NSPLIT": nsplit,
                  "DSPLIT": dsplit, "HAS_COMP": True, "KEEP_K": False, "P_MEM": True,
                  "Q_RES": False}
        usage, sass = sm90_build(tac._sparse_attn_chunked_kernel, ptrs, consts, 8, 1,
                                 ("stride_qt", "stride_qh", "stride_si", "stride_ci"))
        loops = aot.loop_bodies(sass)
        assert len(loops) == 2 and "HGMMA" in sass, f"{consts}: {len(loops)} loops"
        local = [t for body in loops for t in body if re.search(r"\b(STL|LDL)\b", t)]
        assert len(local) <= (1 if nsplit == 1 else 0) and stack_bytes(usage) <= 24, (
            f"{consts}: {usage.strip()} {local[:3]}")
