// Unit dots of the integer expert path (experts_int.cuh) for three i-quants: IQ4_XS, IQ3_S and
// IQ2_XXS. Each `<type>_unit_dot(row, u, f)` is q4_k_unit_dot's contract: unit u (columns 64u ..
// 64u + 63, sub-blocks 2p and 2p + 1 of 256-column super-block u / 4, p = u % 4) of a row in its
// stored blocks against the unit's activations f (x = step (254 h + l), experts_int.cuh), the
// stored integers meeting h and l in dp4a_s8 (dot32) and the block scales applied once per 32
// columns. No i-quant has a min, so f.sum goes unused.
//
// Included by experts_int.cuh after its XFrag, dot32 and dp4a_s8 (int_unit_dot dispatches here
// under INT_IQ4_XS / INT_IQ3_S / INT_IQ2_XXS), and after iquants.cuh (the i-quant tables of
// iq_tables.cuh, generated from gguf-py's numbers, and the u16 loads iq_u16). The formats and the
// way their signs meet dp4a follow llama.cpp's ggml-cuda vecdotq.cuh (vec_dot_iq4_xs_q8_1,
// vec_dot_iq3_s_q8_1, vec_dot_iq2_xxs_q8_1), except that each 32-column sum is scaled in float
// (llama.cpp's IQ2_XXS rounds (2 s + 1) sum / 4 to an integer), so the result stays within the
// activation quantizer's bound of the float64 reference (tests/test_kernels_compile.py).
//
// Loads: the rows are read in place from device memory, so no load is wider than what a block's
// size leaves aligned inside a row whose start is 16-byte aligned: IQ4_XS (136-byte blocks) 8
// bytes (uint2), IQ3_S (110) and IQ2_XXS (66) 2 bytes (u16, iq_u16) or single bytes.
#pragma once

// kvalues_iq4nl (iq_tables.cuh), the 16 IQ4_NL / IQ4_XS levels, as 4 words of 4 int8 bytes for
// byte_perm lookups in registers (a table in global memory would cost a load per value); the
// host test checks them against the table.
#define IQ4NL_LEVELS_0 0xBFAD9881u   // -127, -104, -83, -65
#define IQ4NL_LEVELS_1 0xF6EADDCFu   // -49, -35, -22, -10
#define IQ4NL_LEVELS_2 0x26190D01u   // 1, 13, 25, 38
#define IQ4NL_LEVELS_3 0x71594535u   // 53, 69, 89, 113

// __byte_perm: byte n of the result is byte (s >> 4n) & 7 of the 8 bytes y:x. Every selector
// passed here has bit 3 of each nibble clear, so PTX prmt's sign-replicate bit never matters.
HOST_DEVICE u32 byte_perm(u32 x, u32 y, u32 s) {
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, s);
#else
    const u64 v = ((u64)y << 32) | x;
    u32 r = 0u;
    for (int n = 0; n < 4; ++n) r |= (u32)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
    return r;
#endif
}

// The IQ4 levels of the 8 nibbles of w: lo gets those of the low nibbles of its 4 bytes, hi
// those of the high nibbles (byte j of each: byte j of w). As llama.cpp's get_int_from_table_16:
// each nibble's low 3 bits pick from levels 0..7 and from 8..15, its bit 3 picks between them.
HOST_DEVICE void iq4nl_levels(u32 w, u32& lo, u32& hi) {
    const u32 upper = 0x32103210u | ((w & 0x88888888u) >> 1);   // byte n, or byte n + 4 of b:a
    u32 t[2];                       // t[0]: nibbles 0..3 of w (byte 0 low, high, byte 1 ...)
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 s = (w >> (16 * i)) & 0x7777u;
        const u32 a = byte_perm(IQ4NL_LEVELS_0, IQ4NL_LEVELS_1, s);
        const u32 b = byte_perm(IQ4NL_LEVELS_2, IQ4NL_LEVELS_3, s);
        t[i] = byte_perm(a, b, (upper >> (16 * i)) & 0xFFFFu);
    }
    lo = byte_perm(t[0], t[1], 0x6420u);
    hi = byte_perm(t[0], t[1], 0x7531u);
}

// 4 grid bytes v (each 1..127: no grid value of IQ3_S or IQ2_XXS is 0) negated where bit j of s
// is set: (v ^ 0xFF) + 1 per negated byte, never carrying into the next byte since no byte is 0.
// The multiply spreads bits 0..3 of s to bit 0 of bytes 0..3 (the shifted copies do not overlap).
HOST_DEVICE u32 iq_sign4(u32 v, u32 s) {
    const u32 ones = ((s & 0xFu) * 0x00204081u) & 0x01010101u;
    return (v ^ (ones * 0xFFu)) + ones;
}

// ksigns_iq2xs[s] (s < 128) without a table load: the 7 signs of s and, as the 8th, their parity
// (a table of 7-bit sign indices only holds patterns with an even count; the host test checks
// every entry against the table).
HOST_DEVICE u32 iq_signs8(u32 s) {
#ifdef __CUDA_ARCH__
    return s | ((__popc(s) & 1u) << 7);
#else
    return s | (((u32)__builtin_popcount(s) & 1u) << 7);
#endif
}

// IQ4_XS: 136 bytes: f16 d, u16 of the scales' top 2 bits (2 ib ..), 4 bytes of their low
// nibbles (sub-block ib: nibble ib % 2 of byte ib / 2), 128 bytes of 4-bit codes: sub-block ib
// the low then the high nibbles of bytes 16 ib .. 16 ib + 15; weight d (s - 32) level.
HOST_DEVICE float iq4_xs_unit_dot(const u8* __restrict__ row, int u, const XFrag& f) {
    const int sb = u >> 2, p = u & 3;
    const u8* blk = row + (i64)sb * 136;
    const uint2 head = ldw<true>(reinterpret_cast<const uint2*>(blk));   // 8-byte aligned
    const uint2* qs = reinterpret_cast<const uint2*>(blk + 8 + 32 * p);
    const float d = h2f((u16)(head.x & 0xFFFF));
    float r = 0.f;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int ib = 2 * p + half;
        const uint2 a = ldw<true>(qs + 2 * half), b = ldw<true>(qs + 2 * half + 1);
        const u32 w[4] = {a.x, a.y, b.x, b.y};
        u32 q[8];
        #pragma unroll
        for (int j = 0; j < 4; ++j) iq4nl_levels(w[j], q[j], q[4 + j]);
        const int s = (int)(((head.y >> (8 * p + 4 * half)) & 0xF) |
                            (((head.x >> (16 + 2 * ib)) & 3) << 4));
        r = fmaf(d * (float)(s - 32), (float)dot32(q, f, half) * f.step[half], r);
    }
    return r;
}

// IQ3_S: 110 bytes: f16 d, 64 low bytes of the 9-bit grid indices (4 values each; sub-block ib:
// bytes 8 ib ..), 8 bytes of their top bits (byte ib, bit k for index k of sub-block ib), 32 sign
// bytes (one per 8 values), 4 bytes of 4-bit scales (sub-block ib: nibble ib % 2 of byte ib / 2);
// weight d (1 + 2 s) grid, negated where its sign bit is set.
HOST_DEVICE float iq3_s_unit_dot(const u8* __restrict__ row, int u, const XFrag& f) {
    const int sb = u >> 2, p = u & 3;
    const u8* blk = row + (i64)sb * 110;
    const float d = h2f((u16)iq_u16<true>(blk));
    const u32 qh = iq_u16<true>(blk + 66 + 2 * p);              // top bits of sub-blocks 2p, 2p+1
    const u32 sc = iq_u8<true>(blk + 106 + p);                  // their scales
    float r = 0.f;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int ib = 2 * p + half;
        const u8* idx = blk + 2 + 8 * ib;
        const u32 signs = iq_u32<true>(blk + 74 + 4 * ib);      // byte k: values 8k .. 8k + 7
        const u32 top = qh >> (8 * half);
        u32 q[8];
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 two = iq_u16<true>(idx + 2 * j);          // indices 2j and 2j + 1
            const u32 s = signs >> (8 * j);
            q[2 * j] = iq_sign4(iq3s_grid[(two & 0xFF) | (((top >> (2 * j)) & 1) << 8)], s);
            q[2 * j + 1] = iq_sign4(iq3s_grid[(two >> 8) | (((top >> (2 * j + 1)) & 1) << 8)],
                                    s >> 4);
        }
        const int scale = 1 + 2 * (int)((sc >> (4 * half)) & 0xF);
        r = fmaf(d * (float)scale, (float)dot32(q, f, half) * f.step[half], r);
    }
    return r;
}

// IQ2_XXS: 66 bytes: f16 d, then per sub-block two u32: 4 grid indices (bytes; 8 values each),
// then 4 7-bit sign indices (bits 0, 7, 14, 21; iq_signs8 gives the 8 signs) and the 4-bit
// scale (bits 28..31); weight d (0.5 + s) / 4 grid, negated where its sign bit is set.
HOST_DEVICE float iq2_xxs_unit_dot(const u8* __restrict__ row, int u, const XFrag& f) {
    const int sb = u >> 2, p = u & 3;
    const u8* blk = row + (i64)sb * 66;
    const float d = h2f((u16)iq_u16<true>(blk));
    float r = 0.f;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const u8* s8 = blk + 2 + 8 * (2 * p + half);
        const u32 idx = iq_u32<true>(s8), aux = iq_u32<true>(s8 + 4);
        u32 q[8];
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u64 grid = iq2xxs_grid[(idx >> (8 * j)) & 0xFF];
            const u32 s = iq_signs8((aux >> (7 * j)) & 127);
            q[2 * j] = iq_sign4((u32)grid, s);
            q[2 * j + 1] = iq_sign4((u32)(grid >> 32), s >> 4);
        }
        const float a = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        r = fmaf(a, (float)dot32(q, f, half) * f.step[half], r);
    }
    return r;
}
