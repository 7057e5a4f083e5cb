// Device code shared by the MoE kernels (moe_decode.cu, moe_prefill.cu): the tile walk over the
// expert-sorted routed rows and the folded e2m1 -> e4m3 weight conversion.
#pragma once

struct Tile {
    int expert;
    int row0;
    int row_end;
};

// The (expert, first row, end row) of live tile `j` over the expert-sorted rows: experts in
// order, ceil(count / ROWS) tiles each. Warp 0 scans the counts (each lane a contiguous range of
// experts, then a warp prefix sum); expert -1 when j is past the last tile. Every thread of
// the CTA must call it (it ends with a barrier).
template <int ROWS>
__device__ Tile find_tile(const int* __restrict__ counts, int num_experts, int j) {
    __shared__ Tile found;
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        int per = (num_experts + 31) / 32;
        int e0 = min(lane * per, num_experts), e1 = min(e0 + per, num_experts);
        int tiles = 0, rows = 0;
        for (int e = e0; e < e1; ++e) {
            int c = counts[e];
            tiles += (c + ROWS - 1) / ROWS;
            rows += c;
        }
        int tiles_before = tiles, rows_before = rows;  // inclusive scans, made exclusive below
        for (int off = 1; off < 32; off <<= 1) {
            int tt = __shfl_up_sync(0xffffffffu, tiles_before, off);
            int rr = __shfl_up_sync(0xffffffffu, rows_before, off);
            if (lane >= off) {
                tiles_before += tt;
                rows_before += rr;
            }
        }
        tiles_before -= tiles;
        rows_before -= rows;
        if (lane == 0) found.expert = -1;
        __syncwarp();
        if (j >= tiles_before && j < tiles_before + tiles) {
            int tj = tiles_before, r = rows_before;
            for (int e = e0; e < e1; ++e) {
                int c = counts[e];
                int n = (c + ROWS - 1) / ROWS;
                if (j < tj + n) {
                    found.expert = e;
                    found.row0 = r + (j - tj) * ROWS;
                    found.row_end = r + c;
                    break;
                }
                tj += n;
                r += c;
            }
        }
    }
    __syncthreads();
    return found;
}

// Four e2m1 codes (the low 16 bits of `codes`, code i in nibble i) -> four e4m3 bytes through
// the 8-byte magnitude table (lo, hi), the sign bit moved to bit 7 of each byte.
__device__ __forceinline__ uint32_t e2m1x4_to_e4m3(uint32_t codes, uint32_t lo, uint32_t hi) {
    uint32_t mag = prmt(lo, hi, codes & 0x7777u);
    uint32_t sign = prmt(0x00008000u, 0u, (codes >> 3) & 0x1111u);
    return mag | sign;
}

__device__ __forceinline__ float col_scale(int smax) {
    return smax == 255 ? __int_as_float(0x7fc00000) : __int_as_float(smax << 23);
}

// The parameters of a MoE tile function (A: the activation element type): activations a [*, K]
// with row scales a_scale, the rows' sources arow (gather) and output rows orow, the output,
// the routing weights rw, the packed weights w, their block scales ws and row maxima wmax, the
// shift tables, the per-expert counts, N output columns, E experts, K, the SwiGLU limit.
#define SHOAL_MOE_TILE_PARAMS(A)                                                              \
    const A* __restrict__ a, const float* __restrict__ a_scale, const int* __restrict__ arow,  \
        bf16_t* __restrict__ out, const int* __restrict__ orow, const float* __restrict__ rw,  \
        const uint8_t* __restrict__ w, const uint8_t* __restrict__ ws,                         \
        const int* __restrict__ wmax, const uint2* __restrict__ lut_g,                         \
        const int* __restrict__ counts, int N, int E, int K, float limit, bool gather

// The two entry points of a MoE kernel family over its tile function TILE<SWIGLU>:
// moe_w13_<FAMILY> (gathered activations, SwiGLU, routing weight) and moe_w2_<FAMILY> (output
// rows orow); the launch bounds follow.
#define SHOAL_MOE_ENTRIES(FAMILY, A, TILE, ...)                                               \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__)                                 \
        moe_w13_##FAMILY(const A* a, const float* a_scale, const int* arow, bf16_t* out,      \
                         const float* rw, const uint8_t* w, const uint8_t* ws,                \
                         const int* wmax, const uint2* lut, const int* counts, int N, int E,  \
                         int K, float limit) {                                                \
        TILE<true>(a, a_scale, arow, out, nullptr, rw, w, ws, wmax, lut, counts, N, E, K,     \
                   limit, true);                                                              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__)                                 \
        moe_w2_##FAMILY(const A* a, const float* a_scale, bf16_t* out, const int* orow,       \
                        const uint8_t* w, const uint8_t* ws, const int* wmax,                 \
                        const uint2* lut, const int* counts, int N, int E, int K) {           \
        TILE<false>(a, a_scale, nullptr, out, orow, nullptr, w, ws, wmax, lut, counts, N, E,  \
                    K, 0.f, false);                                                           \
    }
