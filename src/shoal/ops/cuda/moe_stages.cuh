// The decode MoE's staged load paths (moe_decode.cu with MOE_STAGES >= 2): a lane's chunks come
// from shared memory, copied there by cp.async MOE_STAGES - 1 stages ahead, instead of straight
// into registers. The arithmetic is the register path's (chunk_mma): the same bits.
//
// MOE_WARP_STAGE 0 (per lane): a stage is one 128-K chunk; each lane copies exactly what it
//   consumes (its two 16-byte weight blocks, its 64 activation bytes, the two 4-byte words
//   holding the chunk's block scales) into its own slots, so cp.async.wait_group is the only
//   wait. Slots: ring[(6 stage + slot) THREADS + tid] (weights 0-1, activations 2-5), then the
//   scale words at ((uint2*)(ring + 6 MOE_STAGES THREADS))[stage THREADS + tid].
// MOE_WARP_STAGE 1 (per warp): a stage is MOE_STAGE_CHUNKS chunks of the warp's 16 weight rows
//   (group 0's rows as stage rows 0-7, group 1's as 8-15) and their block scales, copied row by
//   row (16-byte pieces of one row on consecutive lanes: runs of MOE_STAGE_CHUNKS x 64 bytes);
//   the activations are read when consumed, as on the register path; a __syncwarp after the
//   wait makes the other lanes' copies visible. A weight row's 16-byte pieces sit XOR-swizzled
//   by 4 (row & 1): a lane's read phase (rows g, g + 1) hits 8 distinct bank groups. Needs
//   K % 256 == 0 (8-byte scale copies) and MOE_STAGE_CHUNKS in {2, 4, 8}.
#pragma once

#ifndef MOE_WARP_STAGE
#define MOE_WARP_STAGE 0
#endif
#ifndef MOE_STAGE_CHUNKS
#define MOE_STAGE_CHUNKS 4
#endif
#define MOE_THREADS (WARPS * 32)

#if MOE_STAGES > 0 && MOE_WARP_STAGE == 0
__device__ __forceinline__ void stage_issue(uint4* ring, int s, const uint8_t* pw0,
                                            const uint8_t* pw1, const uint32_t* psw0,
                                            const uint32_t* psw1, const uint4* pa, int kc,
                                            int K) {
    if (kc < K) {
        const uint4* slot = ring + 6 * s * MOE_THREADS + threadIdx.x;
        const uint32_t base = smem_addr(slot);
        cp_async16(base, pw0 + kc / 2, true);
        cp_async16(base + 16 * MOE_THREADS, pw1 + kc / 2, true);
#pragma unroll
        for (int v = 0; v < 4; ++v)
            cp_async16(base + 16 * (2 + v) * MOE_THREADS, pa + kc / 8 + v, true);
        const uint2* scales = reinterpret_cast<const uint2*>(ring + 6 * MOE_STAGES * MOE_THREADS);
        const uint32_t sc = smem_addr(scales + s * MOE_THREADS + threadIdx.x);
        cp_async4(sc, psw0 + kc / CHUNK_K);
        cp_async4(sc + 4, psw1 + kc / CHUNK_K);
    }
    cp_async_commit();  // (an empty group past K keeps the wait count uniform)
}

__device__ __forceinline__ void stage_read(const uint4* ring, int s, int t, Stage& cur,
                                           uint32_t (&act)[16]) {
    const uint4* slot = ring + 6 * s * MOE_THREADS + threadIdx.x;
    cur.b0 = slot[0];
    cur.b1 = slot[MOE_THREADS];
#pragma unroll
    for (int v = 0; v < 4; ++v) {
        const uint4 q = slot[(2 + v) * MOE_THREADS];
        act[4 * v] = q.x, act[4 * v + 1] = q.y, act[4 * v + 2] = q.z, act[4 * v + 3] = q.w;
    }
    const uint2 sc = reinterpret_cast<const uint2*>(ring + 6 * MOE_STAGES * MOE_THREADS)[
        s * MOE_THREADS + threadIdx.x];
    cur.s0 = (sc.x >> (8 * t)) & 0xff;
    cur.s1 = (sc.y >> (8 * t)) & 0xff;
}

__device__ __forceinline__ void staged_chunks(float (&acc)[4], const uint2* lut, const Lane& L,
                                              const uint4* pa, int K) {
    extern __shared__ uint4 ring[];
    const int t = L.t;
    const uint32_t* psw0 = reinterpret_cast<const uint32_t*>(L.ps0 - t);
    const uint32_t* psw1 = reinterpret_cast<const uint32_t*>(L.ps1 - t);
#pragma unroll
    for (int s = 0; s < MOE_STAGES - 1; ++s)
        stage_issue(ring, s, L.pw0, L.pw1, psw0, psw1, pa, s * CHUNK_K, K);
    int s = 0;
    for (int kc = 0; kc < K; kc += CHUNK_K) {
        cp_async_wait<MOE_STAGES - 2>();
        Stage cur;
        uint32_t act[16];
        stage_read(ring, s, t, cur, act);
        const int refill = s == 0 ? MOE_STAGES - 1 : s - 1;  // the slot read last chunk
        stage_issue(ring, refill, L.pw0, L.pw1, psw0, psw1, pa,
                    kc + (MOE_STAGES - 1) * CHUNK_K, K);
        chunk_mma(acc, cur, act, lut, L.smax0, L.smax1);
        s = s == MOE_STAGES - 1 ? 0 : s + 1;
    }
    cp_async_wait<0>();  // the zero-fill copies past K land before the CTA exits
}

#elif MOE_STAGES > 0
#define WS_ROW (MOE_STAGE_CHUNKS * 64)      // weight bytes of a row per stage
#define WS_SROW (MOE_STAGE_CHUNKS * 4)      // scale bytes of a row per stage
#define WS_BYTES (16 * (WS_ROW + WS_SROW))  // one warp's stage

__device__ __forceinline__ const uint8_t* shfl_ptr(const uint8_t* p, int src) {
    return reinterpret_cast<const uint8_t*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<long long>(p), src));
}

// Copy the stage of codes [k0, k0 + MOE_STAGE_CHUNKS 128) of the warp's 16 rows into `slot`
// (one cp.async group). w0 / w1 / s0 / s1: this lane's row pointers (lane 4 r of the warp holds
// those of rows r and 8 + r at block 0).
__device__ __forceinline__ void warp_issue(uint8_t* slot, const uint8_t* w0, const uint8_t* w1,
                                           const uint8_t* s0, const uint8_t* s1, int k0,
                                           int K) {
    const int lane = threadIdx.x % 32;
    const uint32_t base = smem_addr(slot);
#pragma unroll
    for (int m = 0; m < 2 * MOE_STAGE_CHUNKS; ++m) {
        const int i = lane + 32 * m;
        const int r = i / (4 * MOE_STAGE_CHUNKS), piece = i % (4 * MOE_STAGE_CHUNKS);
        const uint8_t* g0 = shfl_ptr(w0, 4 * (r % 8));
        const uint8_t* g1 = shfl_ptr(w1, 4 * (r % 8));
        const int off = k0 / 2 + 16 * piece;
        const bool live = off < K / 2;
        cp_async16(base + r * WS_ROW + ((piece ^ ((r & 1) << 2)) << 4),
                   (r < 8 ? g0 : g1) + (live ? off : 0), live);
    }
    constexpr int pieces = MOE_STAGE_CHUNKS / 2;  // 8-byte scale pieces per row
#pragma unroll
    for (int m = 0; m < (16 * pieces + 31) / 32; ++m) {
        const int i = lane + 32 * m;
        const int r = min(i / pieces, 15), piece = i % pieces;
        const uint8_t* g0 = shfl_ptr(s0, 4 * (r % 8));
        const uint8_t* g1 = shfl_ptr(s1, 4 * (r % 8));
        const int off = k0 / 32 + 8 * piece;
        if (i < 16 * pieces && off < K / 32)
            asm volatile("cp.async.ca.shared.global [%0], [%1], 8;"
                         :: "r"(base + 16 * WS_ROW + r * WS_SROW + 8 * piece),
                            "l"((r < 8 ? g0 : g1) + off) : "memory");
    }
    cp_async_commit();
}

__device__ __forceinline__ void staged_chunks(float (&acc)[4], const uint2* lut, const Lane& L,
                                              const uint4* pa, int K) {
    extern __shared__ __align__(16) uint8_t stage_mem[];
    uint8_t* mine = stage_mem + (threadIdx.x / 32) * MOE_STAGES * WS_BYTES;
    const int g = L.g, t = L.t;
    const uint8_t *w0 = L.pw0 - 16 * t, *w1 = L.pw1 - 16 * t;  // row starts
    const uint8_t *s0 = L.ps0 - t, *s1 = L.ps1 - t;
    constexpr int span = MOE_STAGE_CHUNKS * CHUNK_K;
#pragma unroll
    for (int s = 0; s < MOE_STAGES - 1; ++s) warp_issue(mine + s * WS_BYTES, w0, w1, s0, s1,
                                                         s * span, K);
    int s = 0;
    for (int k0 = 0; k0 < K; k0 += span) {
        cp_async_wait<MOE_STAGES - 2>();
        __syncwarp();  // every lane's copies of this stage are in; every lane is done with the
                       // stage read last (refilled now)
        const int refill = s == 0 ? MOE_STAGES - 1 : s - 1;
        warp_issue(mine + refill * WS_BYTES, w0, w1, s0, s1, k0 + (MOE_STAGES - 1) * span, K);
        const uint8_t* slot = mine + s * WS_BYTES;
        const uint8_t* sc = slot + 16 * WS_ROW;
#pragma unroll
        for (int cc = 0; cc < MOE_STAGE_CHUNKS; ++cc) {
            const int kc = k0 + cc * CHUNK_K;
            if (kc >= K) break;
            const int piece = (4 * cc + t) ^ ((g & 1) << 2);
            Stage cur;
            cur.b0 = *reinterpret_cast<const uint4*>(slot + g * WS_ROW + 16 * piece);
            cur.b1 = *reinterpret_cast<const uint4*>(slot + (8 + g) * WS_ROW + 16 * piece);
            cur.s0 = sc[g * WS_SROW + 4 * cc + t];
            cur.s1 = sc[(8 + g) * WS_SROW + 4 * cc + t];
            uint32_t act[16];  // read when consumed, as on the register path
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const uint4 q = __ldg(pa + kc / 8 + v);
                act[4 * v] = q.x, act[4 * v + 1] = q.y, act[4 * v + 2] = q.z;
                act[4 * v + 3] = q.w;
            }
            chunk_mma(acc, cur, act, lut, L.smax0, L.smax1);
        }
        s = s == MOE_STAGES - 1 ? 0 : s + 1;
    }
    cp_async_wait<0>();  // the zero-fill copies past K land before the CTA exits
}
#endif
