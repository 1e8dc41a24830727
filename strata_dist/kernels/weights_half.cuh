// A chunk's 8 weights decoded straight to four f16 pairs, for kernels that feed tensor cores
// from a copy of the stored blocks in shared memory (experts_rows.cu's tensor-core build).
#pragma once
#include "weights.cuh"
#include "mma.cuh"       // pack_half2

// The decode is what a row kernel spends its instructions on when an item holds few pairs (every
// block decodes its whole weight tile, however few pairs read it), so the two formats of the
// synthetic files get decoders in f16 pair arithmetic, about two instructions a weight against
// five in float32: a stored integer goes into the low mantissa bits of 1024 (0x6400 | u is
// 1024 + u exactly), 1024 is subtracted, the scale applied in f16.
//  - Q8_0: d * q with d the stored f16 scale: one correctly rounded f16 product, the same bits as
//    the float32 product rounded to f16 (which is exact before that rounding).
//  - Q4_K: a * q + b with a = d * scale and b = -dmin * min each rounded to f16 first, one f16
//    fma: within an f16 unit or two of the float32 decoding rounded to f16 (tests/
//    test_gpu_kernels.py against float64).
// Other formats decode in float32 and are rounded to f16 (the global-memory decoder's values).
__device__ __forceinline__ u32 half2_bits(__half2 h) { return *reinterpret_cast<u32*>(&h); }
__device__ __forceinline__ __half2 bits_half2(u32 v) { return *reinterpret_cast<__half2*>(&v); }

// bytes i and i + 1 of w as 0x64 b 0x64 b: two f16 of 1024 + byte
__device__ __forceinline__ u32 byte_pair_1024(u32 w, int i) {
    return __byte_perm(w, 0x64u, i == 0 ? 0x4140u : 0x4342u);
}

// Q4_K sub-block j of the super-block at blk: a = d * scale and b = -dmin * min, each rounded
// to f16, in both halves.
__device__ __forceinline__ void q4_k_scale_min_half(const u8* __restrict__ blk, int j,
                                                    __half2& a2, __half2& b2) {
    const uint4 head = *reinterpret_cast<const uint4*>(blk);
    int s, m;
    k_scale_min(head.y, head.z, head.w, j, s, m);
    a2 = __float2half2_rn(h2f((u16)(head.x & 0xFFFF)) * (float)s);
    b2 = __float2half2_rn(-(h2f((u16)(head.x >> 16)) * (float)m));
}

// Eight Q4_K weights (the nibbles at `shift` of the eight bytes w0, w1) as a * q + b in f16 pairs.
__device__ __forceinline__ void q4_k_nibbles_half(u32 w0, u32 w1, int shift, __half2 a2,
                                                  __half2 b2, u32 (&h)[4]) {
    const __half2 k1024 = __float2half2_rn(1024.f);
    const u32 words[2] = {w0 >> shift, w1 >> shift};
    #pragma unroll
    for (int t = 0; t < 4; ++t) {
        const u32 pair = byte_pair_1024(words[t >> 1], 2 * (t & 1)) & 0xFF0FFF0Fu;
        h[t] = half2_bits(__hfma2(__hsub2(bits_half2(pair), k1024), a2, b2));
    }
}

template <int T>
__device__ __forceinline__ void chunk8_half(const u8* __restrict__ row, int c, uint4& out) {
    u32 h[4];
    if constexpr (T == T_Q8_0) {
        const u16* p = reinterpret_cast<const u16*>(row + (c >> 2) * 34);
        const u32 d = p[0];
        const __half2 d2 = bits_half2(d | (d << 16));
        const __half2 off = __float2half2_rn(1152.f);        // 1024 + the 128 of the sign flip
        p += 1 + 4 * (c & 3);
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            // int8 b as b + 128 (its sign bit flipped) in 1024's mantissa
            const u32 pair = byte_pair_1024(p[j], 0) ^ 0x00800080u;
            h[j] = half2_bits(__hmul2(__hsub2(bits_half2(pair), off), d2));
        }
    } else if constexpr (T == T_Q4_K) {
        const u8* blk = row + (c >> 5) * 144;
        const int j = (c >> 2) & 7;
        __half2 a2, b2;
        q4_k_scale_min_half(blk, j, a2, b2);
        const uint2 qv = *reinterpret_cast<const uint2*>(blk + 16 + 32 * (j >> 1) + 8 * (c & 3));
        q4_k_nibbles_half(qv.x, qv.y, (j & 1) * 4, a2, b2, h);
    } else {
        float w[8];
        chunk8<T, false>(row, c, w);
        #pragma unroll
        for (int t = 0; t < 4; ++t) h[t] = pack_half2(w[2 * t], w[2 * t + 1]);
    }
    out = make_uint4(h[0], h[1], h[2], h[3]);
}

// Chunks c and c + 1 (c even: one Q4_K sub-block's half) into lo and hi. For Q4_K the two share
// their scale and min, which cost as many instructions as the weights, so they are unpacked once;
// the same values as two chunk8_half calls.
template <int T>
__device__ __forceinline__ void chunk16_half(const u8* __restrict__ row, int c, uint4& lo,
                                             uint4& hi) {
    if constexpr (T == T_Q4_K) {
        const u8* blk = row + (c >> 5) * 144;
        const int j = (c >> 2) & 7;
        __half2 a2, b2;
        q4_k_scale_min_half(blk, j, a2, b2);
        const uint4 qv = *reinterpret_cast<const uint4*>(blk + 16 + 32 * (j >> 1) + 8 * (c & 3));
        u32 h[4];
        q4_k_nibbles_half(qv.x, qv.y, (j & 1) * 4, a2, b2, h);
        lo = make_uint4(h[0], h[1], h[2], h[3]);
        q4_k_nibbles_half(qv.z, qv.w, (j & 1) * 4, a2, b2, h);
        hi = make_uint4(h[0], h[1], h[2], h[3]);
    } else {
        chunk8_half<T>(row, c, lo);
        chunk8_half<T>(row, c + 1, hi);
    }
}

