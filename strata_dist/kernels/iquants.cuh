// The i-quant block formats (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL,
// IQ4_XS) decoded 8 columns ("a chunk") at a time, in weights.cuh's shape: `iq_chunk8_q<T, NC>`
// gives chunk c of a row as 8 exact small numbers q and a scale a (the weights are a * q; b = 0,
// no i-quant has a min), the same contract as weights.cuh's chunk8_q, so a type joins the
// kernels by one dispatch line there. Each weight a * q is bit for bit what gguf-py's
// dequantizer computes (its scale expression in its order, then one multiply by a value whose
// sign flip is exact); tests/test_iquants_host.py builds these for the host and checks it.
//
// Every grid, sign pattern and level comes from iq_tables.cuh, generated from gguf-py's numbers
// (kernels/gen_iq_tables.py). Blocks of 66, 74, 82, 98, 110, 50 and 18 bytes leave rows 2-byte
// aligned only, so the stored bytes are read as u16 (or u8) words.
//
// Included by weights.cuh after its helpers (ldw, h2f, small_int_to_float) and its type ids
// (T_IQ*), as quant_blocks.cuh is; weights.cuh's chunk8_q dispatches to iq_chunk8_q.
#pragma once
#include "iq_tables.cuh"

HOST_DEVICE constexpr bool is_iquant(int T) {
    return T == T_IQ2_XXS || T == T_IQ2_XS || T == T_IQ3_XXS || T == T_IQ1_S || T == T_IQ4_NL ||
           T == T_IQ3_S || T == T_IQ2_S || T == T_IQ4_XS || T == T_IQ1_M;
}

// bytes of one stored block and values it holds (gguf's GGML_QUANT_SIZES)
HOST_DEVICE constexpr int iq_block_bytes(int T) {
    return T == T_IQ2_XXS ? 66 : T == T_IQ2_XS ? 74 : T == T_IQ2_S ? 82 : T == T_IQ3_XXS ? 98 :
           T == T_IQ3_S ? 110 : T == T_IQ1_S ? 50 : T == T_IQ1_M ? 56 : T == T_IQ4_NL ? 18 :
           T == T_IQ4_XS ? 136 : 0;
}
HOST_DEVICE constexpr int iq_block_values(int T) { return T == T_IQ4_NL ? 32 : 256; }

#define IQ1_DELTA 0.125f    // IQ1_S / IQ1_M: a group's values are its grid values +- this

template <bool NC>
HOST_DEVICE u32 iq_u8(const u8* p) { return ldw<NC>(p); }
template <bool NC>
HOST_DEVICE u32 iq_u16(const u8* p /* 2-byte aligned */) {
    return ldw<NC>(reinterpret_cast<const u16*>(p));
}
template <bool NC>
HOST_DEVICE u32 iq_u32(const u8* p /* 2-byte aligned */) {
    return iq_u16<NC>(p) | (iq_u16<NC>(p + 2) << 16);
}

// 8 grid bytes (value l in byte l of `grid`) with signs (bit l of `signs` set: negative)
HOST_DEVICE void iq_signed8(unsigned long long grid, u32 signs, float* q) {
    #pragma unroll
    for (int l = 0; l < 8; ++l) {
        const float v = small_int_to_float<0>((u32)(grid >> (8 * l)) & 0xFF);
        q[l] = (signs >> l) & 1 ? -v : v;
    }
}

// IQ1_S / IQ1_M: grid values -1, 0, 1 (signed bytes) plus delta, exact in a float
HOST_DEVICE void iq1_group(unsigned long long grid, float delta, float* q) {
    #pragma unroll
    for (int l = 0; l < 8; ++l) {
        const u32 b = (u32)(grid >> (8 * l)) & 0xFF;            // 0xFF, 0x00 or 0x01
        q[l] = (b == 0xFF ? -1.f : (float)b) + delta;
    }
}

// The 8 values of chunk c (columns 8c .. 8c+7) of a row of i-quant type T: q exact, a the scale,
// b = 0 (weights a * q).
template <int T, bool NC = true>
HOST_DEVICE void iq_chunk8_q(const u8* __restrict__ row, int c, float* q, float& a, float& b) {
    b = 0.f;
    if constexpr (T == T_IQ4_NL) {
        // 18 bytes: f16 d, 16 bytes of nibbles: values 0..15 the low nibbles, 16..31 the high
        const u8* blk = row + (i64)(c >> 2) * 18;
        const int k = c & 3, shift = (k >> 1) * 4;
        a = h2f((u16)iq_u16<NC>(blk));
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 v = iq_u16<NC>(blk + 2 + 8 * (k & 1) + 2 * j);
            q[2 * j] = (float)kvalues_iq4nl[(v >> shift) & 0xF];
            q[2 * j + 1] = (float)kvalues_iq4nl[(v >> (8 + shift)) & 0xF];
        }
        return;
    }
    const u8* blk = row + (i64)(c >> 5) * iq_block_bytes(T);
    const int g = c & 31;            // the chunk's group of 8 within its block of 256
    const int ib = g >> 2, l = g & 3;  // its sub-block of 32 and its place there
    if constexpr (T == T_IQ2_XXS) {
        // 66 bytes: f16 d, then per sub-block two u32: 4 grid indices (bytes), then 4 7-bit sign
        // indices (bits 0, 7, 14, 21) and the 4-bit scale (bits 28..31): d (0.5 + s) / 4
        const u8* sb = blk + 2 + 8 * ib;
        const u32 aux = iq_u32<NC>(sb + 4);
        a = h2f((u16)iq_u16<NC>(blk)) * (0.5f + small_int_to_float<0>(aux >> 28)) * 0.25f;
        iq_signed8(iq2xxs_grid[iq_u8<NC>(sb + l)], ksigns_iq2xs[(aux >> (7 * l)) & 127], q);
    } else if constexpr (T == T_IQ2_XS) {
        // 74 bytes: f16 d, 32 u16 (9-bit grid index, 7-bit sign index) one per group, 8 bytes of
        // 4-bit scales, one per 16 values: d (0.5 + s) / 4
        const u32 qs = iq_u16<NC>(blk + 2 + 2 * g);
        const u32 s = (iq_u8<NC>(blk + 66 + (g >> 2)) >> (4 * ((g >> 1) & 1))) & 0xF;
        a = h2f((u16)iq_u16<NC>(blk)) * (0.5f + small_int_to_float<0>(s)) * 0.25f;
        iq_signed8(iq2xs_grid[qs & 511], ksigns_iq2xs[qs >> 9], q);
    } else if constexpr (T == T_IQ2_S) {
        // 82 bytes: f16 d, 32 low bytes of the 10-bit grid indices, 32 sign bytes, 8 bytes of
        // the indices' top 2 bits, 8 bytes of 4-bit scales (one per 16 values): d (0.5 + s) / 4
        const u32 hi = (iq_u8<NC>(blk + 66 + (g >> 2)) >> (2 * (g & 3))) & 3;
        const u32 s = (iq_u8<NC>(blk + 74 + (g >> 2)) >> (4 * ((g >> 1) & 1))) & 0xF;
        a = h2f((u16)iq_u16<NC>(blk)) * (0.5f + small_int_to_float<0>(s)) * 0.25f;
        iq_signed8(iq2s_grid[iq_u8<NC>(blk + 2 + g) | (hi << 8)], iq_u8<NC>(blk + 34 + g), q);
    } else if constexpr (T == T_IQ3_XXS) {
        // 98 bytes: f16 d, 64 grid indices (4 values each), per sub-block a u32 of 4 7-bit sign
        // indices and the 4-bit scale (bits 28..31): d (0.5 + s) / 2
        const u32 aux = iq_u32<NC>(blk + 66 + 4 * ib);
        a = h2f((u16)iq_u16<NC>(blk)) * (0.5f + small_int_to_float<0>(aux >> 28)) * 0.5f;
        const u32 idx = iq_u16<NC>(blk + 2 + 2 * g);
        const unsigned long long grid = (unsigned long long)iq3xxs_grid[idx & 0xFF] |
                                        ((unsigned long long)iq3xxs_grid[idx >> 8] << 32);
        iq_signed8(grid, ksigns_iq2xs[(aux >> (7 * l)) & 127], q);
    } else if constexpr (T == T_IQ3_S) {
        // 110 bytes: f16 d, 64 low bytes of the 9-bit grid indices, 8 bytes of their top bits
        // (index e: bit e%8 of byte e/8), 32 sign bytes, 4 bytes of 4-bit scales (one per
        // sub-block): d (1 + 2 s)
        const u32 s = (iq_u8<NC>(blk + 106 + (ib >> 1)) >> (4 * (ib & 1))) & 0xF;
        a = h2f((u16)iq_u16<NC>(blk)) * small_int_to_float<0>(1 + 2 * s);
        const u32 idx = iq_u16<NC>(blk + 2 + 2 * g);
        const u32 hi = iq_u8<NC>(blk + 66 + (g >> 2)) >> (2 * (g & 3));
        const unsigned long long grid =
            (unsigned long long)iq3s_grid[(idx & 0xFF) | ((hi & 1) << 8)] |
            ((unsigned long long)iq3s_grid[(idx >> 8) | ((hi & 2) << 7)] << 32);
        iq_signed8(grid, iq_u8<NC>(blk + 74 + g), q);
    } else if constexpr (T == T_IQ1_S) {
        // 50 bytes: f16 d, 32 low bytes of the 11-bit grid indices, per sub-block a u16: the
        // indices' top 3 bits (3 l ..), the 3-bit scale (bits 12..14), the delta's sign (bit 15):
        // d (2 s + 1) (grid + delta)
        const u32 qh = iq_u16<NC>(blk + 34 + 2 * ib);
        a = h2f((u16)iq_u16<NC>(blk)) * small_int_to_float<0>(2 * ((qh >> 12) & 7) + 1);
        const u32 idx = iq_u8<NC>(blk + 2 + g) | (((qh >> (3 * l)) & 7) << 8);
        iq1_group(iq1s_grid[idx], qh & 0x8000 ? -IQ1_DELTA : IQ1_DELTA, q);
    } else if constexpr (T == T_IQ1_M) {
        // 56 bytes: 32 low bytes of the grid indices, 16 bytes of a nibble per group (top 3 index
        // bits, delta sign in bit 3), 4 u16 of 3-bit scales (one per 16 values, k at bits 3 (k%4)
        // of word k/4) whose top nibbles hold the f16 d: d (2 s + 1) (grid + delta)
        const u32 s0 = iq_u16<NC>(blk + 48), s1 = iq_u16<NC>(blk + 50);
        const u32 s2 = iq_u16<NC>(blk + 52), s3 = iq_u16<NC>(blk + 54);
        const u16 dbits = (u16)((s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000));
        const int k = g >> 1;
        const u32 word = k < 8 ? (k < 4 ? s0 : s1) : (k < 12 ? s2 : s3);
        const u32 s = (word >> (3 * (k & 3))) & 7;
        a = h2f(dbits) * small_int_to_float<0>(2 * s + 1);
        const u32 nib = (iq_u8<NC>(blk + 32 + (g >> 1)) >> (4 * (g & 1))) & 0xF;
        iq1_group(iq1s_grid[iq_u8<NC>(blk + g) | ((nib & 7) << 8)], nib & 8 ? -IQ1_DELTA : IQ1_DELTA, q);
    } else if constexpr (T == T_IQ4_XS) {
        // 136 bytes: f16 d, u16 of the scales' top 2 bits (2 ib ..), 4 bytes of their low
        // nibbles, 128 bytes of 4-bit codes: sub-block ib the low then the high nibbles of bytes
        // 16 ib .. 16 ib + 15: d (s - 32) level
        const u32 sl = (iq_u8<NC>(blk + 4 + (ib >> 1)) >> (4 * (ib & 1))) & 0xF;
        const u32 sh = (iq_u16<NC>(blk + 2) >> (2 * ib)) & 3;
        a = h2f((u16)iq_u16<NC>(blk)) * small_int_to_float<32>(sl | (sh << 4));
        const int shift = (l >> 1) * 4;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 v = iq_u16<NC>(blk + 8 + 16 * ib + 8 * (l & 1) + 2 * j);
            q[2 * j] = (float)kvalues_iq4nl[(v >> shift) & 0xF];
            q[2 * j + 1] = (float)kvalues_iq4nl[(v >> (8 + shift)) & 0xF];
        }
    }
}

// The 8 weights of chunk c, decoded (a * q) as gguf-py decodes them.
template <int T, bool NC = true>
HOST_DEVICE void iq_chunk8(const u8* __restrict__ row, int c, float* w) {
    float a, b;
    iq_chunk8_q<T, NC>(row, c, w, a, b);
    #pragma unroll
    for (int l = 0; l < 8; ++l) w[l] = a * w[l];
}

// One stored block (256 values, or 32 for IQ4_NL) decoded to out[0 .. values).
template <int T, bool NC = true>
HOST_DEVICE void iq_block(const u8* __restrict__ blk, float* out) {
    for (int c = 0; c < iq_block_values(T) / 8; ++c) iq_chunk8<T, NC>(blk, c, out + 8 * c);
}
