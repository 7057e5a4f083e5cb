"""The MoE weight conversions of fp4_tiles.py (src/shoal/ops/triton/fp4_tiles.py): the e4m3 and
fp16 LUT words against exact e2m1 values, and the prmt byte-permute conversions emulated in
torch over every input word. Run where the MoE kernel tests run (CUDA sm_90, or the CPU
under the Triton interpreter).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from support.triton_interpreter import needs_kernels  # noqa: E402

pytestmark = needs_kernels

from shoal.ops.triton import fp4_tiles as ftiles  # noqa: E402
from shoal.quant.fp4 import E2M1_VALUES  # noqa: E402


def test_lut_table_matches_e4m3_of_shifted_e2m1() -> None:
    lut = ftiles.lut_table(torch.device("cpu")).view(torch.uint8).reshape(256, 8)
    for d in (0, 1, 5, 8, 9, 12, 255):
        want = (torch.tensor(E2M1_VALUES) * 2.0**-d).to(torch.float8_e4m3fn).float()
        got = lut[d].view(torch.float8_e4m3fn).float()
        assert torch.equal(got, want), d
    exact = torch.tensor(E2M1_VALUES) * 2.0**-8  # the fold is exact down to 8 binades
    assert torch.equal(lut[8].view(torch.float8_e4m3fn).float(), exact)


def test_closed_form_lut_words_equal_the_table() -> None:
    """`w_e4m3` computes the LUT words of shifts up to LUT0_CLOSED / LUT1_CLOSED in closed form
    and reads the table only beyond: both must agree bit for bit where the closed form is used,
    and the closed form must stop where it would go wrong (one binade further)."""
    lut = ftiles.lut_table(torch.device("cpu")).to(torch.int64) & 0xFFFFFFFF
    limits = (ftiles.LUT0_CLOSED.value, ftiles.LUT1_CLOSED.value)
    for word in (0, 1):
        for sh in range(limits[word] + 1):
            assert ftiles.lut_words(sh)[word] == int(lut[sh, word]), (word, sh)
        assert ftiles.lut_words(limits[word] + 1)[word] & 0xFFFFFFFF != int(
            lut[limits[word] + 1, word]), word


def _prmt(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """PTX prmt.b32 (default mode) on int64 tensors holding uint32 values: output byte i is byte
    (sel & 7) of the 8-byte {b:a}, or its msb replicated (0xFF / 0x00) when sel & 8, with sel the
    i-th nibble of c."""
    out = torch.zeros_like(c)
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        idx = sel & 7
        src = torch.where(idx < 4, a >> (8 * (idx & 3)), b >> (8 * (idx & 3))) & 0xFF
        byte = torch.where((sel & 8) != 0, torch.where(src >= 0x80, 0xFF, 0), src)
        out |= byte << (8 * i)
    return out


def test_f16_lut_words_are_exact_fp16_high_bytes() -> None:
    """`w_f16`'s LUT words: byte m of the 8-byte pair, as the high byte of an fp16 (low byte 0),
    is exactly e2m1 magnitude m times 2^-sh for every sh up to F16_CLOSED (13), and the closed
    form stops where it would go wrong (word 0 at 14: 0.5 * 2^-14 is no longer a normal
    high byte); beyond, both words are 0 (the block flushes)."""
    def decode(word: int) -> list[float]:
        hb = [(word >> (8 * i)) & 0xFF for i in range(4)]
        return [torch.tensor([b << 8], dtype=torch.int16).view(torch.float16).item() for b in hb]

    for sh in range(ftiles.F16_CLOSED.value + 1):
        w0, w1 = ftiles.f16_lut_words(sh)
        assert decode(w0) + decode(w1) == [v * 2.0 ** -sh for v in E2M1_VALUES], sh
    w0 = ftiles.F16_LUT0_BASE.value - 14 * ftiles.F16_LUT0_STEP.value
    assert decode(w0)[1] != 0.5 * 2.0 ** -14
    assert ftiles.f16_lut_words(14) == (0, 0) == ftiles.f16_lut_words(255)


def test_prmt_conversions_emulated_exhaustively() -> None:
    """The PTX of both asm conversions (`_w_e4m3` CONVERT 1 and 2), emulated instruction by
    instruction, gives the e4m3 bytes of the portable formula for all 65536 16-bit words (4
    codes) under several shift LUTs (the asm itself only runs on the device)."""
    lut = ftiles.lut_table(torch.device("cpu")).to(torch.int64) & 0xFFFFFFFF
    word = torch.arange(1 << 16, dtype=torch.int64)
    codes = torch.stack([(word >> (4 * j)) & 0xF for j in range(4)], 1)
    m32 = 0xFFFFFFFF
    c80 = torch.full_like(word, 0x80808080)
    for d in (0, 1, 3, 8, 9, 255):
        l0, l1 = lut[d, 0].expand_as(word), lut[d, 1].expand_as(word)
        mag = codes & 7
        want_lut = torch.where(mag < 4, l0[:, None], l1[:, None])
        want = ((want_lut >> ((mag & 3) * 8)) & 0xFF) | ((codes & 8) << 4)
        want = sum(want[:, j] << (8 * j) for j in range(4))
        # CONVERT 2: $1 low half = the word
        v = _prmt(l0, l1, word & 0x7777)
        g = ((_prmt(c80, c80, word) << 7) & m32) & 0x80808080
        assert torch.equal(v | g, want), d
        # CONVERT 1: $1 = [b0, b0, b1, b1]
        b0, b1 = word & 0xFF, word >> 8
        r = b0 | (b0 << 8) | (b1 << 16) | (b1 << 24)
        s1 = _prmt(r, torch.zeros_like(r), torch.full_like(r, 0x0020))
        v = _prmt(l0, l1, s1 & 0x7777)
        g = ((_prmt(c80, c80, s1) << 7) & m32) & 0x80808080
        assert torch.equal(v | g, want), d


def test_f16_prmt_conversion_emulated_exhaustively() -> None:
    """`w_f16`'s asm, emulated instruction by instruction, gives for all 65536 16-bit words (4
    codes) and several shifts the two fp16 pairs of the portable formula (sign | LUT high byte,
    low byte 0), in K order: $0 = (code 0, code 1), $1 = (code 2, code 3)."""
    word = torch.arange(1 << 16, dtype=torch.int64)
    codes = torch.stack([(word >> (4 * j)) & 0xF for j in range(4)], 1)
    m32 = 0xFFFFFFFF
    c80 = torch.full_like(word, 0x80808080)
    zero = torch.zeros_like(word)
    for sh in (0, 1, 5, 9, 13, 14):
        w0, w1 = ftiles.f16_lut_words(sh)
        l0, l1 = torch.full_like(word, w0), torch.full_like(word, w1)
        mag = codes & 7
        want_lut = torch.where(mag < 4, l0[:, None], l1[:, None])
        hb = ((want_lut >> ((mag & 3) * 8)) & 0xFF) | ((codes & 8) << 4)
        want0 = (hb[:, 0] << 8) | (hb[:, 1] << 24)
        want1 = (hb[:, 2] << 8) | (hb[:, 3] << 24)
        b0, b1 = word & 0xFF, word >> 8
        r = b0 | (b0 << 8) | (b1 << 16) | (b1 << 24)
        s1 = _prmt(r, zero, torch.full_like(r, 0x0020))
        v = _prmt(l0, l1, s1 & 0x7777) | (((_prmt(c80, c80, s1) << 7) & m32) & 0x80808080)
        assert torch.equal(_prmt(v, zero, torch.full_like(v, 0x1404)), want0), sh
        assert torch.equal(_prmt(v, zero, torch.full_like(v, 0x3424)), want1), sh


def test_f16_shift_conversion_emulated_exhaustively() -> None:
    """Conversion 3's asm (`w_f16_perm` / `a_f16_perm`), emulated instruction by instruction:
    for all 65536 16-bit words (4 codes c0..c3 of K 0..3) and shifts up to F16P_EXACT, the two
    fp16 pairs are the exact e2m1 * 2^-sh of (c0, c2) and (c1, c3); up to F16P_LAST their fp16
    roundings; beyond, zero; and the activation asm gives fp16 pairs (a0, a2), (a1, a3) of every e4m3 byte
    quadruple tried: the same K permutation on both operands."""
    word = torch.arange(1 << 16, dtype=torch.int64)
    codes = torch.stack([(word >> (4 * j)) & 0xF for j in range(4)], 1)
    e2m1 = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], dtype=torch.float64)
    b0, b1 = word & 0xFF, word >> 8
    r = b0 | (b0 << 8) | (b1 << 16) | (b1 << 24)  # the duplicated bytes of K 0..3
    m32 = 0xFFFFFFFF

    def lop3_ea(a, b, c):  # lop3 immLut 0xEA: (a & b) | c
        return (a & b) | c

    def f16_halves(x):
        h = torch.stack([x & 0xFFFF, (x >> 16) & 0xFFFF], 1).to(torch.int32).to(torch.int16)
        return h.view(torch.float16).to(torch.float64)

    t = (r << 4) & m32
    m1 = (r >> 3) & 0x0E000E00
    o1 = lop3_ea(r, 0x80008000, m1)
    m0 = (r << 1) & 0x0E000E00
    o0 = lop3_ea(t, 0x80008000, m0)
    raw0, raw1 = f16_halves(o0), f16_halves(o1)
    assert torch.equal(raw0, e2m1[codes[:, [0, 2]]] * 2.0**-14)
    assert torch.equal(raw1, e2m1[codes[:, [1, 3]]] * 2.0**-14)
    exact, last = ftiles.F16P_EXACT.value, ftiles.F16P_LAST.value
    for sh in (0, 1, 7, 13, 14, 20, exact, exact + 1, last, last + 1, 200):
        wmax, e = 200, 200 - sh  # the kernel's scale formula for a block e of a row max wmax
        f = max(e + (29 - wmax), 0) * 0x04000400
        assert f == (f & 0xFFFF) * 0x10001  # two equal halves, no carry between them
        scale = f16_halves(torch.tensor([f]))[0, 0].item()
        assert scale == (2.0 ** (14 - sh) if sh <= last else 0.0), sh
        want = e2m1 * 2.0**-sh if sh <= last else e2m1 * 0.0
        for raw, pair in ((raw0, [0, 2]), (raw1, [1, 3])):
            # mul.rn.f16x2 = the fp16 product (exact up to F16P_EXACT, rounded below)
            prod = (raw.to(torch.float16) * torch.tensor(scale, dtype=torch.float16)).to(torch.float64)
            ref = want[codes[:, pair]]
            if sh <= exact:
                assert torch.equal(prod, ref), sh
            else:
                assert torch.equal(prod, ref.to(torch.float16).to(torch.float64)), sh
    # activations: prmt [a0, a2, a1, a3], then e4m3x2 -> fp16x2 of each 16-bit half
    a = torch.randint(0, 1 << 32, (4096,), dtype=torch.int64)
    a[0] = 0x7F7E0180  # NaN, max finite, smallest subnormal, -0 bytes
    p = _prmt(a, torch.zeros_like(a), torch.full_like(a, 0x3120))
    by = torch.stack([(a >> (8 * j)) & 0xFF for j in range(4)], 1).to(torch.uint8)
    vals = by.view(torch.float8_e4m3fn).to(torch.float64)
    got = torch.stack([(p >> (8 * j)) & 0xFF for j in range(4)], 1).to(torch.uint8)
    got = got.view(torch.float8_e4m3fn).to(torch.float64)
    want = vals[:, [0, 2, 1, 3]]
    assert torch.equal(torch.nan_to_num(got, 7.0), torch.nan_to_num(want, 7.0))
