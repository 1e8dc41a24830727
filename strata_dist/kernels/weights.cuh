// How the kernels read weights, shared by every kernel source: the stored block formats (F32,
// F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K here; Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K in quant_blocks.cuh;
// the i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS in
// iquants.cuh) decoded 8 columns ("a chunk") at a time, exactly as gguf-py decodes them, and the
// dot products of a block of threads against float32 activations.
//
// Every type the kernels read is one line of FOR_EACH_TYPE below (its kernels' suffix, GGML id,
// block columns and bytes) and one case of chunk8_q (or chunk8 for float types): the per-type
// kernels, the dispatch of the type-generic ones (DISPATCH_TYPE) and the row kernels' stage sizes
// all follow from those two places (kernels/abi.py KERNEL_TYPES / TYPE_NAMES mirror the line).
//
// A block's threads take consecutive chunks of a row (each round the block reads 8 * blockDim
// contiguous columns of every row it serves, so every load of a warp is contiguous) and keep the
// activations of a chunk in registers for all the weight rows they serve. Every output is summed
// in one fixed order (a thread's chunks in column order, a fixed xor-shuffle tree per warp, then
// the warps in order), whatever the number of rows in the launch: a row's bits do not depend on
// its neighbours (batch invariance).
#pragma once
#include <cuda_fp16.h>

// NVRTC has no <math.h>: the constants we need from it
#define INF_F32 __int_as_float(0x7f800000)
#define NAN_F32 __int_as_float(0x7fc00000)

// The weight decoders also build for the host, where tests compare them with gguf-py (ldw below).
#define HOST_DEVICE __host__ __device__ __forceinline__

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// A weight load: read-only through the non-coherent cache (NC) from global memory, or plain, for
// a copy of the stored blocks in shared memory (the row kernels stage them there).
template <bool NC, class V>
HOST_DEVICE V ldw(const V* p) {
#ifdef __CUDA_ARCH__
    if constexpr (NC) return __ldg(p);
#endif
    return *p;
}

#define MAX_ROWS 8          // activation rows of one launch (plan.pricing.DECODE_ROWS)
#define BLOCK_THREADS 256   // threads of the matrix and expert kernels

// GGML type ids, as in the GGUF file
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ2_XXS 16
#define T_IQ2_XS 17
#define T_IQ3_XXS 18
#define T_IQ1_S 19
#define T_IQ4_NL 20
#define T_IQ3_S 21
#define T_IQ2_S 22
#define T_IQ4_XS 23
#define T_IQ1_M 29
#define T_BF16 30

// THE TYPE TABLE: every stored type the kernels read, X(kernel suffix, id, block columns, block
// bytes). The hot kernels exist once per line (decode.cu's matvec_*, experts.cuh's moe_*,
// experts_rows.cu's moe_*_rows*), DISPATCH_TYPE switches over the lines, block_cols / block_bytes
// read the sizes. A new type: its line here and its case in chunk8_q.
// A build may define a table of fewer lines first (a header given to nvcc with --pre-include;
// nvcc splits a -D value at its commas): the compile tests do, for the builds that check what
// does not depend on the type (a kernel shape's other -D values, the argument tables), since each
// line costs every such build seconds. The runners (kernels/__init__.py, prebuild.py) always
// build the whole table.
#ifndef FOR_EACH_TYPE
#define FOR_EACH_TYPE(X)                                                                   \
    X(f32, T_F32, 1, 4) X(f16, T_F16, 1, 2) X(q8_0, T_Q8_0, 32, 34) X(q4_k, T_Q4_K, 256, 144) \
    X(q5_k, T_Q5_K, 256, 176) X(q6_k, T_Q6_K, 256, 210) X(bf16, T_BF16, 1, 2)              \
    X(q4_0, T_Q4_0, 32, 18) X(q4_1, T_Q4_1, 32, 20) X(q5_0, T_Q5_0, 32, 22)                \
    X(q5_1, T_Q5_1, 32, 24) X(q2_k, T_Q2_K, 256, 84) X(q3_k, T_Q3_K, 256, 110)             \
    X(iq1_s, T_IQ1_S, 256, 50) X(iq1_m, T_IQ1_M, 256, 56) X(iq2_xxs, T_IQ2_XXS, 256, 66)   \
    X(iq2_xs, T_IQ2_XS, 256, 74) X(iq2_s, T_IQ2_S, 256, 82) X(iq3_xxs, T_IQ3_XXS, 256, 98) \
    X(iq3_s, T_IQ3_S, 256, 110) X(iq4_nl, T_IQ4_NL, 32, 18) X(iq4_xs, T_IQ4_XS, 256, 136)
#endif

#define TYPE_TABLE_COLS_(name, id, cols, bytes) T == id ? cols :
#define TYPE_TABLE_BYTES_(name, id, cols, bytes) T == id ? bytes :
// columns and bytes of one stored block of type T (0: not a type of the table)
HOST_DEVICE constexpr int block_cols(int T) { return FOR_EACH_TYPE(TYPE_TABLE_COLS_) 0; }
HOST_DEVICE constexpr int block_bytes(int T) { return FOR_EACH_TYPE(TYPE_TABLE_BYTES_) 0; }
#undef TYPE_TABLE_COLS_
#undef TYPE_TABLE_BYTES_

// Programmatic dependent launch (sm_90, kernels/pdl.py): a kernel launched with the programmatic
// attribute may start while its predecessor finishes. Every kernel first waits for the grids it
// depends on (a no-op when launched plainly), then lets its own successor start launching: the
// successor's blocks wait in turn, so no result changes, only the gaps between kernels shrink.
__device__ __forceinline__ void pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// True in every thread of the block that is the last of `expected` blocks to get here (counted
// in *counter, which that block resets to 0 for the next launch). Thread 0 alone fences and counts
// after a barrier (the cooperative-groups grid barrier's pattern): a fence in every thread (a
// memory barrier and an L1 invalidation per warp) cost the attention and router launches more
// than their work. The last block reads the others' results through L2 (__ldcg).
__device__ __forceinline__ bool last_block_to_finish(u32* counter, u32 expected) {
    __shared__ bool last;
    __syncthreads();                          // the block's writes, before thread 0 publishes them
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counter, 1u) == expected - 1;
        if (last) {
            __threadfence();                  // the other blocks' writes, before this block's reads
            *counter = 0u;
        }
    }
    __syncthreads();
    return last;
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

HOST_DEVICE float h2f(u16 bits) { return __half2float(__ushort_as_half(bits)); }

// ---- the 8 weights of chunk c (columns 8c .. 8c+7) of a row, decoded as gguf-py decodes them ----
// K-quant 6-bit scale and min of sub-block j, from the 12 scale bytes held in three words a, b, c
// (bytes 0-3, 4-7, 8-11). A branch on j measured faster than selecting between both sides
// (docs/BENCHMARKS.md).
HOST_DEVICE int scale_byte(u32 a, u32 b, u32 c, int i) {
    const u32 word = i < 4 ? a : (i < 8 ? b : c);
    return (int)((word >> (8 * (i & 3))) & 0xFF);
}

HOST_DEVICE void k_scale_min(u32 a, u32 b, u32 c, int j, int& s, int& m) {
    if (j < 4) {
        s = scale_byte(a, b, c, j) & 63;
        m = scale_byte(a, b, c, j + 4) & 63;
    } else {
        const int hi = scale_byte(a, b, c, j + 4);
        s = (hi & 0xF) | ((scale_byte(a, b, c, j - 4) >> 6) << 4);
        m = (hi >> 4) | ((scale_byte(a, b, c, j) >> 6) << 4);
    }
}

// Small stored integers as floats. An int-to-float conversion issues at a fraction of an FMA's
// rate (16 a clock per SM against 128); with CVT_MAGIC the value goes into the low mantissa bits
// of 2^23 instead (2^23 + v exactly) and 2^23 + OFFSET is subtracted: the same float, bit for
// bit, through two full-rate instructions.
#ifndef CVT_MAGIC
#define CVT_MAGIC 1
#endif
template <int OFFSET>
HOST_DEVICE float small_int_to_float(u32 v /* 0 <= v < 2^22 */) {
#if CVT_MAGIC
#ifdef __CUDA_ARCH__
    return __uint_as_float(0x4B000000u | v) - (8388608.f + (float)OFFSET);
#else
    union { u32 u; float f; } bits;
    bits.u = 0x4B000000u | v;
    return bits.f - (8388608.f + (float)OFFSET);
#endif
#else
    return (float)((int)v - OFFSET);
#endif
}

// a signed byte (the low 8 bits of `byte`, two's complement): b ^ 0x80 is b + 128
HOST_DEVICE float s8_to_float(u32 byte) { return small_int_to_float<128>((byte & 0xFF) ^ 0x80); }

// a * q rounded on its own, never fused with a following add (the types whose weights gguf-py
// computes as a rounded product plus a min: quant_blocks.cuh)
HOST_DEVICE float mul_rn(float a, float q) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, q);
#else
    return a * q;
#endif
}

#include "quant_blocks.cuh"   // Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, BF16
// The i-quants. Their grids, sign patterns and levels (iq_tables.cuh) are read from global
// memory, through the cache, at every chunk: a first version, not measured against copies in
// shared or constant memory.
#include "iquants.cuh"

// The 8 stored integers of chunk c (columns 8c .. 8c+7) of a quantized row as exact floats q and
// the chunk's affine map: its weights are a * q + b (Q8_0 and Q6_K: b = 0), as gguf-py decodes
// them.
template <int T, bool NC = true>
HOST_DEVICE void chunk8_q(const u8* __restrict__ row, int c, float* q, float& a, float& b) {
    b = 0.f;
    if constexpr (T == T_Q8_0) {
        // 34-byte block of 32: f16 d, 32 int8 quants (2-byte aligned only); 4 chunks per block
        const u16* p = reinterpret_cast<const u16*>(row + (i64)(c >> 2) * 34);
        a = h2f(ldw<NC>(p));
        p += 1 + 4 * (c & 3);
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u16 v = ldw<NC>(p + j);
            q[2 * j] = s8_to_float(v);
            q[2 * j + 1] = s8_to_float(v >> 8);
        }
    } else if constexpr (T == T_Q4_K || T == T_Q5_K) {
        // super-block of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, [Q5_K: 32 bytes of
        // high bits: bit j of byte l for element l of sub-block j], 128 bytes of nibbles:
        // sub-block j (32 columns) holds the low (j even) or high nibbles of bytes 32*(j/2) ..
        const u8* blk = row + (i64)(c >> 5) * (T == T_Q4_K ? 144 : 176);
        const int j = (c >> 2) & 7, k = c & 3;
        const uint4 head = ldw<NC>(reinterpret_cast<const uint4*>(blk));
        int s, m;
        k_scale_min(head.y, head.z, head.w, j, s, m);
        a = h2f((u16)(head.x & 0xFFFF)) * small_int_to_float<0>(s);
        b = -(h2f((u16)(head.x >> 16)) * small_int_to_float<0>(m));
        const uint2 qv = ldw<NC>(reinterpret_cast<const uint2*>(
            blk + (T == T_Q4_K ? 16 : 48) + 32 * (j >> 1) + 8 * k));
        const int shift = (j & 1) * 4;
        uint2 hv = make_uint2(0, 0);
        if (T == T_Q5_K) hv = ldw<NC>(reinterpret_cast<const uint2*>(blk + 16 + 8 * k));
        #pragma unroll
        for (int l = 0; l < 8; ++l) {
            const u32 word = l < 4 ? qv.x : qv.y;
            u32 v = (word >> (8 * (l & 3) + shift)) & 0xF;
            if (T == T_Q5_K) v += (((l < 4 ? hv.x : hv.y) >> (8 * (l & 3) + j)) & 1) << 4;
            q[l] = small_int_to_float<0>(v);
        }
    } else if constexpr (T == T_Q6_K) {
        // 210 bytes (2-byte aligned only): ql[128], qh[64], int8 scales[16], f16 d. Element
        // e = 128h + 32t + l: low nibble (t < 2) or high nibble of ql[64h + 32(t&1) + l], bits
        // 2t.. of qh[32h + l], scale [8h + l/16 + 2t]
        const u8* blk = row + (i64)(c >> 5) * 210;
        const int e0 = 8 * (c & 31), h = e0 >> 7, t = (e0 >> 5) & 3, l0 = e0 & 31;
        const u16* ql = reinterpret_cast<const u16*>(blk + 64 * h + 32 * (t & 1) + l0);
        const u16* qh = reinterpret_cast<const u16*>(blk + 128 + 32 * h + l0);
        a = h2f(ldw<NC>(reinterpret_cast<const u16*>(blk + 208))) *
            s8_to_float(ldw<NC>(blk + 192 + 8 * h + (l0 >> 4) + 2 * t));
        const int nshift = (t >> 1) * 4, hshift = 2 * t;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u16 lv = ldw<NC>(ql + j), hv = ldw<NC>(qh + j);
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 lo = ((lv >> (8 * e)) >> nshift) & 0xF;
                const u32 hb = ((hv >> (8 * e)) >> hshift) & 3;
                q[2 * j + e] = small_int_to_float<32>(lo | (hb << 4));
            }
        }
    } else if constexpr (is_iquant(T)) {
        iq_chunk8_q<T, NC>(row, c, q, a, b);     // iquants.cuh
    } else {
        qb_chunk8_q<T, NC>(row, c, q, a, b);     // quant_blocks.cuh
    }
}

HOST_DEVICE constexpr bool is_quantized(int T) { return T != T_F32 && T != T_F16 && T != T_BF16; }
// b != 0: the types with a min (or Q4_1 / Q5_1's added m)
HOST_DEVICE constexpr bool has_min(int T) {
    return T == T_Q4_K || T == T_Q5_K || T == T_Q4_1 || T == T_Q5_1 || T == T_Q2_K;
}
// a * q + b as gguf-py rounds it (the product, then the sum) rather than one fused multiply-add:
// the types added with quant_blocks.cuh; Q4_K / Q5_K keep their measured fmaf
HOST_DEVICE constexpr bool unfused_min(int T) {
    return T == T_Q4_1 || T == T_Q5_1 || T == T_Q2_K;
}

template <int T, bool NC = true>
HOST_DEVICE void chunk8(const u8* __restrict__ row, int c, float* w) {
    if constexpr (T == T_F32) {
        const float4* p = reinterpret_cast<const float4*>(row) + 2 * c;
        const float4 a = ldw<NC>(p), b = ldw<NC>(p + 1);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    } else if constexpr (T == T_F16) {
        const uint4 v = ldw<NC>(reinterpret_cast<const uint4*>(row) + c);
        const u32 parts[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int t = 0; t < 4; ++t) {
            w[2 * t] = h2f((u16)(parts[t] & 0xFFFF));
            w[2 * t + 1] = h2f((u16)(parts[t] >> 16));
        }
    } else if constexpr (T == T_BF16) {
        const uint4 v = ldw<NC>(reinterpret_cast<const uint4*>(row) + c);
        const u32 parts[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int t = 0; t < 4; ++t) {
            w[2 * t] = bf16_bits_to_float(parts[t] & 0xFFFF);
            w[2 * t + 1] = bf16_bits_to_float(parts[t] >> 16);
        }
    } else {
        float a, b;
        chunk8_q<T, NC>(row, c, w, a, b);
        #pragma unroll
        for (int l = 0; l < 8; ++l)
            w[l] = unfused_min(T) ? mul_rn(a, w[l]) + b
                 : has_min(T) ? fmaf(a, w[l], b) : a * w[l];
    }
}

// One chunk of a weight row held for dot products against several activation chunks. With
// FACTORED_DOTS a quantized chunk keeps its integers and sums them against x before scaling once
// (a * sum(q x) + b * sum(x), llama.cpp's order): a multiply a weight fewer than decoding each
// weight first. Either way each output has one fixed order of operations (batch invariance); the
// two forms round differently.
#ifndef FACTORED_DOTS
#define FACTORED_DOTS 1
#endif
template <int T>
struct ChunkDot {
    static constexpr bool factored = FACTORED_DOTS && is_quantized(T);
    static constexpr bool needs_xsum = factored && has_min(T);   // b != 0: sum(x) enters
    float v[8], a, b;

    __device__ __forceinline__ void load(const u8* __restrict__ row, int c) {
        if (factored) chunk8_q<T>(row, c, v, a, b);
        else chunk8<T>(row, c, v);
    }
    // acc + this chunk . xv; xsum: the sum of xv's 8 values (read only when needs_xsum)
    __device__ __forceinline__ float dot(const float* xv, float xsum, float acc) const {
        if (!factored) {
            #pragma unroll
            for (int j = 0; j < 8; ++j) acc = fmaf(v[j], xv[j], acc);
            return acc;
        }
        float s = v[0] * xv[0];
        #pragma unroll
        for (int j = 1; j < 8; ++j) s = fmaf(v[j], xv[j], s);
        acc = fmaf(a, s, acc);
        return needs_xsum ? fmaf(b, xsum, acc) : acc;
    }
};

HOST_DEVICE float sum8(const float* v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// CALL with TT the constant of run-time `type`, for every line of FOR_EACH_TYPE (a type not in
// the table calls nothing)
template <int V>
struct TypeTag { static constexpr int value = V; };

template <class F>
HOST_DEVICE void dispatch_type(int type, F&& f) {
#define TYPE_CASE_(name, id, cols, bytes) case id: f(TypeTag<id>{}); break;
    switch (type) {
        FOR_EACH_TYPE(TYPE_CASE_)
        default: break;
    }
#undef TYPE_CASE_
}

#define DISPATCH_TYPE(type, CALL)                                                          \
    dispatch_type((type), [&](auto tag_) { constexpr int TT = decltype(tag_)::value; CALL; })

__device__ __forceinline__ void load8(const float* __restrict__ p, float* v) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ void store8(float* p, const float* v) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// ---- dot products of one block ----------------------------------------------------------------
// The block's threads split a row's chunks: thread t takes chunks t, t + blockDim, ... (each
// round the block reads 8 * blockDim contiguous columns of every row it serves). Each warp reduces
// its lanes with a fixed xor tree, then the warps' partials are added in warp order: one order per
// output whatever the rows n of the launch, the rows per block or the grid.

// acc (M partial sums per thread) -> sums[M] in shared memory, read by every thread on return
template <int M>
__device__ __forceinline__ void block_reduce(float (&acc)[M], float* sums) {
    __shared__ float part[BLOCK_THREADS / 32][M];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        const float v = warp_sum(acc[m]);
        if (lane == 0) part[warp][m] = v;
    }
    __syncthreads();
    if (threadIdx.x < M) {
        float s = 0.f;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += part[w][threadIdx.x];
        sums[threadIdx.x] = s;
    }
    __syncthreads();
}

// sums[r*N + i] = rows[r] . (x_i * xw) for R weight rows and N activation rows (x_i at
// x + i*x_stride; xw, a fused norm weight, may be null). SUMSQ: also sums[R*N + i] = x_i . x_i
// (a fused RMSNorm's scale, summed in the same pass and reduction as the dots: the activations
// are read once and the block waits at one reduction, not two).
template <int T, int N, int R, bool SUMSQ = false>
__device__ __forceinline__ void block_dots(const u8* const (&rows)[R], int nchunks,
                                           const float* __restrict__ x, int x_stride,
                                           const float* __restrict__ xw, float* sums) {
    constexpr int M = R * N + (SUMSQ ? N : 0);
    float acc[M];
    #pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.f;
    #pragma unroll 2
    for (int c = threadIdx.x; c < nchunks; c += blockDim.x) {
        float xv[N][8];
        #pragma unroll
        for (int i = 0; i < N; ++i) load8(x + (i64)i * x_stride + 8 * c, xv[i]);
        if (SUMSQ) {
            #pragma unroll
            for (int i = 0; i < N; ++i) {
                #pragma unroll
                for (int j = 0; j < 8; ++j) acc[R * N + i] = fmaf(xv[i][j], xv[i][j], acc[R * N + i]);
            }
        }
        if (xw != nullptr) {
            float s[8];
            load8(xw + 8 * c, s);
            #pragma unroll
            for (int i = 0; i < N; ++i) {
                #pragma unroll
                for (int j = 0; j < 8; ++j) xv[i][j] *= s[j];
            }
        }
        float xsum[N];
        #pragma unroll
        for (int i = 0; i < N; ++i) xsum[i] = ChunkDot<T>::needs_xsum ? sum8(xv[i]) : 0.f;
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            ChunkDot<T> w;
            w.load(rows[r], c);
            #pragma unroll
            for (int i = 0; i < N; ++i) acc[r * N + i] = w.dot(xv[i], xsum[i], acc[r * N + i]);
        }
    }
    block_reduce<M>(acc, sums);
}
