// Sparse MQA with a per-head sink over quantised KV records (`sparse_attn_sink`), D = 512,
// up to 64 heads, on bf16 tensor cores (sm_90a). See sparse_attn.py for the contract.
//
// One CTA = one query token x all heads (padded to 64 rows: the MMAs' M) x a range of 64-key
// index blocks (SWA blocks first, then compressed; the front's partition). 8 warps. Per block:
//   1. the block's records (64 rows; a -1 index or a key past the list reads as zeros) were
//      copied raw into shared memory by cp.async while the previous block computed;
//   2. all threads dequantise them to bf16 keys sK [64 keys x D] (exact, as the Triton kernel):
//      SWA: e4m3 * 2^(e - 127); compressed: e2m1 (its bits placed in an fp16) * e4m3 * 2^14;
//   3. scores S = Q K^T, scaled and masked (-inf for empty keys), into sS (fp32): mma.sync warp
//      (rg = w % 4, ch = w / 4) computes heads 16 rg.. x keys 32 ch..; ATTN_WGMMA >= 1: the
//      first warpgroup's m64n64k16 wgmma from the Q and K slabs;
//   4. softmax, one row per 4 threads (16 keys each): running max from -1e30, p = exp(s - m)
//      (exp in fp64, rounded to fp32, as the reference), the row's sum in fp64 (fixed order),
//      l = l * alpha + sum, P = bf16(p) into sP, alpha = exp(m_old - m) into sAlpha;
//   5. O = O * alpha + P V (128 fp32 accumulators per thread): mma.sync warp (rg2 = w % 2,
//      cg = w / 2) owns heads 32 rg2.. x columns 128 cg.. and reads V = sK by ldmatrix.trans;
//      ATTN_WGMMA == 2: warpgroup wg's m64n256k16 wgmma over columns 256 wg.., A = sP, B = the
//      K slabs read N-major.
// The CTA then writes either the output (one split: o = O / (l + exp(sink - m)), bf16) or its
// fp32 partials (O, m, l) for the combine pass (the Triton kernel's layout).
//
// Shared memory: Q and K as D/64 slabs of 64 rows x 128 bytes (qk_off) and P as one such slab,
// 16-byte chunks XOR-swizzled by the row's low 3 bits: the canonical 128-byte swizzle of
// wgmma (K-major for Q, K and P; N-major for V), and every ldmatrix phase over 8 rows hits 8
// distinct bank groups. Stores by the threads are fenced to the async proxy before a wgmma
// reads them.
//
// Bits: the scores and P.V sums are fp32 MMA sums (their order is the MMA's), so the op is
// within the reference's tolerance, not bitwise; a row's result depends only on its own index
// lists and the partition (never on the batch).

#include "common.cuh"

#define D 512
#define HEADS 64     // MMA rows: query heads, zero-padded
#define BLOCK_N 64   // keys per index block
#define WARPS 8
#define THREADS (WARPS * 32)
#define SWA_REC (D + D / 32)      // e4m3 codes, then UE8M0 scales (one per 32)
#define COMP_REC (D / 2 + D / 16) // e2m1 pairs (low nibble = even dim), then e4m3 scales (/16)
#define SLAB (64 * 128)           // Q or K: 64 rows x 64 dims of bf16 (see qk_off)
#define S_STRIDE (BLOCK_N + 8)    // fp32 score row (padded: fewer bank conflicts)

// shared memory layout (bytes)
#define OFF_Q 0
#define OFF_K (OFF_Q + HEADS * D * 2)
#define OFF_RAW (OFF_K + BLOCK_N * D * 2)
#define OFF_P (OFF_RAW + BLOCK_N * SWA_REC)
#define OFF_S (OFF_P + HEADS * BLOCK_N * 2)
#define OFF_IDX (OFF_S + HEADS * S_STRIDE * 4)
#define OFF_ALPHA (OFF_IDX + 2 * BLOCK_N * 4)
#define OFF_ML (OFF_ALPHA + HEADS * 4)
#define SMEM_BYTES (OFF_ML + HEADS * 8)

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// byte offset of 16-byte chunk `chunk` of row `row` (rows of `row_bytes`, >= 8 chunks)
__device__ __forceinline__ uint32_t swz(int row, int chunk, int row_bytes) {
    return row * row_bytes + ((chunk ^ (row & 7)) << 4);
}

// byte offset of 16-byte chunk `chunk` (0 .. D/8) of row `row` of Q or K: D/64 slabs of 64 rows
// x 128 bytes (64 dims), each in the K-major 128-byte swizzle of wgmma (chunk c of a slab row at
// c ^ (row % 8)); ldmatrix phases over 8 rows hit 8 distinct bank groups as well
__device__ __forceinline__ uint32_t qk_off(int row, int chunk) {
    return (chunk >> 3) * SLAB + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

__device__ __forceinline__ float exp_ref(float x) {  // the reference's exp: fp64, then fp32
    return (float)exp((double)x);
}

#ifndef ATTN_WGMMA
#define ATTN_WGMMA 0  // 1: the scores by one warpgroup's wgmma (Q and K read once per block);
                      // 2: P.V by wgmma too (each warpgroup 256 columns, V read once)
#endif

#if ATTN_WGMMA
// d (this thread's 32 fp32 of the warpgroup's 64 x 64 tile) = A B^T (+ d when accumulate):
// m64n64k16, bf16, both operands K-major in shared memory
__device__ __forceinline__ void wgmma_64x64(float (&d)[32], uint64_t da, uint64_t db,
                                            int accumulate) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        SHOAL_REGS32
        ", %32, %33, p, 1, 1, 0, 0;\n}"
        : SHOAL_ACC32(d)
        : "l"(da), "l"(db), "r"(accumulate));
}

// wgmma descriptor of an N-major (MN-major) operand in the 128-byte swizzle at `addr` (row 0 of
// a K slab: rows = keys, 64 columns of 128 bytes): the next 64 columns one slab (SLAB bytes) on
// (leading byte offset), the next 8 keys 1024 bytes on (stride byte offset)
__device__ __forceinline__ uint64_t nmajor_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(SLAB >> 4) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// d (this thread's 128 fp32 of the warpgroup's 64 x 256 tile) += A B: m64n256k16, bf16, A
// K-major and B N-major in shared memory
__device__ __forceinline__ void wgmma_pv(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        SHOAL_REGS128
        ", %128, %129, 1, 1, 1, 0, 1;"
        : SHOAL_ACC128(d)
        : "l"(da), "l"(db));
}
#endif

// The P.V accumulator tiles of a thread (warp w, g = lane / 4, tq = lane % 4): tile n holds rows
// out_row + {0, 8} x columns out_col + {0, 1}. mma.sync: warp (w % 2, w / 2) owns heads
// 32 (w % 2) .. x columns 128 (w / 2) .., tile n = 16 mi + j its m16n8 tile (mi, j); wgmma:
// warpgroup w / 4 owns all heads x columns 256 (w / 4) .., tile n its n-th 8 columns.
__device__ __forceinline__ int out_row(int n, int w, int g) {
#if ATTN_WGMMA == 2
    return 16 * (w % 4) + g;
#else
    return 32 * (w % 2) + 16 * (n / 16) + g;
#endif
}

__device__ __forceinline__ int out_col(int n, int w, int tq) {
#if ATTN_WGMMA == 2
    return 256 * (w / 4) + 8 * n + 2 * tq;
#else
    return 128 * (w / 2) + 8 * (n % 16) + 2 * tq;
#endif
}

__device__ __forceinline__ float (&tile(float (&acc)[128], int n))[4] {
    return *reinterpret_cast<float(*)[4]>(&acc[4 * n]);
}

// The lists of block b: SWA blocks first (keys b * 64..), then compressed.
struct Lists {
    const uint8_t* swa;
    const int* swa_idx;
    const uint8_t* comp;
    const int* comp_idx;
    int n_swa, n_comp, nb_swa;
};

// Copy block b's 64 records into sRaw (cp.async, one group) and its indices into sIdx (-1: no
// key, past the list or empty).
template <bool SWA>
__device__ __forceinline__ void issue_records(const Lists& L, int b, uint8_t* smem, int* sidx) {
    constexpr int rec = SWA ? SWA_REC : COMP_REC, cpr = rec / 16;
    const int* idxp = SWA ? L.swa_idx : L.comp_idx;
    const int nlist = SWA ? L.n_swa : L.n_comp;
    const int n0 = (SWA ? b : b - L.nb_swa) * BLOCK_N;
    const uint8_t* cache = SWA ? L.swa : L.comp;
    if (threadIdx.x < BLOCK_N) {
        const int n = n0 + threadIdx.x;
        sidx[threadIdx.x] = n < nlist ? idxp[n] : -1;
    }
    const uint32_t raw = smem_addr(smem + OFF_RAW);
    for (int i = threadIdx.x; i < BLOCK_N * cpr; i += THREADS) {
        const int r = i / cpr, c = i - r * cpr;
        const int n = n0 + r;
        const int idx = n < nlist ? __ldg(idxp + n) : -1;
        const uint8_t* src = cache + (int64_t)max(idx, 0) * rec + c * 16;
        cp_async16(raw + r * rec + c * 16, src, idx >= 0);
    }
    cp_async_commit();
}

__device__ __forceinline__ void issue_block(const Lists& L, int b, uint8_t* smem, int* sidx) {
    if (b < L.nb_swa)
        issue_records<true>(L, b, smem, sidx);
    else
        issue_records<false>(L, b, smem, sidx);
}

// sRaw (block b's records) -> sK bf16. Thread: chunk c = tid % 64 (8 dims) of rows tid / 64 + 4 i.
__device__ __forceinline__ void dequant_block(bool swa, uint8_t* smem) {
    const uint8_t* raw = smem + OFF_RAW;
    uint8_t* sk = smem + OFF_K;
    const int c = threadIdx.x % 64;
#pragma unroll 4
    for (int i = 0; i < BLOCK_N / 4; ++i) {
        const int r = threadIdx.x / 64 + 4 * i;
        uint4 out;
        if (swa) {
            const uint8_t* rec = raw + r * SWA_REC;
            const uint2 codes = *reinterpret_cast<const uint2*>(rec + c * 8);
            const float sc = __int_as_float((int)rec[D + c / 4] << 23);
            uint32_t h[4];
            e4m3x4_to_f16(codes.x, h[0], h[1]);
            e4m3x4_to_f16(codes.y, h[2], h[3]);
            uint32_t o[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float lo, hi;
                f16x2_to_f32(h[j], lo, hi);
                o[j] = pack_bf16x2(lo * sc, hi * sc);
            }
            out = make_uint4(o[0], o[1], o[2], o[3]);
        } else {
            const uint8_t* rec = raw + r * COMP_REC;
            const uint32_t packed = *reinterpret_cast<const uint32_t*>(rec + c * 4);
            uint32_t s2, unused;
            e4m3x4_to_f16(rec[D / 2 + c / 2], s2, unused);
            float sc, sc_hi;
            f16x2_to_f32(s2, sc, sc_hi);
            sc *= 16384.0f;  // undoes the 2^-14 of the e2m1 bits placed in an fp16
            uint32_t o[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint32_t x = (packed >> (8 * j)) & 0xffu;  // dims 2j (low), 2j + 1 (high)
                const uint32_t pair = ((x & 8u) << 12) | ((x & 7u) << 9) |
                                      ((x & 0x80u) << 24) | ((x & 0x70u) << 21);
                float lo, hi;
                f16x2_to_f32(pair, lo, hi);
                o[j] = pack_bf16x2(lo * sc, hi * sc);
            }
            out = make_uint4(o[0], o[1], o[2], o[3]);
        }
        *reinterpret_cast<uint4*>(sk + qk_off(r, c)) = out;
    }
}

// q [T, H, D] bf16 (row strides stride_qt, stride_qh in elements, 16-byte aligned rows);
// swa_cache [rows, SWA_REC] uint8, swa_idx [T, n_swa] int32 (row stride stride_si);
// comp_cache [rows, COMP_REC], comp_idx [T, n_comp] (stride_ci); sink [H] fp32.
// Grid (T, nsplit); CTA (t, s) takes index blocks [s * per, min(s * per + per, nb)).
// nsplit == 1: out [T, H, D] bf16; else part [T, nsplit, H, D] fp32 and ml [T, nsplit, H, 2]
// (m, l) for the combine pass.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
sparse_attn_decode(const uint16_t* __restrict__ q, const uint8_t* __restrict__ swa_cache,
                   const int* __restrict__ swa_idx, const uint8_t* __restrict__ comp_cache,
                   const int* __restrict__ comp_idx, const float* __restrict__ sink,
                   uint16_t* __restrict__ out, float* __restrict__ part, float* __restrict__ ml,
                   int H, int n_swa, int n_comp, int per, float scale, int stride_qt,
                   int stride_qh, int stride_si, int stride_ci) {
    extern __shared__ __align__(16) uint8_t smem_raw[];  // realigned at run time (aligned_smem)
    uint8_t* smem = aligned_smem(smem_raw, SMEM_BYTES);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, tq = lane % 4;
    const int64_t t = blockIdx.x;
    const int split = blockIdx.y, nsplit = gridDim.y;
    Lists L;
    L.swa = swa_cache, L.swa_idx = swa_idx + t * stride_si;
    L.comp = comp_cache, L.comp_idx = comp_idx + t * stride_ci;
    L.n_swa = n_swa, L.n_comp = n_comp;
    L.nb_swa = (n_swa + BLOCK_N - 1) / BLOCK_N;
    const int nb = L.nb_swa + (n_comp + BLOCK_N - 1) / BLOCK_N;
    const int b0 = split * per, b1 = min(b0 + per, nb);
    int* sidx = reinterpret_cast<int*>(smem + OFF_IDX);
    float* s_s = reinterpret_cast<float*>(smem + OFF_S);
    float* s_alpha = reinterpret_cast<float*>(smem + OFF_ALPHA);
    float* s_ml = reinterpret_cast<float*>(smem + OFF_ML);
    const uint32_t sq = smem_addr(smem + OFF_Q), sk = smem_addr(smem + OFF_K);
    const uint32_t sp = smem_addr(smem + OFF_P);

    if (b0 < b1) {  // Q (padded heads read as zeros) and the first block, one group
        for (int i = tid; i < HEADS * (D / 8); i += THREADS) {
            const int h = i / (D / 8), c = i % (D / 8);
            const uint16_t* src = q + t * stride_qt + (int64_t)(h < H ? h : 0) * stride_qh + c * 8;
            cp_async16(sq + qk_off(h, c), src, h < H);
        }
        issue_block(L, b0, smem, sidx);
    }

    // softmax state of row `srow`, held by its 4 threads
    const int srow = tid / 4, squart = tid % 4;
    float m_run = -1e30f, l_run = 0.f;
    // P.V accumulators: 32 tiles n of 2 x 2 (rows out_row(n) + {0, 8} x columns out_col(n) +
    // {0, 1}) in acc[4 n ..]: the m16n8 fragments of the mma.sync warps, or a warpgroup's
    // m64n256 fragment
    float acc[128];
#pragma unroll
    for (int e = 0; e < 128; ++e) acc[e] = 0.f;

    for (int b = b0; b < b1; ++b) {
        const int* cur_idx = sidx + ((b - b0) & 1) * BLOCK_N;
        cp_async_wait<0>();
        __syncthreads();  // the block's records are in; the previous P.V is done with sK
        dequant_block(b < L.nb_swa, smem);
#if ATTN_WGMMA
        fence_async();  // sK visible to wgmma
#endif
        __syncthreads();  // sK complete; sRaw free
        if (b + 1 < b1) issue_block(L, b + 1, smem, sidx + ((b + 1 - b0) & 1) * BLOCK_N);

#if ATTN_WGMMA
        if (warp < 4) {  // scores: warpgroup 0, warp w: heads 16 w + {g, g + 8} x all 64 keys
            float sacc[32];
#pragma unroll
            for (int e = 0; e < 32; ++e) sacc[e] = 0.f;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                wgmma_64x64(sacc, kmajor_desc(sq + kstep(kk, SLAB)),
                            kmajor_desc(sk + kstep(kk, SLAB)), kk > 0);
            }
            wgmma_commit();
            wgmma_wait();
            const float ninf = -__int_as_float(0x7f800000);
            const int r0 = 16 * warp + g;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int col = 8 * j + 2 * tq;
                const bool v0 = cur_idx[col] >= 0, v1 = cur_idx[col + 1] >= 0;
                *reinterpret_cast<float2*>(s_s + r0 * S_STRIDE + col) = make_float2(
                    v0 ? sacc[4 * j] * scale : ninf, v1 ? sacc[4 * j + 1] * scale : ninf);
                *reinterpret_cast<float2*>(s_s + (r0 + 8) * S_STRIDE + col) = make_float2(
                    v0 ? sacc[4 * j + 2] * scale : ninf, v1 ? sacc[4 * j + 3] * scale : ninf);
            }
        }
#else
        {  // scores: heads 16 rg.. x keys 32 ch..
            const int rg = warp % 4, ch = warp / 4;
            float s[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
            const int arow = 16 * rg + (lane & 15);
            const int key0 = 32 * ch + ((lane >> 4) << 3) + (lane & 7);
#pragma unroll 4
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t a[4], b01[4], b23[4];
                ldmatrix_x4(a, sq + qk_off(arow, 2 * kk + (lane >> 4)));
                const int kc = 2 * kk + ((lane >> 3) & 1);
                ldmatrix_x4(b01, sk + qk_off(key0, kc));
                ldmatrix_x4(b23, sk + qk_off(key0 + 16, kc));
                mma_bf16(s[0], a, b01[0], b01[1]);
                mma_bf16(s[1], a, b01[2], b01[3]);
                mma_bf16(s[2], a, b23[0], b23[1]);
                mma_bf16(s[3], a, b23[2], b23[3]);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int col = 32 * ch + 8 * j + 2 * tq;
                const bool v0 = cur_idx[col] >= 0, v1 = cur_idx[col + 1] >= 0;
                const float ninf = -__int_as_float(0x7f800000);
                const int r0 = 16 * rg + g;
                *reinterpret_cast<float2*>(s_s + r0 * S_STRIDE + col) =
                    make_float2(v0 ? s[j][0] * scale : ninf, v1 ? s[j][1] * scale : ninf);
                *reinterpret_cast<float2*>(s_s + (r0 + 8) * S_STRIDE + col) =
                    make_float2(v0 ? s[j][2] * scale : ninf, v1 ? s[j][3] * scale : ninf);
            }
        }
#endif
        __syncthreads();  // sS complete

        {  // softmax of row srow, keys 16 squart..
            float s[16];
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const float4 x =
                    *reinterpret_cast<const float4*>(s_s + srow * S_STRIDE + 16 * squart + 4 * v);
                s[4 * v] = x.x, s[4 * v + 1] = x.y, s[4 * v + 2] = x.z, s[4 * v + 3] = x.w;
            }
            float mx = s[0];
#pragma unroll
            for (int j = 1; j < 16; ++j) mx = fmaxf(mx, s[j]);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float new_m = fmaxf(m_run, mx);
            const float alpha = exp_ref(m_run - new_m);
            double sum = 0.0;
            uint32_t pk[8];
#pragma unroll
            for (int j = 0; j < 16; j += 2) {
                const float p0 = exp_ref(s[j] - new_m), p1 = exp_ref(s[j + 1] - new_m);
                sum += (double)p0;
                sum += (double)p1;
                pk[j / 2] = pack_bf16x2(p0, p1);
            }
            // the 4 quarters' sums in a fixed order: (0 + 1) + (2 + 3)
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            l_run = l_run * alpha + (float)sum;
            m_run = new_m;
            uint8_t* prow = smem + OFF_P;
            *reinterpret_cast<uint4*>(prow + swz(srow, 2 * squart, BLOCK_N * 2)) =
                make_uint4(pk[0], pk[1], pk[2], pk[3]);
            *reinterpret_cast<uint4*>(prow + swz(srow, 2 * squart + 1, BLOCK_N * 2)) =
                make_uint4(pk[4], pk[5], pk[6], pk[7]);
            if (squart == 0) s_alpha[srow] = alpha;
        }
#if ATTN_WGMMA == 2
        fence_async();  // sP visible to wgmma
#endif
        __syncthreads();  // sP, sAlpha complete

        {  // O = O * alpha + P V
#pragma unroll
            for (int n = 0; n < 32; ++n) {
                const float a_lo = s_alpha[out_row(n, warp, g)];
                const float a_hi = s_alpha[out_row(n, warp, g) + 8];
                acc[4 * n] *= a_lo, acc[4 * n + 1] *= a_lo;
                acc[4 * n + 2] *= a_hi, acc[4 * n + 3] *= a_hi;
            }
#if ATTN_WGMMA == 2
            // warpgroup wg: all heads x columns 256 wg..: A = P (K-major), B = V = the K slabs
            // wg * 4 .. + 3 (N-major), 16 keys per step
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk)
                wgmma_pv(acc, kmajor_desc(sp + 32 * kk),
                         nmajor_desc(sk + (warp / 4) * 4 * SLAB + 16 * 128 * kk));
            wgmma_commit();
            wgmma_wait();
#else
            // warp (rg2 = w % 2, cg = w / 2): heads 32 rg2.. x columns 128 cg..
            const int rg2 = warp % 2, cg = warp / 2;
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                uint32_t a[2][4];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
                    ldmatrix_x4(a[mi], sp + swz(32 * rg2 + 16 * mi + (lane & 15),
                                                2 * kk + (lane >> 4), BLOCK_N * 2));
                const int krow = 16 * kk + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
                for (int jp = 0; jp < 8; ++jp) {
                    uint32_t bv[4];
                    ldmatrix_x4_trans(bv, sk + qk_off(krow, 16 * cg + 2 * jp + (lane >> 4)));
#pragma unroll
                    for (int mi = 0; mi < 2; ++mi) {
                        mma_bf16(tile(acc, 16 * mi + 2 * jp), a[mi], bv[0], bv[1]);
                        mma_bf16(tile(acc, 16 * mi + 2 * jp + 1), a[mi], bv[2], bv[3]);
                    }
                }
            }
#endif
        }
    }

    // every row's final (m, l) to shared memory for the P.V warps
    if (squart == 0) s_ml[2 * srow] = m_run, s_ml[2 * srow + 1] = l_run;
    __syncthreads();
    if (nsplit > 1 && squart == 0 && srow < H) {
        float* dst = ml + ((t * nsplit + split) * H + srow) * 2;
        dst[0] = m_run, dst[1] = l_run;
    }
#pragma unroll
    for (int n = 0; n < 32; ++n) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int h = out_row(n, warp, g) + 8 * half, col = out_col(n, warp, tq);
            if (h >= H) continue;
            const float lo = acc[4 * n + 2 * half], hi = acc[4 * n + 2 * half + 1];
            if (nsplit == 1) {
                const float m = s_ml[2 * h], l = s_ml[2 * h + 1];
                const float denom = l + exp_ref(sink[h] - m);
                *reinterpret_cast<uint32_t*>(out + (t * H + h) * D + col) =
                    pack_bf16x2(lo / denom, hi / denom);
            } else {
                *reinterpret_cast<float2*>(part + ((t * nsplit + split) * H + h) * D + col) =
                    make_float2(lo, hi);
            }
        }
    }
}
