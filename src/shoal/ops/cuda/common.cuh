// Device helpers shared by the CUDA kernels (ops/cuda/*.cu): fixed-width types, the e4m3 and
// bf16 conversions, the fp16 / bf16 mma.sync m16n8k16 and cp.async. NVRTC from PyPI ships no
// headers, so nothing here includes one (nvrtc.py hands this file to every compile).
#pragma once

typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned short bf16_t;  // bfloat16 bits
typedef long long int64_t;
typedef unsigned long long uint64_t;

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// four e4m3 bytes -> two f16x2 (bytes 0, 1 -> lo; bytes 2, 3 -> hi; the lower byte in the
// lower half), exact
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t x, uint32_t& lo, uint32_t& hi) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
        " cvt.rn.f16x2.e4m3x2 %1, h;\n}"
        : "=r"(lo), "=r"(hi) : "r"(x));
}

// f16x2 -> its two halves as fp32 (exact)
__device__ __forceinline__ void f16x2_to_f32(uint32_t x, float& lo, float& hi) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi) : "r"(x));
}

// two fp32 -> bf16x2 (lo in the lower half), round to nearest even
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// fp32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN)
__device__ __forceinline__ bf16_t to_bf16(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float bf16_round(float x) {
    return __uint_as_float((uint32_t)to_bf16(x) << 16);
}

__device__ __forceinline__ void store_bf16x2(bf16_t* p, float lo, float hi) {
    *reinterpret_cast<uint32_t*>(p) = (uint32_t)to_bf16(lo) | ((uint32_t)to_bf16(hi) << 16);
}

// d += a . b on m16n8k16, fp32 accumulators; a: rows g, g+8 x k {2t, 2t+1} then {2t+8, 2t+9};
// b: k {2t, 2t+1}, then {2t+8, 2t+9} x column g (g = lane / 4, t = lane % 4). mma_f16: fp16
// operands; mma_bf16: bf16.
#define SHOAL_MMA_M16N8K16(NAME, TYPE)                                                         \
    __device__ __forceinline__ void NAME(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,  \
                                         uint32_t b1) {                                       \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "           \
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                  \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                         \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));         \
    }
SHOAL_MMA_M16N8K16(mma_f16, "f16")
SHOAL_MMA_M16N8K16(mma_bf16, "bf16")

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, zero-filled when !valid (nothing is read then)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// wait until at most N of this thread's cp.async groups are pending
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// ---- wgmma (sm_90a) -------------------------------------------------------------------------

// wgmma accumulator operands: the register list "{%0, ..., %N-1}" of an asm statement whose first
// N operands are the accumulators, and their "+f" bindings to d[0 .. N-1]
#define SHOAL_REGS32 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, " \
    "%14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, " \
    "%28, %29, %30, %31}"
#define SHOAL_REGS64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, " \
    "%14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, " \
    "%28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, " \
    "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63}"
#define SHOAL_REGS128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, " \
    "%14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, " \
    "%28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, " \
    "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, " \
    "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, " \
    "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, " \
    "%98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, " \
    "%126, %127}"
#define SHOAL_ACC4(d, i) "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define SHOAL_ACC16(d, i) \
    SHOAL_ACC4(d, i), SHOAL_ACC4(d, (i) + 4), SHOAL_ACC4(d, (i) + 8), SHOAL_ACC4(d, (i) + 12)
#define SHOAL_ACC32(d) SHOAL_ACC16(d, 0), SHOAL_ACC16(d, 16)
#define SHOAL_ACC64(d) SHOAL_ACC32(d), SHOAL_ACC16(d, 32), SHOAL_ACC16(d, 48)
#define SHOAL_ACC128(d) \
    SHOAL_ACC64(d), SHOAL_ACC16(d, 64), SHOAL_ACC16(d, 80), SHOAL_ACC16(d, 96), SHOAL_ACC16(d, 112)

// wgmma descriptor of a K-major operand in the 128-byte swizzle at shared address `addr` (row 0
// of a slab of 128-byte rows, plus 32 bytes per 32-byte K step inside the row): 8-row groups
// 1024 bytes apart (stride byte offset), leading byte offset unused (1)
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// byte offset of the kk-th 32-byte K step in K-major slabs of 128-byte rows, `slab` bytes each
__device__ __forceinline__ uint32_t kstep(int kk, uint32_t slab) {
    return (kk >> 2) * slab + (kk & 3) * 32;
}

// the warpgroup's register accesses ordered before its next wgmmas; the wgmmas issued so far
// made one group; wait until every group of this thread is complete
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}

// the calling thread's shared-memory stores, ordered before later wgmma reads (async proxy)
__device__ __forceinline__ void fence_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The dynamic shared memory from its first 1024-aligned byte (the 128-byte swizzle repeats every
// 1024 bytes of address); traps unless the launch gave `bytes` + 1024 (the front is out of date).
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw, uint32_t bytes) {
    uint32_t size;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(size));
    if (size < bytes + 1024) __trap();
    return raw + ((1024 - (smem_addr(raw) & 1023)) & 1023);
}
