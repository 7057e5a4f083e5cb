"""MXFP4 weight tiles decoded in registers for the grouped MoE GEMMs (ops/triton/moe.py).

- `w_e4m3`: e2m1 codes -> e4m3 bytes whose exponent is shifted by (block scale - row max scale),
  through an 8-byte LUT per 32-block (`lut_words` in closed form for shifts up to 5 / 7
  binades, beyond them a row of `lut_table`, 256 shifts x 8 bytes): CONVERT 0 portable integer
  ops (what the Triton interpreter runs), 1 `prmt` on duplicated bytes, 2 `prmt` on the 16-bit
  word of 4 codes (inline PTX; all three give identical bits, checked on the device).
- `w_f16`: the same tile straight to fp16 (a per-block LUT of fp16 high bytes) for the 16-row
  mma.sync tiles, which run FP8 operands as fp16 anyway.
- `w_f16_perm` with `a_f16_perm` (the MoE's CONVERT 3, the default on those tiles): the fp16
  tile by shifts and masks and an fp16x2 block-scale multiply, no LUT, with K permuted inside
  every 4 consecutive K on both dot operands.
- `w_bf16`: the exact bf16 dequantisation (the W4A16 baseline).
- `row_max_exp` / `col_scale`: the per-row largest UE8M0 exponent and its fp32 scale.
Invariant: the decoded tile times the row's column scale equals the reference dequantisation
(exact, except e4m3 underflow of blocks more than 8 binades below the row's largest).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shoal.quant.fp4 import E2M1_VALUES


@functools.lru_cache(maxsize=8)
def lut_table(device: torch.device) -> torch.Tensor:
    """[256, 2] int32: for a shift d, the e4m3 bytes of e2m1 magnitude m * 2^-d (m = 0..7, RNE,
    underflow to 0), byte m of the 8-byte little-endian pair."""
    d = torch.arange(256, dtype=torch.float32)
    vals = torch.tensor(E2M1_VALUES, dtype=torch.float32)[None, :] * torch.exp2(-d)[:, None]
    codes = vals.to(torch.float8_e4m3fn).view(torch.uint8).contiguous()
    return codes.view(torch.int32).reshape(256, 2).contiguous().to(device)


# e4m3 bytes of e2m1 magnitudes 0, 0.5, 1, 1.5 (LUT word 0) and 2, 3, 4, 6 (word 1), little-endian;
# shifted down by sh binades they stay normal (exponent field >= 1) for sh <= 5 and sh <= 7.
LUT0_BASE = tl.constexpr(0x3C383000)
LUT1_BASE = tl.constexpr(0x4C484440)
LUT0_STEP = tl.constexpr(0x08080800)  # one binade: exponent field - 1 in bytes 1-3 (byte 0 is 0)
LUT1_STEP = tl.constexpr(0x08080808)
LUT0_CLOSED = tl.constexpr(5)
LUT1_CLOSED = tl.constexpr(7)


def lut_words(sh: int) -> tuple[int, int]:
    """The closed form of `lut_table` row sh (sh <= 5 for word 0, <= 7 for word 1)."""
    return LUT0_BASE.value - sh * LUT0_STEP.value, LUT1_BASE.value - sh * LUT1_STEP.value


def _lut_asm(r: str, lut0: str, lut1: str, tail: str) -> str:
    """PTX of the prmt conversion from duplicated bytes: operand r = [b0, b0, b1, b1] (4
    consecutive K), lut0 / lut1 the element's 8-byte LUT; s = the 4 nibble codes, v = their
    LUT bytes, g = 0xFF / 0x80 per sign nibble (prmt sign-replicate mode on 0x80 bytes), whose
    bit 0 shifted to bit 7 is the sign; `tail` combines v and g into the outputs."""
    return f"""{{
            .reg .b32 s, m, v, g, c80, z;
            mov.b32 z, 0;
            mov.b32 c80, 0x80808080;
            prmt.b32 s, {r}, z, 0x0020;
            and.b32 m, s, 0x7777;
            prmt.b32 v, {lut0}, {lut1}, m;
            prmt.b32 g, c80, c80, s;
            shl.b32 g, g, 7;
            and.b32 g, g, 0x80808080;
            {tail}
            }}"""


# w_e4m3 CONVERT 1: the 4 e4m3 bytes; w_f16: [h0, h1, h2, h3] high bytes -> two fp16 pairs
# $0 = [0, h0, 0, h1], $1 = [0, h2, 0, h3]
E4M3_ASM = tl.constexpr(_lut_asm("$1", "$2", "$6", "or.b32 $0, v, g;"))
F16_ASM = tl.constexpr(_lut_asm("$2", "$3", "$7", "or.b32 v, v, g;\n"
                                "            prmt.b32 $0, v, z, 0x1404;\n"
                                "            prmt.b32 $1, v, z, 0x3424;"))


@triton.jit
def block_scales(ws_ptr, wrow, k0, KB, BN: tl.constexpr, BK: tl.constexpr):
    """The UE8M0 bytes [BN, BK / 32] of weight rows `wrow` for the K step at k0. The tile
    functions below take this tile as `sc`, so a K loop can load the next step's scales while
    it converts this step's weights (loaded inside the conversion, each K step of the sm_90
    decode tile waited on two synchronous global loads: Triton pipelines only the loads that
    feed the dot operands)."""
    offs = k0 // 32 + tl.arange(0, BK // 32)
    return tl.load(ws_ptr + wrow[:, None] * KB + offs[None, :])


@triton.jit
def dup_bytes(w_ptr, wrow, k0, K2, BN: tl.constexpr, BK: tl.constexpr):
    """Packed bytes [BN, BK/2] at K offset k0 -> [BN, BK] uint8 with byte i at 2i and 2i + 1."""
    offs = tl.multiple_of(k0 // 2, BK // 2) + tl.arange(0, BK // 2)  # (hint: 16-byte loads)
    wb = tl.load(w_ptr + wrow[:, None] * K2 + offs[None, :])
    return tl.reshape(tl.join(wb, wb), (BN, BK))


@triton.jit
def lut_bytes(wd, lut0, lut1, BK: tl.constexpr):
    """The portable conversion: duplicated bytes wd [BN, BK] (element k holds byte k // 2) ->
    int32 [BN, BK], byte m of the element's 8-byte LUT (m its code's magnitude) with the code's
    sign in bit 7. What the prmt asm computes, in integer ops (the Triton interpreter runs it)."""
    par = (tl.arange(0, BK) % 2)[None, :]
    code = tl.where(par == 0, wd & 0xF, wd >> 4).to(tl.int32)
    mag = code & 7
    lut = tl.where(mag < 4, lut0, lut1)
    return ((lut >> ((mag & 3) * 8)) & 0xFF) | ((code & 8) << 4)


@triton.jit
def w_e4m3(w_ptr, sc, lut_ptr, wrow, wmax, k0, K2, BN: tl.constexpr, BK: tl.constexpr,
            CONVERT: tl.constexpr):
    """Folded e4m3 weight tile [BN, BK]: e2m1 * 2^(block exp - row max exp wmax [BN]).

    CONVERT 0: portable integer ops per element (runs under the interpreter); 1: `prmt` on
    duplicated bytes; 2: `prmt` on the 16-bit word of each 4 K elements (fewest instructions).
    1 and 2 need every 4 packed elements of the asm to be 4 consecutive K of one row (true for
    the wgmma / mma operand layouts Triton picks; test_w4a8_asm_equals_portable_conversion
    checks all three give identical bits on the device). sc: `block_scales` of the step."""
    sh = tl.minimum(wmax[:, None] - sc.to(tl.int32), 255)
    # The LUT words in closed form while every byte stays an e4m3 normal (or the 0 of code 0):
    # lowering the exponent field by sh is subtracting sh * 8 from each byte (`lut_words`);
    # only blocks further below their row's largest read the table (gathering it for every
    # block is slower: data-dependent bank conflicts; measurements: docs/perf/fp4_tiles.md).
    near0 = sh <= LUT0_CLOSED
    near1 = sh <= LUT1_CLOSED
    lut0 = tl.where(near0, LUT0_BASE - sh * LUT0_STEP,
                    tl.load(lut_ptr + sh * 2, mask=~near0, other=0))
    lut1 = tl.where(near1, LUT1_BASE - sh * LUT1_STEP,
                    tl.load(lut_ptr + sh * 2 + 1, mask=~near1, other=0))
    lut0 = tl.reshape(tl.broadcast_to(lut0[:, :, None], (BN, BK // 32, 32)), (BN, BK))
    lut1 = tl.reshape(tl.broadcast_to(lut1[:, :, None], (BN, BK // 32, 32)), (BN, BK))
    if CONVERT == 2:
        # $1 = two int16 elements, the low one the word [b0, b1] of K 0..3 (codes c0..c3 in its
        # 4 nibbles); $3 / $7 = the 8-byte LUT of element 0 (4 consecutive K: one 32-block).
        # prmt #1 looks up the 4 magnitudes; prmt #2 (sign-replicate mode on 0x80 bytes) gives
        # 0xFF / 0x80 per sign nibble, whose bit 0 shifted to bit 7 is the e4m3 sign.
        w16_ptr = w_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        offs = tl.multiple_of(k0 // 4, BK // 4) + tl.arange(0, BK // 4)
        w16 = tl.load(w16_ptr + wrow[:, None] * (K2 // 2) + offs[None, :])
        w16 = tl.reshape(tl.broadcast_to(w16[:, :, None], (BN, BK // 4, 4)), (BN, BK))
        byte = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 m, v, g, c80;
            mov.b32 c80, 0x80808080;
            and.b32 m, $1, 0x7777;
            prmt.b32 v, $3, $7, m;
            prmt.b32 g, c80, c80, $1;
            shl.b32 g, g, 7;
            and.b32 g, g, 0x80808080;
            or.b32 $0, v, g;
            }""",
            constraints="=r,r,r,r,r,r,r,r,r,r,r", args=[w16, lut0, lut1], dtype=tl.uint8,
            is_pure=True, pack=4)
    else:
        wd = dup_bytes(w_ptr, wrow, k0, K2, BN, BK)
        if CONVERT == 1:
            # r = [b0, b0, b1, b1] (4 consecutive K); s = nibble codes of K 0..3; then as above.
            byte = tl.inline_asm_elementwise(
                asm=E4M3_ASM,
                constraints="=r,r,r,r,r,r,r,r,r,r", args=[wd, lut0, lut1], dtype=tl.uint8,
                is_pure=True, pack=4)
        else:
            byte = lut_bytes(wd, lut0, lut1, BK).to(tl.uint8)
    return byte.to(tl.float8e4nv, bitcast=True)


# fp16 high bytes of e2m1 magnitudes 0, 0.5, 1, 1.5 (word 0) and 2, 3, 4, 6 (word 1), whose low
# bytes are 0; shifted down by sh binades (exponent field - sh: bytes - 4 sh) they stay normal
# for sh <= 13 (word 0) and 15 (word 1). `w_f16` flushes blocks beyond 13 to zero.
F16_LUT0_BASE = tl.constexpr(0x3E3C3800)
F16_LUT1_BASE = tl.constexpr(0x46444240)
F16_LUT0_STEP = tl.constexpr(0x04040400)
F16_LUT1_STEP = tl.constexpr(0x04040404)
F16_CLOSED = tl.constexpr(13)


def f16_lut_words(sh: int) -> tuple[int, int]:
    """`w_f16`'s LUT words for a shift sh (0 <= sh <= 13; beyond, both 0)."""
    if sh > F16_CLOSED.value:
        return 0, 0
    return (F16_LUT0_BASE.value - sh * F16_LUT0_STEP.value,
            F16_LUT1_BASE.value - sh * F16_LUT1_STEP.value)


@triton.jit
def w_f16(w_ptr, sc, wrow, wmax, k0, K2, BN: tl.constexpr, BK: tl.constexpr,
          USE_ASM: tl.constexpr):
    """Folded fp16 weight tile [BN, BK]: e2m1 * 2^(block exp - row max exp wmax [BN]), for the
    16-row mma.sync tiles, whose FP8 operands Triton widens to fp16 anyway (one F2FP per two
    e4m3 bytes): the codes go straight to fp16 through a per-block LUT of fp16 high bytes
    (`f16_lut_words`; `prmt` as w_e4m3's CONVERT 1 when USE_ASM, else portable integer ops,
    the same bits). Exact for blocks up to 13 binades below their row's largest (e4m3: 8),
    flushed to zero beyond; where both are exact the values equal w_e4m3's, so the MMA sees
    the same fp16 operands and gives the same bits. sc: `block_scales` of the step."""
    sh = wmax[:, None] - sc.to(tl.int32)
    keep = sh <= F16_CLOSED
    lut0 = tl.where(keep, F16_LUT0_BASE - sh * F16_LUT0_STEP, 0)
    lut1 = tl.where(keep, F16_LUT1_BASE - sh * F16_LUT1_STEP, 0)
    lut0 = tl.reshape(tl.broadcast_to(lut0[:, :, None], (BN, BK // 32, 32)), (BN, BK))
    lut1 = tl.reshape(tl.broadcast_to(lut1[:, :, None], (BN, BK // 32, 32)), (BN, BK))
    wd = dup_bytes(w_ptr, wrow, k0, K2, BN, BK)
    if USE_ASM:
        # as w_e4m3 CONVERT 1 up to v | g = the 4 high bytes, then two fp16 pairs
        h = tl.inline_asm_elementwise(
            asm=F16_ASM,
            constraints="=r,=r,r,r,r,r,r,r,r,r,r", args=[wd, lut0, lut1], dtype=tl.float16,
            is_pure=True, pack=4)
    else:
        h = (lut_bytes(wd, lut0, lut1, BK) << 8).to(tl.int16).to(tl.float16, bitcast=True)
    return h


# w_f16_perm / a_f16_perm (CONVERT 3): the operands of the 16-row f16 tiles with K permuted
# inside every 4 consecutive K (slots 1 and 2 swapped, the same on both sides, so the dot sums
# the same products). A register r of 4 duplicated-byte elements [b0, b0, b1, b1] holds the
# codes c0..c3 of K 0..3 with c1 in bits 12-15 and c3 in bits 28-31, c0 / c2 four bits lower:
# the sign bit already sits at an fp16 sign position and the magnitude needs one shift (fp16
# bits of e2m1 * 2^-14), so each fp16 pair is 2-3 integer ops without a LUT; the block scale
# is then an fp16x2 multiply by 2^(14 - sh) (FMA pipe, not the integer pipe the LUT
# conversion saturates). r >> 3 and r << 1 put the magnitudes at bits 9-11 / 25-27.
# Nothing cheaper exists in this form: one rotate + one mask per fp16 pair would need the code
# fields' fp16 positions {9, 10, 11, 15} (bf16: {6, 7, 8, 15}) to tile 16 bits by 4 translates,
# and no 4 translates do (exhaustive check), so a weight repacking cannot give it. At T = 1 the
# decode tiles are issue-bound on this conversion (profile: docs/perf/fp4_tiles.md).
F16P_ASM = tl.constexpr("""{
            .reg .b32 t, m0, m1, o0, o1;
            shl.b32 t, $2, 4;
            shr.b32 m1, $2, 3;
            and.b32 m1, m1, 0x0E000E00;
            lop3.b32 o1, $2, 0x80008000, m1, 0xEA;
            shl.b32 m0, $2, 1;
            and.b32 m0, m0, 0x0E000E00;
            lop3.b32 o0, t, 0x80008000, m0, 0xEA;
            mul.rn.f16x2 $0, o0, $3;
            mul.rn.f16x2 $1, o1, $3;
            }""")
# e4m3 bytes [a0, a1, a2, a3] -> fp16 pairs (a0, a2), (a1, a3): the same K permutation
A16P_ASM = tl.constexpr("""{
            .reg .b32 p;
            .reg .b16 lo, hi;
            prmt.b32 p, $2, 0, 0x3120;
            mov.b32 {lo, hi}, p;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }""")
F16P_EXACT = tl.constexpr(23)  # e2m1 * 2^-sh is an fp16 (normal or subnormal) up to here
F16P_LAST = tl.constexpr(28)  # the last shift with a nonzero (normal) fp16 scale 2^(14 - sh)


@triton.jit
def w_f16_perm(w_ptr, sc, wrow, wmax, k0, K2, BN: tl.constexpr, BK: tl.constexpr):
    """As `w_f16` (the folded fp16 tile e2m1 * 2^(block exp - wmax)), K permuted as
    `a_f16_perm` (slots 1 and 2 of every 4 consecutive K swapped): only for a dot with an
    `a_f16_perm` operand. Exact for blocks up to F16P_EXACT binades below their row's largest
    (w_f16: 13); 24 to 28 binades below, the fp16 products are rounded to nearest (values under
    2^-24 flush); further down the scale is 0. The scale of a block sh = wmax - e binades down
    is the fp16x2 2^(14 - sh), exponent field 29 - sh: max(e + (29 - wmax), 0) * 0x04000400
    (one add, one max, one multiply per block; the halves cannot carry into each other)."""
    f = tl.maximum(sc.to(tl.int32) + (29 - wmax[:, None]), 0) * 0x04000400
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BN, BK // 32, 32)), (BN, BK))
    wd = dup_bytes(w_ptr, wrow, k0, K2, BN, BK)
    return tl.inline_asm_elementwise(asm=F16P_ASM, constraints="=r,=r,r,r,r,r,r",
                                     args=[wd, f], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def a_f16_perm(a):
    """e4m3 activations [BM, BK] -> fp16 (exact) with slots 1 and 2 of every 4 consecutive K
    swapped (`w_f16_perm`'s permutation)."""
    return tl.inline_asm_elementwise(asm=A16P_ASM, constraints="=r,=r,r",
                                     args=[a.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                                     is_pure=True, pack=4)


@triton.jit
def w_bf16(w_ptr, sc, wrow, k0, K2, BN: tl.constexpr, BK: tl.constexpr):
    """Dequantised bf16 weight tile [BN, BK] (exact): e2m1 as fp16 bits (value * 2^-14) * scale
    (sc: `block_scales` of the step)."""
    f = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    f = tl.where(sc == 255, float("nan"), f)
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BN, BK // 32, 32)), (BN, BK))
    wd = dup_bytes(w_ptr, wrow, k0, K2, BN, BK)
    par = (tl.arange(0, BK) % 2)[None, :]
    code = tl.where(par == 0, wd & 0xF, wd >> 4).to(tl.int16)
    h16 = ((code & 8) << 12) | ((code & 7) << 9)
    return (h16.to(tl.float16, bitcast=True).to(tl.float32) * f).to(tl.bfloat16)


@triton.jit
def row_max_exp(ws_ptr, wrow, KB, BN: tl.constexpr, KB_P2: tl.constexpr):
    kb = tl.arange(0, KB_P2)
    s = tl.load(ws_ptr + wrow[:, None] * KB + kb[None, :], mask=kb[None, :] < KB, other=0)
    return tl.max(s.to(tl.int32), 1)


@triton.jit
def col_scale(wmax):
    c = (wmax << 23).to(tl.float32, bitcast=True)
    return tl.where(wmax == 255, float("nan"), c)
