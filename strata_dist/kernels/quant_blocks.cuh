// The block formats weights.cuh's first six types do not cover: the legacy quants Q4_0, Q4_1,
// Q5_0, Q5_1 (blocks of 32 columns) and the K-quants Q2_K and Q3_K (super-blocks of 256), each
// decoded 8 columns ("a chunk") at a time in weights.cuh's contract: chunk c of a row as 8 exact
// small integers q (as floats) and the chunk's affine map a, b (its weights are a * q + b).
// weights.cuh's chunk8_q hands these types here, and its `chunk8` rounds each weight exactly as
// gguf-py's dequantizer does: a * q alone where b = 0, and for the types with a min (Q4_1, Q5_1,
// Q2_K) the product rounded, then b added (gguf-py's `d * q + m` and `dl * q - ml`), not a fused
// multiply-add: every weight is gguf-py's bit for bit (tests/test_quant_blocks_host.py builds
// these for the host and checks it).
//
// Blocks of 18, 22 and 110 bytes leave rows only 2-byte aligned (Q4_0, Q5_0, Q3_K: read as u16
// words); 20, 24 and 84 bytes keep 4 (Q4_1, Q5_1, Q2_K: u32 words) - kernels/abi.py KERNEL_TYPES
// holds the same alignments, and a row the host cannot align so is refused there.
//
// Included by weights.cuh after its helpers (ldw, h2f, small_int_to_float).
#pragma once

template <bool NC>
HOST_DEVICE u32 qb_u16(const u8* p /* 2-byte aligned */) {
    return ldw<NC>(reinterpret_cast<const u16*>(p));
}
template <bool NC>
HOST_DEVICE u32 qb_u32(const u8* p /* 4-byte aligned */) {
    return ldw<NC>(reinterpret_cast<const u32*>(p));
}

// The 8 nibbles at `shift` (0: low, 4: high) of the 8 bytes of words w0, w1 (byte l of the pair
// is element l), plus 16 * the bits `hi8` (bit l for element l), as floats minus OFFSET.
template <int OFFSET>
HOST_DEVICE void qb_nibbles8(u32 w0, u32 w1, int shift, u32 hi8, float* q) {
    #pragma unroll
    for (int l = 0; l < 8; ++l) {
        const u32 word = l < 4 ? w0 : w1;
        const u32 v = ((word >> (8 * (l & 3) + shift)) & 0xF) | (((hi8 >> l) & 1) << 4);
        q[l] = small_int_to_float<OFFSET>(v);
    }
}

// The 8 bytes at p (2-byte aligned) as two words
template <bool NC>
HOST_DEVICE void qb_bytes8_u16(const u8* p, u32& w0, u32& w1) {
    w0 = qb_u16<NC>(p) | (qb_u16<NC>(p + 2) << 16);
    w1 = qb_u16<NC>(p + 4) | (qb_u16<NC>(p + 6) << 16);
}

// A 32-column block (Q4_0 .. Q5_1) holds 4 chunks: chunk k (0..3) is elements 8k .. 8k + 7;
// elements 0..15 are the low nibbles of qs[0..15], 16..31 the high nibbles, so chunk k reads
// qs[8 (k & 1) ..] at nibble 4 (k >> 1); Q5's 32-bit qh gives element e its 5th bit (bit e).
template <int T, bool NC>
HOST_DEVICE void qb_legacy_chunk8_q(const u8* __restrict__ row, int c, float* q, float& a,
                                    float& b) {
    constexpr int bytes = T == T_Q4_0 ? 18 : T == T_Q4_1 ? 20 : T == T_Q5_0 ? 22 : 24;
    constexpr bool min = T == T_Q4_1 || T == T_Q5_1, five = T == T_Q5_0 || T == T_Q5_1;
    constexpr int qs_at = (min ? 4 : 2) + (five ? 4 : 0);
    const u8* blk = row + (i64)(c >> 2) * bytes;
    const int k = c & 3;
    u32 w0, w1, hi8 = 0;
    if constexpr (min) {
        // d, m, [qh], qs: 4-byte aligned
        const u32 dm = qb_u32<NC>(blk);
        a = h2f((u16)(dm & 0xFFFF));
        b = h2f((u16)(dm >> 16));
        if constexpr (five) hi8 = (qb_u32<NC>(blk + 4) >> (8 * k)) & 0xFF;
        w0 = qb_u32<NC>(blk + qs_at + 8 * (k & 1));
        w1 = qb_u32<NC>(blk + qs_at + 8 * (k & 1) + 4);
    } else {
        a = h2f((u16)qb_u16<NC>(blk));
        b = 0.f;
        if constexpr (five) {
            const u32 qh = qb_u16<NC>(blk + 2) | (qb_u16<NC>(blk + 4) << 16);
            hi8 = (qh >> (8 * k)) & 0xFF;
        }
        qb_bytes8_u16<NC>(blk + qs_at + 8 * (k & 1), w0, w1);
    }
    // gguf-py: Q4_0 d * (q - 8), Q5_0 d * (q - 16), Q4_1 / Q5_1 d * q + m
    constexpr int offset = min ? 0 : five ? 16 : 8;
    qb_nibbles8<offset>(w0, w1, 4 * (k >> 1), hi8, q);
}

// Q2_K, 84 bytes: scales[16] (low nibble scale, high nibble min of each 16 columns), qs[64]
// (2 bits an element), f16 d, f16 dmin. Element e = 128h + 32s + l is bits 2s.. of qs[32h + l];
// its 16-column group e / 16 takes scales[e / 16]: d * scale * q - dmin * min.
template <bool NC>
HOST_DEVICE void qb_q2_k_chunk8_q(const u8* __restrict__ row, int c, float* q, float& a,
                                  float& b) {
    const u8* blk = row + (i64)(c >> 5) * 84;
    const int e0 = 8 * (c & 31), h = e0 >> 7, s = (e0 >> 5) & 3, l0 = e0 & 31;
    const u32 sc = ldw<NC>(blk + (e0 >> 4));
    const u32 dd = qb_u32<NC>(blk + 80);
    a = h2f((u16)(dd & 0xFFFF)) * small_int_to_float<0>(sc & 0xF);
    b = -(h2f((u16)(dd >> 16)) * small_int_to_float<0>(sc >> 4));
    const u32 w0 = qb_u32<NC>(blk + 16 + 32 * h + l0), w1 = qb_u32<NC>(blk + 20 + 32 * h + l0);
    #pragma unroll
    for (int l = 0; l < 8; ++l)
        q[l] = small_int_to_float<0>(((l < 4 ? w0 : w1) >> (8 * (l & 3) + 2 * s)) & 3);
}

// Q3_K, 110 bytes: hmask[32], qs[64], 12 bytes of 6-bit scales, f16 d. Element e = 128h + 32s + l:
// low bits 2s.. of qs[32h + l], high bit e / 32 of hmask[l] (set: +0, clear: -4, as gguf-py
// reads it); its 16-column group j = e / 16 has scale (low nibble of byte j % 8, the high one
// for j >= 8) | (bits 2 (j / 4).. of byte 8 + j % 4) << 4, stored + 32: d * (scale - 32) * q.
template <bool NC>
HOST_DEVICE void qb_q3_k_chunk8_q(const u8* __restrict__ row, int c, float* q, float& a,
                                  float& b) {
    const u8* blk = row + (i64)(c >> 5) * 110;
    const int e0 = 8 * (c & 31), h = e0 >> 7, s = (e0 >> 5) & 3, l0 = e0 & 31, j = e0 >> 4;
    const u32 lo = (u32)ldw<NC>(blk + 96 + (j & 7)) >> (4 * (j >> 3));
    const u32 hi = (u32)ldw<NC>(blk + 104 + (j & 3)) >> (2 * (j >> 2));
    a = h2f((u16)qb_u16<NC>(blk + 108)) * small_int_to_float<32>((lo & 0xF) | ((hi & 3) << 4));
    b = 0.f;
    u32 q0, q1, m0, m1;
    qb_bytes8_u16<NC>(blk + 32 + 32 * h + l0, q0, q1);
    qb_bytes8_u16<NC>(blk + l0, m0, m1);
    const int hbit = e0 >> 5;
    #pragma unroll
    for (int l = 0; l < 8; ++l) {
        const int sh = 8 * (l & 3);
        const u32 low = ((l < 4 ? q0 : q1) >> (sh + 2 * s)) & 3;
        const u32 high = ((l < 4 ? m0 : m1) >> (sh + hbit)) & 1;
        q[l] = small_int_to_float<4>(low | (high << 2));      // low + 4 high - 4
    }
}

// The types above, by id (weights.cuh chunk8_q's last case)
template <int T, bool NC>
HOST_DEVICE void qb_chunk8_q(const u8* __restrict__ row, int c, float* q, float& a, float& b) {
    if constexpr (T == T_Q4_0 || T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1)
        qb_legacy_chunk8_q<T, NC>(row, c, q, a, b);
    else if constexpr (T == T_Q2_K)
        qb_q2_k_chunk8_q<NC>(row, c, q, a, b);
    else if constexpr (T == T_Q3_K)
        qb_q3_k_chunk8_q<NC>(row, c, q, a, b);
    else
        static_assert(T == T_F32 || T == T_F16 || T == T_BF16,   // float types: chunk8 reads them
                      "chunk8_q: a type in FOR_EACH_TYPE without a decoder");
}

// BF16: the top 16 bits of a float32
HOST_DEVICE float bf16_bits_to_float(u32 top16) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(top16 << 16);
#else
    union { u32 u; float f; } bits;
    bits.u = top16 << 16;
    return bits.f;
#endif
}
