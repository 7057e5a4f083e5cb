"""Cache writers: SWA records (MXFP8), the ratio-r compressor pooling with carried partial
groups, compressed-KV records (NVFP4) and index-key records (MXFP4) (model.md §2.5-§2.7, §4).

Invariant: records are stored as codes (bit-identical to the reference's QDQ values); writes go
to physical rows chosen by the caller (ring slots or paged rows); nothing else is touched.
"""

from __future__ import annotations

import torch

from shoal.ops.reference._cases import randn
from shoal.ops.registry import REGISTRY, OpCase, Tolerance
from shoal.quant.records import (
    compressed_record_bytes,
    index_k_record_bytes,
    pack_compressed_record,
    pack_index_k_record,
    pack_swa_record,
    swa_record_bytes,
)


def _write_case(t: int, dim: int, record_bytes, name: str, skip: bool = False) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        rows = 2 * t + 3
        cache = torch.randint(0, 256, (rows, record_bytes(dim)), generator=g,
                              dtype=torch.uint8)
        dest = torch.randperm(rows, generator=g)[:t]
        if skip:  # every third destination negative: not written
            dest[::3] = -1 - dest[::3]
        return {"x": randn(g, t, dim, device=d), "cache": cache.to(d), "rows": dest.to(d)}

    return OpCase(f"{name}-T{t}xD{dim}{'-skip' if skip else ''}", make)


def _writer(name: str, record_bytes, pack, dims: tuple[int, ...]):
    cases = [_write_case(t, dim, record_bytes, name) for t in (1, 7, 0) for dim in dims]
    cases += [_write_case(t, dim, record_bytes, name, skip=True) for t in (1, 8)
              for dim in dims]

    def write(*, x: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor) -> None:
        if x.shape[0]:
            keep = rows >= 0  # boolean indexing: a host sync on CUDA (the Triton writers
            cache[rows[keep].long()] = pack(x[keep])  # have none)

    write.__name__ = name
    return REGISTRY.define(name, cases=cases, inplace=("cache",))(write)


swa_write = _writer("swa_write", swa_record_bytes, pack_swa_record, (64, 512))
swa_write.__doc__ = """kv [T, D] bf16 (normed, roped) -> MXFP8 records (D e4m3 + D/32 UE8M0 bytes)
written in place to cache[rows] (cache uint8 [R, D + D/32], rows [T] int64; a row < 0 is
skipped: nothing is written for it)."""
compressed_write = _writer("compressed_write", compressed_record_bytes, pack_compressed_record,
                           (64, 512))
compressed_write.__doc__ = """latent [T, D] bf16 (normed, roped at j*r) -> NVFP4 records
(D/2 packed e2m1 + D/16 e4m3 scale bytes) written in place to cache[rows] (rows < 0 skipped)."""
index_k_write = _writer("index_k_write", index_k_record_bytes, pack_index_k_record, (32, 128))
index_k_write.__doc__ = """k [T, Di] bf16 (normed, roped at j*r) -> MXFP4 records
(Di/2 packed e2m1 + Di/32 UE8M0 bytes) written in place to cache[rows] (rows < 0 skipped)."""


def _pool_case(lengths: tuple[int, ...], starts: tuple[int, ...], ratio: int, dim: int,
               ring: int | None = None) -> OpCase:
    def make(g: torch.Generator, d: torch.device) -> dict:
        t = sum(lengths)
        pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
        slot = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        return {"kv": randn(g, t, dim, dtype=torch.float32, device=d),
                "score": randn(g, t, dim, dtype=torch.float32, device=d),
                "positions": pos.to(d), "slots": slot.to(d),
                "state_kv": randn(g, len(lengths), ring or ratio, dim, dtype=torch.float32,
                                  device=d),
                "state_score": randn(g, len(lengths), ring or ratio, dim, dtype=torch.float32,
                                     device=d),
                "ratio": ratio}

    return OpCase(f"len{lengths}-start{starts}-r{ratio}-ring{ring or ratio}", make)


@REGISTRY.define("compress_pool",
                 tolerances={torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2),
                             torch.float32: Tolerance(atol=1e-6, rtol=1e-6)},
                 inplace=("state_kv", "state_score"),
                 cases=[_pool_case((1,), (0,), 2, 32), _pool_case((1,), (1,), 2, 32),
                        _pool_case((7, 4), (3, 0), 2, 64), _pool_case((0,), (5,), 2, 32),
                        _pool_case((9, 1, 5), (0, 7, 2), 4, 32),
                        _pool_case((6, 3), (1, 4), 2, 32, ring=7)])
def compress_pool(*, kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
                  ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-gated pooling of `ratio` consecutive tokens (model.md §2.6, r >= 2).

    kv, score [T, D] fp32 (wkv.x, wgate.x); positions [T] int64; slots [T] int64 (request slot
    of each token; a request's tokens are consecutive positions, in order). state_kv /
    state_score [S, R, D] fp32, R >= ratio: a ring of each slot's last R tokens, token p in
    entry p % R (updated in place: the last R positions of each request in this step are
    parked there). Group j = positions j*r .. j*r+r-1 closes at the token with
    (p+1) % r == 0; its members before this step are read from the ring. R > r keeps entries of
    tokens whose group a (later rejected) speculative token closed: with R >= r + drafts, a
    verify step never overwrites an accepted token's entry.

    Returns (pooled [T, D] bf16, row ids [T] int64), one row per token, so the output size
    never depends on device data (no host sync; CUDA graphs can capture it): a token closing
    group j has row id j and the group's pooled value; every other token has row id -1 and a
    zero row (the cache writers skip rows < 0).
    """
    t, dim = kv.shape
    if t == 0:
        return kv.new_zeros(0, dim).to(torch.bfloat16), positions.new_zeros(0)
    closes = (positions + 1) % ratio == 0  # [T]
    offs = torch.arange(ratio - 1, -1, -1, device=kv.device)  # member = p - off
    member_pos = positions.unsqueeze(1) - offs  # [T, r]
    member_tok = torch.arange(t, device=kv.device).unsqueeze(1) - offs  # token index if in step
    tok_ok = member_tok >= 0
    tok_clamped = member_tok.clamp_min(0)
    same_req = tok_ok & (slots[tok_clamped] == slots.unsqueeze(1)) & (
        positions[tok_clamped] == member_pos)
    st_slot = slots.unsqueeze(1).expand_as(member_pos)
    st_idx = member_pos.remainder(state_kv.shape[1])
    kv_m = torch.where(same_req.unsqueeze(-1), kv[tok_clamped], state_kv[st_slot, st_idx])
    sc_m = torch.where(same_req.unsqueeze(-1), score[tok_clamped], state_score[st_slot, st_idx])
    # Deviation: the softmax pooling in fp64, rounded once (the official fp32 softmax uses the
    # platform's vectorised exp, which depends on the batch)
    pooled = (kv_m.double() * sc_m.double().softmax(dim=1)).sum(dim=1).float()
    pooled = torch.where(closes.unsqueeze(1), pooled, 0.0)  # non-closing rows: garbage -> 0
    rows = torch.where(closes, positions // ratio, -1)
    # Park the last R positions of each request (unique (slot, p % R) entries). Boolean
    # indexing syncs on CUDA; the Triton kernel parks without it.
    ring = state_kv.shape[1]
    last = torch.full((state_kv.shape[0],), -1, dtype=positions.dtype, device=kv.device)
    last = last.scatter_reduce(0, slots, positions, reduce="amax")
    park = positions > last[slots] - ring
    state_kv[slots[park], positions[park] % ring] = kv[park]
    state_score[slots[park], positions[park] % ring] = score[park]
    return pooled.to(torch.bfloat16), rows
