// Prefill MoE grouped GEMM, W4A8 on FP8 wgmma (sm_90a): the two GEMMs of `moe_mxfp4` for
// many routed rows (moe_prefill.py; the decode sizes run moe_decode.cu).
//
// One CTA = 128 routed rows of one expert (a 128-row tile of the expert-sorted rows) x 128
// weight rows (w13: 64 gate rows n0.. and the 64 up rows N + n0.. of the same output columns;
// w2: 128 output columns), 2 warpgroups of 64 routed rows each. Per K-block of 256 codes:
//   - the activation codes (folded e4m3, gathered by row) and the weight bytes (packed e2m1,
//     UE8M0 block scales) are copied by cp.async into a ring of STAGES slots, STAGES - 1 blocks
//     ahead;
//   - all threads convert the next block's weights to folded e4m3 (the decode kernel's shift
//     tables) into the second converted buffer while the tensor cores run this block: each
//     warpgroup issues 8 m64n128k32 wgmmas (activations and converted weights K-major in the
//     128-byte swizzle, two 128-byte slabs per K-block) into fresh fp32 partials, then adds them
//     to its fp32 sums (promotion every 256 K, as the Triton prefill tiles).
// Epilogue as the decode kernel: row scale x weight row scale 2^(S_n - 127), bf16 rounding, and
// for w13 the clamped SwiGLU times the routing weight.
//
// Bits: fp32 sums of FP8 products promoted every 256 K; within the MoE tolerance of the
// reference, not bitwise; a routed row's sums use only its own activations (a row's result
// does not depend on the batch).

#include "common.cuh"
#include "moe_common.cuh"

#define BM 128           // routed rows per CTA
#define BN 128           // weight rows per CTA
#define BK 256           // codes per K-block (the promotion interval)
#define THREADS 256
#define STAGES 3
#define LUT_ROWS 32
#define SLAB_BYTES (128 * 128)                          // 128 rows x 128 bytes of e4m3
#define A_BYTES (2 * SLAB_BYTES)                        // activations of one K-block
#define BRAW_BYTES (BN * BK / 2)                        // packed weights of one K-block
#define BSC_BYTES (BN * BK / 32)                        // their block scales
#define STAGE_BYTES (A_BYTES + BRAW_BYTES + BSC_BYTES)  // (a multiple of 1024)
#define CVT_BYTES (2 * SLAB_BYTES)                      // converted weights of one K-block
#define SMEM_BYTES (STAGES * STAGE_BYTES + 2 * CVT_BYTES)

// byte offset of 16-byte chunk c (0 .. 15) of row r in a K-block's two 128-byte slabs
__device__ __forceinline__ uint32_t slab_off(int r, int c) {
    return (c >> 3) * SLAB_BYTES + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// d (this thread's 64 fp32 of the warpgroup's 64 x 128 tile) = A B^T (+ d when accumulate):
// m64n128k32, e4m3 x e4m3, both K-major in shared memory
__device__ __forceinline__ void wgmma_fp8(float (&d)[64], uint64_t da, uint64_t db,
                                          int accumulate) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        SHOAL_REGS64
        ", %64, %65, p, 1, 1;\n}"
        : SHOAL_ACC64(d)
        : "l"(da), "l"(db), "r"(accumulate));
}

// the values the wgmmas write stay where they are until their wait (registers pinned)
__device__ __forceinline__ void pin(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Copy K-block kb (codes kb BK ..) of the tile into ring slot `slot`: activations (rows past the
// tile's end zero-filled), packed weights, block scales. One cp.async group.
__device__ __forceinline__ void issue_kblock(uint8_t* slot, const uint8_t* __restrict__ a,
                                             const uint8_t* __restrict__ w,
                                             const uint8_t* __restrict__ ws,
                                             const int* s_arow, const int* s_wrow, int kb, int K,
                                             int nk) {
    if (kb < nk) {
        const int tid = threadIdx.x, k0 = kb * BK;
        const uint32_t base = smem_addr(slot);
#pragma unroll
        for (int m = 0; m < BM * 16 / THREADS; ++m) {  // activations: 16 chunks of 16 bytes
            const int p = tid + THREADS * m, r = p / 16, c = p % 16;
            const int row = s_arow[r];
            cp_async16(base + slab_off(r, c), a + (int64_t)max(row, 0) * K + k0 + 16 * c,
                       row >= 0);
        }
#pragma unroll
        for (int m = 0; m < BN * 8 / THREADS; ++m) {  // weights: 8 pieces of 16 bytes per row
            const int p = tid + THREADS * m, n = p / 8, q = p % 8;
            cp_async16(base + A_BYTES + n * (BK / 2) + 16 * q,
                       w + (int64_t)s_wrow[n] * (K / 2) + k0 / 2 + 16 * q, true);
        }
        if (tid < BN)  // block scales: 8 bytes per row
            asm volatile("cp.async.ca.shared.global [%0], [%1], 8;"
                         :: "r"(base + A_BYTES + BRAW_BYTES + 8 * tid),
                            "l"(ws + (int64_t)s_wrow[tid] * (K / 32) + k0 / 32) : "memory");
    }
    cp_async_commit();
}

// The slot's packed weights -> folded e4m3 in `cvt` (K-major, 128-byte swizzle): thread units
// (row n, 32-block b), 4 per thread.
__device__ __forceinline__ void convert_kblock(uint8_t* cvt, const uint8_t* slot,
                                               const uint2* lut, const int* s_wmax) {
#pragma unroll
    for (int m = 0; m < BN * (BK / 32) / THREADS; ++m) {
        const int u = threadIdx.x + THREADS * m, n = u / 8, b = u % 8;
        const uint4 raw = *reinterpret_cast<const uint4*>(slot + A_BYTES + n * (BK / 2) + 16 * b);
        const int sc = slot[A_BYTES + BRAW_BYTES + 8 * n + b];
        const uint2 l = lut[min(s_wmax[n] - sc, LUT_ROWS - 1)];
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t o[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            o[2 * i] = e2m1x4_to_e4m3(words[i], l.x, l.y);
            o[2 * i + 1] = e2m1x4_to_e4m3(words[i] >> 16, l.x, l.y);
        }
        *reinterpret_cast<uint4*>(cvt + slab_off(n, 2 * b)) = make_uint4(o[0], o[1], o[2], o[3]);
        *reinterpret_cast<uint4*>(cvt + slab_off(n, 2 * b + 1)) =
            make_uint4(o[4], o[5], o[6], o[7]);
    }
}

// This warpgroup's 8 wgmmas of one K-block into fresh partials (then committed).
__device__ __forceinline__ void mma_kblock(float (&part)[64], uint32_t a_tile, uint32_t cvt) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 32; ++kk) {
        wgmma_fp8(part, kmajor_desc(a_tile + kstep(kk, SLAB_BYTES)),
                  kmajor_desc(cvt + kstep(kk, SLAB_BYTES)), kk > 0);
    }
    wgmma_commit();
    pin(part);
}

template <bool SWIGLU>
__device__ void prefill_tile(SHOAL_MOE_TILE_PARAMS(uint8_t)) {
    __shared__ uint2 lut[LUT_ROWS];
    __shared__ int s_arow[BM], s_wrow[BN], s_wmax[BN];
    extern __shared__ __align__(16) uint8_t smem_raw[];  // realigned at run time (aligned_smem)
    uint8_t* smem = aligned_smem(smem_raw, SMEM_BYTES);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    if (tid < LUT_ROWS) lut[tid] = lut_g[tid];
    const Tile tile = find_tile<BM>(counts, E, blockIdx.y);  // (ends with a barrier)
    if (tile.expert < 0) return;
    const int NW = SWIGLU ? 2 * N : N, per = SWIGLU ? BN / 2 : BN;
    const int n0 = blockIdx.x * per;  // first output column
    const int64_t e = tile.expert;
    if (tid < BM) {
        const int r = tile.row0 + tid;
        s_arow[tid] = r < tile.row_end ? (gather ? arow[r] : r) : -1;
    } else {
        const int n = tid - BM;  // weight row n of the tile; past N: row 0 stands in
        const int col = SWIGLU ? (n < per ? n0 + n : N + n0 + n - per) : n0 + n;
        const bool ok = (SWIGLU ? n0 + n % per : n0 + n) < N;
        s_wrow[n] = (int)(e * NW + (ok ? col : 0));
        s_wmax[n] = wmax[e * NW + (ok ? col : 0)];
    }
    __syncthreads();
    const int nk = K / BK;
    const uint32_t base = smem_addr(smem);
    uint8_t* cvt = smem + STAGES * STAGE_BYTES;
    for (int s = 0; s < STAGES - 1; ++s)
        issue_kblock(smem + s * STAGE_BYTES, a, w, ws, s_arow, s_wrow, s, K, nk);
    cp_async_wait<STAGES - 2>();
    fence_async();
    __syncthreads();  // K-block 0 landed
    convert_kblock(cvt, smem, lut, s_wmax);
    fence_async();
    __syncthreads();  // its weights converted

    const int wg = warp / 4;  // routed rows 64 wg ..
    float part[64], sum[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) sum[i] = 0.f, part[i] = 0.f;
    mma_kblock(part, base + wg * 64 * 128, smem_addr(cvt));
    for (int kb = 0; kb < nk; ++kb) {
        // K-block kb is on the tensor cores; the slot read by K-block kb - 1 is free
        issue_kblock(smem + ((kb + STAGES - 1) % STAGES) * STAGE_BYTES, a, w, ws, s_arow,
                     s_wrow, kb + STAGES - 1, K, nk);
        const int next = kb + 1;
        if (next < nk) {
            cp_async_wait<STAGES - 2>();
            fence_async();
            __syncthreads();  // K-block kb + 1 landed
            convert_kblock(cvt + (next & 1) * CVT_BYTES, smem + (next % STAGES) * STAGE_BYTES,
                           lut, s_wmax);
            fence_async();
        }
        wgmma_wait();
        pin(part);
#pragma unroll
        for (int i = 0; i < 64; ++i) sum[i] += part[i];
        __syncthreads();  // K-block kb + 1's weights converted; K-block kb's reads done
        if (next < nk)
            mma_kblock(part, base + (next % STAGES) * STAGE_BYTES + wg * 64 * 128,
                       smem_addr(cvt + (next & 1) * CVT_BYTES));
    }

    // epilogue: this thread's rows 64 wg + 16 (warp % 4) + g + {0, 8} x columns 8 j + 2 t + {0, 1}
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r_local = 64 * wg + 16 * (warp % 4) + g + 8 * h;
        const int r = tile.row0 + r_local;
        if (r >= tile.row_end) continue;
        const float rs = a_scale[gather ? arow[r] : r];
#pragma unroll
        for (int j = 0; j < (SWIGLU ? 8 : 16); ++j) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int c = 8 * j + 2 * t + q, n = n0 + c;
                if (n >= N) continue;
                const float v = sum[4 * j + 2 * h + q];
                if (SWIGLU) {
                    const float gg = fminf(bf16_round(v * rs * col_scale(s_wmax[c])), limit);
                    const float uu = fminf(fmaxf(bf16_round(sum[4 * (j + 8) + 2 * h + q] * rs *
                                                            col_scale(s_wmax[per + c])),
                                                 -limit), limit);
                    out[(int64_t)r * N + n] = to_bf16(rw[r] * (gg / (1.0f + expf(-gg)) * uu));
                } else {
                    out[(int64_t)orow[r] * N + n] = to_bf16(v * rs * col_scale(s_wmax[c]));
                }
            }
        }
    }
}

SHOAL_MOE_ENTRIES(prefill, uint8_t, prefill_tile, THREADS, 1)
