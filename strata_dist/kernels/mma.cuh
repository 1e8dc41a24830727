// Tensor-core helpers shared by the kernel sources (sm_80+): one mma.sync m16n8k16 with f16
// inputs and f32 accumulation, and packing two floats into the f16 pair a fragment register holds.
//
// Fragments (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
//   A 16x16 (row major):  a[0] = (row g, k 2t..2t+1)  a[1] = (row g+8, k 2t..)
//                         a[2] = (row g, k 2t+8..)    a[3] = (row g+8, k 2t+8..)
//   B 16x8 (k x n):       b0 = (k 2t..2t+1, n g)     b1 = (k 2t+8.., n g)
//   C 16x8 (f32):         c[0..1] = (row g, n 2t..2t+1)   c[2..3] = (row g+8, n 2t..)
#pragma once
#include <cuda_fp16.h>

__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

// Four 8x8 matrices of 16-bit values from shared memory: lane i names row i % 8 of matrix i / 8
// (16 bytes each); register j receives matrix j's (row lane / 4, columns 2 (lane % 4) ..), the
// layout of the fragments above (CUTLASS's SM80 copy atoms use the same instruction).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

// The same four matrices transposed: register j receives matrix j's (rows 2 (lane % 4) .., column
// lane / 4), a B fragment of a matrix stored k-major (the keys of attention's V tile as rows).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}
