"""Triton (sm_90) Engram ops (model.md §2.10): `engram_gather` (FP8 table rows + UE8M0 scales ->
bf16) and `engram_mix` (gated mix of the n-gram value into each residual stream), plus the
shared exact fp32 -> bf16 rounding `bf16_rne`.

- engram_gather: one program per ROWS gathered rows. e4m3 codes and UE8M0 bytes are decoded by
  integer bit manipulation (no float8 dtypes, so the interpreter runs it too); q * 2^(e-127) is
  exact in fp32 (4 significant bits, exponent >= -136, fp32 subnormals reach 2^-149), then one
  round-to-nearest-even to bf16 on the bits. Offsets are int64 (tables have ~4e8 rows).
- engram_mix: one program per (token, stream) walks D twice in BD (<= 2048) chunks: first
  the three fp32 reductions (sum R^2, sum key^2, sum R*w*key), then the gated update. The gate is evaluated in fp32 (the reference uses fp64; well inside bf16 tolerance).
Invariant: engram_gather is bit-identical to the reference (NaN codes/scales give NaN);
engram_mix has the reference contract (gate 0 where gate_mask is False).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.ops.registry import REGISTRY
from shoal.ops.triton.norm import on_device
from shoal.ops.triton.pdl import PDL_LAUNCH, pdl_wait


@triton.jit
def bf16_rne(v):
    """fp32 v -> int16 bits of bf16(v), round to nearest even (subnormals and overflow to inf
    as the IEEE cast; NaN -> 0x7FC0). Done on the bits: the interpreter's cast truncates."""
    bits = v.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    r = tl.where(v != v, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def e4m3_value(c):
    """int32 e4m3fn byte (0..255) -> fp32 value (exact; codes 0x7F/0xFF are NaN)."""
    ex = (c >> 3) & 15
    mt = c & 7
    normal = (((ex + 120) << 23) | (mt << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(ex == 0, mt.to(tl.float32) * 0.001953125, normal)  # subnormal: mt * 2^-9
    mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
    # sign by the bit (negation is 0 - x in Triton: -0.0 would come out +0.0)
    return (mag.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_value(e):
    """int32 UE8M0 byte -> fp32 2^(e - 127) (byte 0 -> subnormal 2^-127, 0xFF -> NaN)."""
    s = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
    return tl.where(e == 255, float("nan"), s)


@triton.jit
def _gather_kernel(tab_ptr, sc_ptr, ids_ptr, o_ptr, NR, N, st_r, st_c, ss_r, ss_c, si_t, si_n,
                   DH: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr):
    pdl_wait()
    g = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # flat (token, head) index
    gmask = g < NR
    t = g // N
    j = g % N
    rid = tl.load(ids_ptr + t * si_t + j * si_n, mask=gmask, other=0).to(tl.int64)
    col = tl.arange(0, BD)
    mask = gmask[:, None] & (col < DH)[None, :]
    code = tl.load(tab_ptr + rid[:, None] * st_r + col[None, :] * st_c, mask=mask, other=0)
    e = tl.load(sc_ptr + rid[:, None] * ss_r + (col // 32)[None, :] * ss_c, mask=mask,
                other=127)
    v = e4m3_value(code.to(tl.int32) & 0xFF) * ue8m0_value(e.to(tl.int32) & 0xFF)
    tl.store(o_ptr + g[:, None] * DH + col[None, :], bf16_rne(v), mask=mask)


def _supports_gather(*, table: torch.Tensor, table_scale: torch.Tensor, row_ids: torch.Tensor,
                     **_) -> bool:
    return (on_device(table) and table.dim() == 2 and table.element_size() == 1
            and table.dtype in (torch.float8_e4m3fn, torch.uint8) and table.shape[1] % 32 == 0
            and table_scale.dtype == torch.uint8
            and table_scale.shape == (table.shape[0], table.shape[1] // 32)
            and row_ids.dim() == 2 and not row_ids.is_floating_point()
            and row_ids.device == table.device and table_scale.device == table.device)


@REGISTRY.implement("triton", "engram_gather", supports=_supports_gather)
def engram_gather(*, table: torch.Tensor, table_scale: torch.Tensor,
                  row_ids: torch.Tensor) -> torch.Tensor:
    """table [rows, Dh] e4m3 + table_scale [rows, Dh/32] UE8M0; row_ids [T, n] ->
    [T, n * Dh] bf16, bit-identical to the reference."""
    t, n = row_ids.shape
    dh = table.shape[1]
    out = torch.empty(t, n * dh, dtype=torch.bfloat16, device=table.device)
    nr = t * n
    if nr:
        codes = table.view(torch.uint8)
        bd = triton.next_power_of_2(dh)
        rows = max(1, min(16, 2048 // bd))
        _gather_kernel[(triton.cdiv(nr, rows),)](
            codes, table_scale, row_ids, out.view(torch.int16), nr, n, codes.stride(0),
            codes.stride(1), table_scale.stride(0), table_scale.stride(1), row_ids.stride(0),
            row_ids.stride(1), DH=dh, BD=bd, ROWS=rows, num_warps=4, **PDL_LAUNCH)
    return out


@triton.jit
def _mix_kernel(s_ptr, kv_ptr, qw_ptr, kw_ptr, m_ptr, o_ptr, eps, inv_sqrt_d, ss_t, ss_h, ss_d,
                sk_t, sk_d, sq_h, sq_d, sw_h, sw_d, sm_t, HC: tl.constexpr, D: tl.constexpr,
                BD: tl.constexpr, HAS_MASK: tl.constexpr):
    """One (token, stream): the stream's gate needs only its own row, its key and the weights,
    so a token's HC streams run in parallel (one program per token is slower: 20 dependent
    512-column steps; measurements: docs/perf/engram.md)."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    sb = s_ptr + t * ss_t + h * ss_h
    kb = kv_ptr + t * sk_t + (h * D) * sk_d
    ssh = tl.zeros([BD], tl.float32)
    ssk = tl.zeros([BD], tl.float32)
    dot = tl.zeros([BD], tl.float32)
    for d0 in range(0, D, BD):
        col = d0 + tl.arange(0, BD)
        mask = col < D
        x = tl.load(sb + col * ss_d, mask=mask, other=0.0).to(tl.float32)
        k = tl.load(kb + col * sk_d, mask=mask, other=0.0).to(tl.float32)
        w = (tl.load(qw_ptr + h * sq_h + col * sq_d, mask=mask, other=0.0).to(tl.float32)
             * tl.load(kw_ptr + h * sw_h + col * sw_d, mask=mask, other=0.0).to(tl.float32))
        ssh += x * x
        ssk += k * k
        dot += x * w * k
    rstd = ((1.0 / tl.sqrt_rn(tl.sum(ssh, axis=0) / D + eps))
            * (1.0 / tl.sqrt_rn(tl.sum(ssk, axis=0) / D + eps)))
    dot = tl.sum(dot, axis=0) * rstd * inv_sqrt_d
    root = tl.sqrt_rn(tl.maximum(tl.abs(dot), 1e-6, propagate_nan=tl.PropagateNan.ALL))
    root = tl.where(dot.to(tl.int32, bitcast=True) < 0, -root, root)  # copysign (-0.0 too)
    gate = 1.0 / (1.0 + tl.exp(-root))
    if HAS_MASK:
        keep = tl.load(m_ptr + t * sm_t).to(tl.int32)
        gate = tl.where(keep != 0, gate, 0.0)
    ob = o_ptr + t * (HC * D) + h * D
    for d0 in range(0, D, BD):
        col = d0 + tl.arange(0, BD)
        mask = col < D
        x = tl.load(sb + col * ss_d, mask=mask, other=0.0).to(tl.float32)
        val = tl.load(kv_ptr + t * sk_t + (HC * D + col) * sk_d, mask=mask,
                      other=0.0).to(tl.float32)
        tl.store(ob + col, bf16_rne(x + gate * val), mask=mask)


def _supports_mix(*, stream: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, gate_mask: torch.Tensor | None = None, **_) -> bool:
    if not (on_device(stream) and stream.dim() == 3 and stream.is_floating_point()):
        return False
    t, hc, d = stream.shape
    return (kv.shape == (t, (hc + 1) * d) and kv.is_floating_point()
            and q_weight.shape == (hc, d) and k_weight.shape == (hc, d)
            and (gate_mask is None or (gate_mask.shape == (t,) and gate_mask.dtype == torch.bool))
            and hc <= 16)


@REGISTRY.implement("triton", "engram_mix", supports=_supports_mix)
def engram_mix(*, stream: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor,
               k_weight: torch.Tensor, eps: float,
               gate_mask: torch.Tensor | None = None) -> torch.Tensor:
    """R_i <- bf16(R_i + gate_i * value) per stream i; stream [T, hc, D], kv [T, (hc+1) D]
    (key = first hc*D, value = last D), gate_mask [T] bool or None -> [T, hc, D] bf16."""
    t, hc, d = stream.shape
    out = torch.empty(t, hc, d, dtype=torch.bfloat16, device=stream.device)
    if t:
        has_mask = gate_mask is not None
        mask = gate_mask.view(torch.uint8) if has_mask else stream
        bd = min(triton.next_power_of_2(d), 2048)
        _mix_kernel[(t, hc)](
            stream, kv, q_weight, k_weight, mask, out.view(torch.int16), float(eps), d**-0.5,
            stream.stride(0), stream.stride(1), stream.stride(2), kv.stride(0), kv.stride(1),
            q_weight.stride(0), q_weight.stride(1), k_weight.stride(0), k_weight.stride(1),
            mask.stride(0), HC=hc, D=d, BD=bd, HAS_MASK=has_mask, num_warps=8, **PDL_LAUNCH)
    return out


# ------------------------------------------------------------------------------------- hash


@triton.jit
def _hash_kernel(ids_ptr, pos_ptr, dead_ptr, map_ptr, mult_ptr, pr_ptr, off_ptr, o_ptr, T,
                 pad_id, si_t, si_s, sm_l, sm_s, sp_l, sp_s, sp_h, so_l, L: tl.constexpr,
                 N: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr):
    """Row ids of BT tokens for one layer (program axis 1): the n slots' compressed ids with the
    blocking rule, the rolling XOR of id x multiplier, and per order/head the modulo + offset."""
    pdl_wait()
    toks = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    tm = toks < T
    layer = tl.program_id(1).to(tl.int64)
    hh = tl.arange(0, HP)
    hm = hh < H
    pos = tl.load(pos_ptr + toks, mask=tm, other=0).to(tl.int64)
    blocked = tl.load(dead_ptr + toks, mask=tm, other=0) != 0
    rolling = tl.zeros((BT,), dtype=tl.int64)
    out_row = o_ptr + toks[:, None] * (L * (N - 1) * H) + layer * ((N - 1) * H)
    for s in tl.static_range(N):
        src = tl.load(ids_ptr + toks * si_t + s * si_s, mask=tm, other=0).to(tl.int64)
        blocked = blocked | (pos < s) | (src < 0)
        mapped = tl.load(map_ptr + tl.maximum(src, 0), mask=tm & ~blocked, other=0).to(tl.int64)
        v = tl.where(blocked, tl.zeros((BT,), dtype=tl.int64) + pad_id, mapped)
        prod = v * tl.load(mult_ptr + layer * sm_l + s * sm_s)
        if s == 0:
            rolling = prod
        else:
            rolling = rolling ^ prod
            pr = tl.load(pr_ptr + layer * sp_l + (s - 1) * sp_s + hh * sp_h, mask=hm, other=1)
            off = tl.load(off_ptr + layer * so_l + (s - 1) * H + hh, mask=hm, other=0)
            row = rolling[:, None] % pr[None, :] + off[None, :]
            tl.store(out_row + (s - 1) * H + hh[None, :], row, mask=tm[:, None] & hm[None, :])


def _supports_hash(*, ids: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                   offsets: torch.Tensor, **_) -> bool:
    return (on_device(ids) and ids.dim() == 2 and multipliers.dtype == torch.int64
            and primes.dtype == torch.int64 and offsets.dtype == torch.int64
            and offsets.is_contiguous() and primes.dim() == 3
            and multipliers.shape == (primes.shape[0], ids.shape[1]))


@REGISTRY.implement("triton", "engram_hash", supports=_supports_hash)
def engram_hash(*, ids: torch.Tensor, positions: torch.Tensor, dead: torch.Tensor,
                token_map: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                offsets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Reference contract (ops/reference/engram.py): [T, L, (n - 1) * H] int64, exact."""
    t, n = ids.shape
    layers, _, h = primes.shape
    out = torch.empty(t, layers, (n - 1) * h, dtype=torch.int64, device=ids.device)
    if t == 0 or layers == 0 or n < 2:
        return out
    bt = 64
    _hash_kernel[(triton.cdiv(t, bt), layers)](
        ids, positions, dead, token_map, multipliers, primes, offsets, out, t, pad_id,
        ids.stride(0), ids.stride(1), multipliers.stride(0), multipliers.stride(1),
        primes.stride(0), primes.stride(1), primes.stride(2), offsets.stride(0), L=layers, N=n,
        H=h, HP=triton.next_power_of_2(h), BT=bt, num_warps=4, **PDL_LAUNCH)
    return out
