// Unit dots of the integer expert path (kernels/experts_int.cuh, int_unit_dot) for the K-quants
// beyond Q4_K: Q5_K, Q6_K, Q3_K and Q2_K, each behind its switch (INT_Q5_K ... INT_Q2_K). Each
// returns one 64-column unit of a row against its activations' fragment (XFrag); the Q4_K dot and
// the activation layout they share are in experts_int.cuh, which includes this file.
#pragma once

// Unit u of a Q5_K row: Q4_K's pair (nibbles at offset 48 here) with a fifth bit each, from
// qh[32] at offset 16: bit j of qh byte l for element l of sub-block j (values 0 .. 31).
HOST_DEVICE void q5_k_unit(const u8* __restrict__ row, int u, uint4& head, u32 (&lo)[8],
                           u32 (&hi)[8]) {
    const int sb = u >> 2, p = u & 3;
    const u8* blk = row + sb * 176;
    head = *reinterpret_cast<const uint4*>(blk);
    const uint4 ha = reinterpret_cast<const uint4*>(blk + 16)[0];
    const uint4 hb = reinterpret_cast<const uint4*>(blk + 16)[1];
    const uint4 a = reinterpret_cast<const uint4*>(blk + 48 + 32 * p)[0];
    const uint4 b = reinterpret_cast<const uint4*>(blk + 48 + 32 * p)[1];
    const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    const u32 qh[8] = {ha.x, ha.y, ha.z, ha.w, hb.x, hb.y, hb.z, hb.w};
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
        lo[j] = (w[j] & 0x0F0F0F0Fu) | (((qh[j] >> (2 * p)) & 0x01010101u) << 4);
        hi[j] = ((w[j] >> 4) & 0x0F0F0F0Fu) | (((qh[j] >> (2 * p + 1)) & 0x01010101u) << 4);
    }
}

// Unit u of a Q5_K row against its activations
HOST_DEVICE float q5_k_unit_dot(const u8* __restrict__ row, int u, const XFrag& f) {
    uint4 head;
    u32 lo[8], hi[8];
    q5_k_unit(row, u, head, lo, hi);
    return k_pair_dot(head, u & 3, lo, hi, f);
}

// the low 32 bits of (hi:lo) >> shift (shift 0 or 16 here)
HOST_DEVICE u32 funnel_r(u32 lo, u32 hi, int shift) {
#ifdef __CUDA_ARCH__
    return __funnelshift_r(lo, hi, shift);
#else
    return shift == 0 ? lo : (lo >> shift) | (hi << (32 - shift));
#endif
}

// N words of bytes p .. p + 4N - 1, p 2-byte aligned: the N + 1 aligned words around them, joined.
// The first holds p's own byte (so lies in p's page, where p is 2 bytes into it: never a fault);
// the word past the run is read whatever the alignment (uniform code): every run read here has at
// least 4 more bytes of its block after it.
template <int N>
HOST_DEVICE void load_words_2aligned(const u8* p, u32 (&w)[N]) {
    const u32* a = reinterpret_cast<const u32*>((u64)p & ~(u64)3);
    const int shift = (int)((u64)p & 3) * 8;
    u32 prev = a[0];
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        const u32 next = a[i + 1];
        w[i] = funnel_r(prev, next, shift);
        prev = next;
    }
}

HOST_DEVICE u32 load_u16(const u8* p /* 2-byte aligned */) {
    return *reinterpret_cast<const u16*>(p);
}

// 6-bit values v (0 .. 63, a byte each) as the signed bytes v - 32: v ^ 32 is v - 32 in 6-bit
// two's complement, and its sign bit (32) copied into bits 6 and 7 (32 * 6 = 192) makes it 8-bit.
HOST_DEVICE u32 q6_centre(u32 v) {
    const u32 x = v ^ 0x20202020u;
    return x | ((x & 0x20202020u) * 6u);
}

// sums of 16 products: words o .. o + 3 of q (4 int8 each) against words o .. o + 3 of the
// fragment's h (into a) and l (into b)
HOST_DEVICE void dot16(const u32* q, const XFrag& f, int o, int& a, int& b) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        a = dp4a_s8((int)q[i], (int)f.h[o + i], a);
        b = dp4a_s8((int)q[i], (int)f.l[o + i], b);
    }
}

// r plus half `half` (32 columns) of a unit whose weights are d * s * q (q int8 in the 8 words,
// s0 for its first 16 columns, s1 for the rest): the scaled 16-column sums added as integers, then
// one fmaf (|s0 a0 + s1 a1| < 2^24 for Q6_K's |q| <= 32, |s| <= 128 and Q3_K's smaller ones: the
// conversions to float are exact)
HOST_DEVICE float scaled16_half(const u32 (&q)[8], int s0, int s1, float d, const XFrag& f,
                                int half, float r) {
    int a0 = 0, b0 = 0, a1 = 0, b1 = 0;
    dot16(q, f, 8 * half, a0, b0);
    dot16(q + 4, f, 8 * half + 4, a1, b1);
    const int a = s0 * a0 + s1 * a1, b = s0 * b0 + s1 * b1;
    return fmaf(d, fmaf((float)a, (float)XQ_LEVELS, (float)b) * f.step[half], r);
}

// Unit u of a Q6_K row (210-byte blocks: ql[128], qh[64], int8 scales[16], f16 d at 208).
// Element e = 128h + 32t + l of a block: the low (t < 2) or high nibble of ql[64h + 32(t & 1) + l]
// and bits 2t, 2t + 1 of qh[32h + l] make v (0 .. 63), the weight d * scales[8h + 2t + l / 16] *
// (v - 32). Unit p = u % 4 of block u / 4 is h = p / 2, t = 2(p & 1) and t + 1 (its two 32-column
// halves): ql bytes 64h .. 64h + 63, qh bytes 32h .. 32h + 31, scale bytes 8h + 2t .. + 3 (one per
// 16 columns). The scaled 16-column sums of a half are summed as integers (|sum| < 2^24: at most
// 2 * 16 * 32 * 128 * 127 for h and for l, so exact in float too) and joined by one fmaf.
HOST_DEVICE float q6_k_unit_dot(const u8* __restrict__ row, int u, const XFrag& f) {
    const int sb = u >> 2, p = u & 3, h = p >> 1, t = 2 * (p & 1);
    const u8* blk = row + sb * 210;
    u32 qh[8];
    load_words_2aligned(blk + 128 + 32 * h, qh);
    const u32 sc = load_u16(blk + 192 + 8 * h + 2 * t) |
                   (load_u16(blk + 194 + 8 * h + 2 * t) << 16);
    const float d = h2f((u16)load_u16(blk + 208));
    const int nibble = 4 * (p & 1);
    float r = 0.f;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        // a half's ql words at a time (ptxas: moe_down_q6_k 113 -> 80 registers)
        u32 ql[8], q[8];
        load_words_2aligned(blk + 64 * h + 32 * half, ql);
        #pragma unroll
        for (int j = 0; j < 8; ++j)
            q[j] = q6_centre(((ql[j] >> nibble) & 0x0F0F0F0Fu) |
                             (((qh[j] >> (2 * (t + half))) & 0x03030303u) << 4));
        r = scaled16_half(q, (int)(signed char)(sc >> (16 * half)),
                          (int)(signed char)(sc >> (16 * half + 8)), d, f, half, r);
    }
    return r;
}

// 3-bit values v (0 .. 7, a byte each) as the signed bytes v - 4 (q6_centre's way: bit 2 the sign,
// 4 * 62 = 248 sets bits 3 .. 7 with it)
HOST_DEVICE u32 q3_centre(u32 v) {
    const u32 x = v ^ 0x04040404u;
    return x | ((x & 0x04040404u) * 62u);
}

// Q3_K's 6-bit scale k (0 .. 15) less 32, from the 12 scale bytes at offset 96: its low nibble is
// byte k's (k < 8) or byte k - 8's high nibble, its top two bits bits 2(k / 4) of byte 8 + k % 4
HOST_DEVICE int q3_k_scale(const u8* blk, int k) {
    const int lo = (k < 8 ? blk[96 + k] : blk[88 + k] >> 4) & 0xF;
    const int hi = (blk[104 + (k & 3)] >> (2 * (k >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

// Unit u of a Q3_K row (110-byte blocks, 2-byte aligned: hmask[32], qs[64], scales[12], f16 d at
// 108). Element e = 128n + 32j + l: bits 2j of qs[32n + l] and bit 4n + j of hmask[l] (set: no
// offset, clear: less 4) make v - 4 (-4 .. 3), the weight d * scale(8n + 2j + l / 16) * (v - 4).
// Unit p = u % 4 of block u / 4 is n = p / 2, j = 2(p & 1) and j + 1: qs bytes 32n .. 32n + 31
// and hmask bytes 0 .. 31 for both halves, at their own shifts.
HOST_DEVICE float q3_k_unit_dot(const u8* __restrict__ row, int u, const XFrag& f) {
    const int sb = u >> 2, p = u & 3, n = p >> 1, j0 = 2 * (p & 1);
    const u8* blk = row + sb * 110;
    u32 qs[8], hm[8];
    load_words_2aligned(blk + 32 + 32 * n, qs);
    load_words_2aligned(blk, hm);
    const float d = h2f((u16)load_u16(blk + 108));
    float r = 0.f;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int j = j0 + half;
        u32 q[8];
        #pragma unroll
        for (int w = 0; w < 8; ++w)
            q[w] = q3_centre(((qs[w] >> (2 * j)) & 0x03030303u) |
                             (((hm[w] >> (4 * n + j)) & 0x01010101u) << 2));
        r = scaled16_half(q, q3_k_scale(blk, 8 * n + 2 * j), q3_k_scale(blk, 8 * n + 2 * j + 1), d,
                          f, half, r);
    }
    return r;
}

// Unit u of a Q2_K row (84-byte blocks, 4-byte aligned: scales[16] (a 4-bit scale low, a 4-bit
// min high), qs[64], f16 d at 80, f16 dmin at 82). Element e = 128n + 32j + l: bits 2j of
// qs[32n + l] make q (0 .. 3), the weight d * (sc & 15) * q - dmin * (sc >> 4), sc = scales[8n +
// 2j + l / 16]. Unit p = u % 4 of block u / 4 is n = p / 2, j = 2(p & 1) and j + 1. The scale
// goes into the bytes before __dp4a (q * s <= 45: a word times s carries into no other byte),
// and the min meets the quantized activations' own 16-column sums (__dp4a against m in every
// byte; the float sums are per 32 columns), so each weight meets the same x in both terms.
HOST_DEVICE float q2_k_unit_dot(const u8* __restrict__ row, int u, const XFrag& f) {
    const int sb = u >> 2, p = u & 3, n = p >> 1, j0 = 2 * (p & 1);
    const u8* blk = row + sb * 84;
    const u32* qw = reinterpret_cast<const u32*>(blk + 16 + 32 * n);    // 4-byte aligned only
    const u32 sc = *reinterpret_cast<const u32*>(blk + 8 * n + 2 * j0);
    const u32 dd = *reinterpret_cast<const u32*>(blk + 80);
    const float d = h2f((u16)(dd & 0xFFFF)), dmin = h2f((u16)(dd >> 16));
    float r = 0.f;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int j = j0 + half;
        int a = 0, b = 0, hm = 0, lm = 0;
        #pragma unroll
        for (int w = 0; w < 8; ++w) {
            const u32 c = (sc >> (16 * half + 8 * (w >> 2))) & 0xFF;   // 16 columns a byte
            const int qs = (int)(((qw[w] >> (2 * j)) & 0x03030303u) * (c & 15));
            const int m = (int)(0x01010101u * (c >> 4));
            a = dp4a_s8(qs, (int)f.h[8 * half + w], a);
            b = dp4a_s8(qs, (int)f.l[8 * half + w], b);
            hm = dp4a_s8(m, (int)f.h[8 * half + w], hm);
            lm = dp4a_s8(m, (int)f.l[8 * half + w], lm);
        }
        r = fmaf(d, fmaf((float)a, (float)XQ_LEVELS, (float)b) * f.step[half], r);
        r = fmaf(-dmin, fmaf((float)hm, (float)XQ_LEVELS, (float)lm) * f.step[half], r);
    }
    return r;
}
