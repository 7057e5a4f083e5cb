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
