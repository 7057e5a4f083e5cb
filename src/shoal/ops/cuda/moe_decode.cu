// Decode MoE grouped GEMM, W4A8 (FP4 e2m1 weights with UE8M0 block scales, folded FP8 e4m3
// activations) on fp16 mma.sync m16n8k16 (sm_89+). See moe_decode.py for the contract.
//
// sm_90 has no FP8 mma.sync (an m16n8k32 e4m3 MMA is lowered to two fp16 HMMAs with eight
// operand conversions and four adds), so the MMAs are fp16, with the roles swapped: A (m = 16)
// is a warp's 16 weight rows, B (n = 8) an 8-row tile of one expert's routed rows.
//
// One CTA = one 8-row tile x 4 warps x 16 weight rows per warp. A warp's weight rows are two
// groups of 8, [w0, w0 + 8) and [w1, w1 + 8) (w13 with SWIGLU: gate row n and up row N + n of
// the same output columns; w2: columns n and n + 8).
//
// K layout. Per 128-K chunk, lane (g = lane / 4, t = lane % 4) loads 16 bytes of each of its
// weight rows (w + g of both groups: the 32 codes of 32-block t of the chunk) and the 64
// activation bytes (32 fp16) of routed row g, same block. MMA 2j + h of the chunk gives its k
// slots {2t, 2t+1} the codes 8j+4h, +1 and slots {2t+8, 2t+9} the codes +2, +3 of its block on
// both operands, so each MMA sums products of matching k; one MMA mixes the four blocks (fine:
// both operands are folded, see below).
//
// Folding (as the Triton kernels): activations arrive as fp16 holding e4m3(q * 2^(e_b - E_row))
// exactly, with one fp32 row scale 2^(E_row - 127); each weight code becomes
// e4m3(v * 2^(s_b - S_n)) through an 8-byte table per shift d = S_n - s_b (prmt), then fp16
// (cvt, exact); S_n is the row's largest block scale, applied as 2^(S_n - 127) in the epilogue
// (NaN for S_n = 255, 0 for S_n = 0).
//
// Sums: fp16 MMAs accumulate in fp32, so the K chain runs straight through in ascending K; a
// routed row's sums use only its own activations: its result does not depend on the other rows
// of its tile or the batch.

#include "common.cuh"
#include "moe_common.cuh"

#define WARPS 4
#define TILE_M 8  // routed rows per tile: the MMA's n
#define CHUNK_K 128
#define LUT_ROWS 32
#ifndef MOE_DEPTH
#define MOE_DEPTH 2  // 128-K chunks of weight loads in flight per lane (register path)
#endif



// One 128-K chunk of a lane's weights: two 16-byte loads (its 32-block of each group's row)
// and their block scales. The activations are read when the chunk is consumed (mostly from
// L1: fewer registers per chunk in flight). Measured slower and removed (docs/perf/moe.md):
// chunks staged in shared memory by cp.async, and K split over CTAs.
struct Stage {
    uint4 b0, b1;
    int s0, s1;

    __device__ __forceinline__ void load(const uint8_t* pw0, const uint8_t* pw1,
                                         const uint8_t* ps0, const uint8_t* ps1, int k0) {
        b0 = __ldg(reinterpret_cast<const uint4*>(pw0 + k0 / 2));
        b1 = __ldg(reinterpret_cast<const uint4*>(pw1 + k0 / 2));
        s0 = ps0[k0 / 32];
        s1 = ps1[k0 / 32];
    }
};

// One 128-K chunk into the lane's accumulators: its weight codes (cur) widened to fp16 through
// the shift tables of their block scales, times the activations act (fp16 pairs: codes 2m,
// 2m + 1 of the block in word m).
__device__ __forceinline__ void chunk_mma(float (&acc)[4], const Stage& cur,
                                          const uint32_t (&act)[16], const uint2* lut,
                                          int smax0, int smax1) {
    const uint2 l0 = lut[min(smax0 - cur.s0, LUT_ROWS - 1)];
    const uint2 l1 = lut[min(smax1 - cur.s1, LUT_ROWS - 1)];
    const uint32_t wb0[4] = {cur.b0.x, cur.b0.y, cur.b0.z, cur.b0.w};
    const uint32_t wb1[4] = {cur.b1.x, cur.b1.y, cur.b1.z, cur.b1.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint32_t af[4];  // rows g, g+8 x slots {2t, 2t+1}, then {2t+8, 2t+9}
            e4m3x4_to_f16(e2m1x4_to_e4m3(wb0[j] >> (16 * h), l0.x, l0.y), af[0], af[2]);
            e4m3x4_to_f16(e2m1x4_to_e4m3(wb1[j] >> (16 * h), l1.x, l1.y), af[1], af[3]);
            mma_f16(acc, af, act[4 * j + 2 * h], act[4 * j + 2 * h + 1]);
        }
    }
}


// A lane's share of its CTA: the tile (expert, routed rows), the lane's coordinates, the first
// output column of its warp, and its two weight rows (one per group; row 0 stands in past N)
// with their largest block scales and their bytes and scales of block t.
struct Lane {
    Tile tile;
    int g, t, n_base, NW, smax0, smax1;
    int64_t e;
    const uint8_t *pw0, *pw1, *ps0, *ps1;
};

// Stages the LUT in shared memory and finds the tile (find_tile's barrier: every thread comes
// here); false when the CTA has no tile or the warp's columns are past N.
template <bool SWIGLU>
__device__ __forceinline__ bool lane_of(Lane& L, uint2* lut, const uint2* lut_g,
                                        const int* counts, const uint8_t* w, const uint8_t* ws,
                                        const int* wmax, int N, int E, int K) {
    if (threadIdx.x < LUT_ROWS) lut[threadIdx.x] = lut_g[threadIdx.x];
    L.tile = find_tile<TILE_M>(counts, E, blockIdx.y);
    if (L.tile.expert < 0) return false;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4;
    L.g = g, L.t = lane % 4;
    L.NW = SWIGLU ? 2 * N : N;
    const int nb = (blockIdx.x * WARPS + warp) * (SWIGLU ? 8 : 16);
    L.n_base = nb;
    if (nb >= N) return false;
    L.e = L.tile.expert;
    const int c0 = nb + g, c1 = SWIGLU ? N + nb + g : nb + 8 + g;
    const bool ok0 = (SWIGLU ? nb + g : c0) < N, ok1 = (SWIGLU ? nb + g : c1) < N;
    const int64_t w0 = L.e * L.NW + (ok0 ? c0 : 0), w1 = L.e * L.NW + (ok1 ? c1 : 0);
    L.smax0 = wmax[w0], L.smax1 = wmax[w1];
    L.pw0 = w + w0 * (K / 2) + 16 * L.t, L.pw1 = w + w1 * (K / 2) + 16 * L.t;
    L.ps0 = ws + w0 * (K / 32) + L.t, L.ps1 = ws + w1 * (K / 32) + L.t;
    return true;
}

// a [*, K] fp16 (folded e4m3 values) with row scales a_scale [*]; rows of the tile read a row
// arow[r] (GATHER: the token of routed row r) else r; a row past the tile's end reads row 0 (an
// MMA column never mixes into the others, and its results are not stored). w [E, NW, K/2]
// packed e2m1 (low nibble = even k), ws [E, NW, K/32] UE8M0, wmax [E, NW] int32 (each row's
// largest block scale). SWIGLU: NW = 2N, out[r, n] = bf16(rw[r] * silu(min(g, L)) *
// clamp(u, -L, L)), g and u the bf16-rounded sums of rows n and N + n; else NW = N,
// out[orow[r], n] = bf16(sum). acc[c]: weight row g (c < 2) or g + 8, routed row 2t + (c & 1).
template <bool SWIGLU>
__device__ void moe_tile(SHOAL_MOE_TILE_PARAMS(uint16_t)) {
    __shared__ uint2 lut[LUT_ROWS];
    Lane L;
    if (!lane_of<SWIGLU>(L, lut, lut_g, counts, w, ws, wmax, N, E, K)) return;
    const Tile& tile = L.tile;
    const int g = L.g, t = L.t, n_base = L.n_base, NW = L.NW, smax0 = L.smax0, smax1 = L.smax1;
    const int64_t e = L.e;
    const int r_act = tile.row0 + g;  // this lane's routed row (B column g)
    const int64_t a_row = r_act < tile.row_end ? (gather ? arow[r_act] : r_act) : 0;
    const uint4* pa = reinterpret_cast<const uint4*>(a + a_row * K + 32 * t);
    const uint8_t *pw0 = L.pw0, *pw1 = L.pw1, *ps0 = L.ps0, *ps1 = L.ps1;
    // (the table in shared memory is visible: find_tile ends with a barrier)

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    Stage st[MOE_DEPTH];
#pragma unroll
    for (int s = 0; s < MOE_DEPTH; ++s)
        if (s * CHUNK_K < K) st[s].load(pw0, pw1, ps0, ps1, s * CHUNK_K);
    for (int k0 = 0; k0 < K; k0 += MOE_DEPTH * CHUNK_K) {
#pragma unroll
        for (int s = 0; s < MOE_DEPTH; ++s) {
            const int kc = k0 + s * CHUNK_K;
            if (kc < K) {
                uint32_t act[16];  // fp16 pairs: codes 2m, 2m+1 of the block in word m
#pragma unroll
                for (int v = 0; v < 4; ++v) {
                    const uint4 q = __ldg(pa + kc / 8 + v);
                    act[4 * v] = q.x, act[4 * v + 1] = q.y, act[4 * v + 2] = q.z;
                    act[4 * v + 3] = q.w;
                }
                chunk_mma(acc, st[s], act, lut, smax0, smax1);
                const int kn = kc + MOE_DEPTH * CHUNK_K;
                if (kn < K) st[s].load(pw0, pw1, ps0, ps1, kn);
            }
        }
    }

    // epilogue: routed rows 2t and 2t + 1 of the tile
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int r = tile.row0 + 2 * t + q;
        if (r >= tile.row_end) continue;
        const float rs = a_scale[gather ? arow[r] : r];
        if (SWIGLU) {
            const int n = n_base + g;
            if (n >= N) continue;
            const float gg = fminf(bf16_round(acc[q] * rs * col_scale(wmax[e * NW + n])), limit);
            const float uu = fminf(fmaxf(bf16_round(acc[2 + q] * rs *
                                                    col_scale(wmax[e * NW + N + n])),
                                         -limit), limit);
            out[(int64_t)r * N + n] = to_bf16(rw[r] * (gg / (1.0f + expf(-gg)) * uu));
        } else {
            const int64_t o = orow[r];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int n = n_base + g + 8 * half;
                if (n < N)
                    out[o * N + n] = to_bf16(acc[2 * half + q] * rs *
                                             col_scale(wmax[e * NW + n]));
            }
        }
    }
}

SHOAL_MOE_ENTRIES(decode, uint16_t, moe_tile, WARPS * 32)
