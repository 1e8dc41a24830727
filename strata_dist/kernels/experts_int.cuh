// The integer path of the decode expert kernels (included by experts.cuh): Q4_K always; Q5_K,
// Q6_K, Q3_K and Q2_K behind their switches (INT_Q5_K ... INT_Q2_K, kernels/abi.py KernelShape
// int_q5_k ... int_q2_k; on by default, measured faster on an H100: see the switches below).
// Q8_0 experts could take it too behind a switch, deleted on 2026-12-05: it measured slower than
// their float path (docs/BENCHMARKS.md); their 34-byte blocks cannot be read in place.
//
// Why: the float path decodes every weight to a float before its FMA, about a dozen instructions
// a weight with the block reductions; Nsight Compute read moe_gate_up_q4_k issue-bound at 10% of
// DRAM bandwidth (docs/BENCHMARKS.md). Here the stored integers meet integer activations in
// __dp4a (four products and a sum in one instruction), and the scales apply once per 32 columns
// (Q6_K, Q3_K, Q2_K: per 16, their scales' width).
//
// Activations: each 32-column block b of x becomes x = s_b * (254 h + l) with h, l int8:
// h = round(x / (amax / 127)) and l = round(254 * the remainder): steps of amax / 32258 (about
// 15 bits), each value within amax / 64516 (float32 sums of the stored weights stay the
// reference; the kernels are tested within 1e-4 of it). The integer sums are exact, so only the
// per-block float steps round, in one fixed order (Q5_K's 32-column sums can pass 2^24, where
// their conversion to float rounds once, by at most 2^-25 of the sum).
// Each block quantizes its own copy into shared memory from the float rows, so no other kernel
// changes, and a (row, expert) result depends on nothing but that row and that expert.
//
// Weights: a type's unit dot (int_unit_dot; Q5_K ... Q2_K's in experts_int_k.cuh, the
// i-quants' in experts_int_iq.cuh) decodes a 64-column unit of a row: Q4_K and Q5_K
// super-blocks (144 and 176 bytes) keep their units 16-byte aligned and are read with 16-byte
// loads; Q6_K's 210-byte and Q3_K's 110-byte blocks leave them 2-byte aligned only, read as
// aligned words joined by funnel shifts; Q2_K's 84-byte blocks, 4-byte aligned, as words. With
// INT_DIRECT (the default, KernelShape int_direct) the lanes read the rows straight from device
// memory; with int_direct=0 a warp stages its rows into shared memory with 16-byte cp.async
// copies first (the copies of its first rows are in flight while the block quantizes), which
// needs rows of whole 16-byte pieces (a Q6_K row of 768 columns, 630 bytes, takes the float path
// then); then each lane decodes 64-column units from there. Reading in place needs a quarter of
// the shared memory and measured faster (Q4_K).
// IQ4_XS, IQ3_S and IQ2_XXS (unit dots in experts_int_iq.cuh) behind INT_IQ4_XS / INT_IQ3_S /
// INT_IQ2_XXS are always read in place: their rows need not be whole 16-byte pieces (at n_ff 768:
// 408, 330 and 198 bytes), so the staged path could not take them.
#pragma once

// The defaults are the fastest measured (docs/BENCHMARKS.md; kernels/abi.py KernelShape holds the
// same): Q4_K experts take this path, two gate/up rows a warp, rows read in place.
#ifndef INT_GATE_UP
#define INT_GATE_UP 1       // moe_gate_up of the integer types (int_type) takes this path
#endif
#ifndef INT_DOWN
#define INT_DOWN 1          // moe_down of the integer types takes this path
#endif
// The types beyond Q4_K, each behind its own switch (abi.py INT_TYPE_SWITCHES): all on, measured
// faster than their float path on an H100 on 2026-12-06 (1.03x to 1.20x decode; q2_k:
// benchmarks/results/decode-qwen3-30b-a3b-q2_k-2026-12-06-052031-f6081f8.json); 0 puts a type
// back on the float path
#ifndef INT_Q5_K
#define INT_Q5_K 1
#endif
#ifndef INT_Q6_K
#define INT_Q6_K 1
#endif
#ifndef INT_Q3_K
#define INT_Q3_K 1
#endif
#ifndef INT_Q2_K
#define INT_Q2_K 1
#endif
#ifndef INT_IQ4_XS
#define INT_IQ4_XS 1
#endif
#ifndef INT_IQ3_S
#define INT_IQ3_S 1
#endif
#ifndef INT_IQ2_XXS
#define INT_IQ2_XXS 1
#endif
#ifndef INT_FPW
#define INT_FPW 2           // expert rows f (gate and up) each warp takes in turn
#endif
#ifndef INT_DPW
#define INT_DPW 1           // outputs d each warp of moe_down takes in turn
#endif
#ifndef INT_DIRECT
#define INT_DIRECT 1        // Q4_K rows read by each lane from device memory, not staged (below)
#endif
#define INT_WARPS (BLOCK_THREADS / 32)
#define INT_FF_BLOCK (INT_WARPS * INT_FPW)      // f of one moe_gate_up block (kernels/abi.py)
#define INT_DOWN_BLOCK (INT_WARPS * INT_DPW)    // d of one moe_down block

#define XQ_LEVELS 254           // l's step: 1/254 of h's
#define INT_X_MAX 4096          // columns moe_gate_up quantizes (n_embd); larger: float path
#define INT_ACT_MAX 8192        // columns moe_down quantizes (k * n_ff)
#define INT_STAGE_GATE_UP 4608  // bytes a warp stages (a gate and an up row at once)
#define INT_STAGE_DOWN 3072     // bytes a warp stages (down rows of several experts at once)
#define XQ_UNIT_WORDS 20        // 16 words of a 64-column unit + 4 of padding: the lanes' 16-byte
                                // reads of neighbouring units fall in different banks

// The types whose experts take this path (each with its unit dot, int_unit_dot below); a new one
// is a line here, its unit dot, and its row of abi.py INT_TYPE_SWITCHES
HOST_DEVICE constexpr bool int_type(int T) {
    return T == T_Q4_K || (INT_Q5_K && T == T_Q5_K) || (INT_Q6_K && T == T_Q6_K) ||
           (INT_Q3_K && T == T_Q3_K) || (INT_Q2_K && T == T_Q2_K) ||
           (INT_IQ4_XS && T == T_IQ4_XS) || (INT_IQ3_S && T == T_IQ3_S) ||
           (INT_IQ2_XXS && T == T_IQ2_XXS);
}
// the i-quants read in place whatever INT_DIRECT says (header comment)
HOST_DEVICE constexpr bool int_in_place(int T) {
    return T == T_IQ4_XS || T == T_IQ3_S || T == T_IQ2_XXS;
}
HOST_DEVICE constexpr bool int_direct(int T) {
    return (INT_DIRECT || int_in_place(T)) && int_type(T);
}
// the alignment a row (and a blob part) needs for the unit dot's loads in place; the staged path
// copies whole 16-byte pieces and needs 16 whatever the type
HOST_DEVICE constexpr int int_row_align(int T) {
    return T == T_IQ4_XS ? 8
           : T == T_Q6_K || T == T_Q3_K || T == T_IQ3_S || T == T_IQ2_XXS ? 2
           : T == T_Q2_K ? 4 : 16;
}
HOST_DEVICE constexpr int xq_words(int cols) { return cols / 64 * XQ_UNIT_WORDS; }

// x quantized in shared memory: h and l bytes by unit (XQ_UNIT_WORDS words each), and per
// 32-column block s / 254 and the block's float sum (the K-quants' min term)
struct XQ {
    u32* h;
    u32* l;
    float* step;
    float* sum;
};

// Host build of the intrinsic (the host test of tests/test_kernels_compile.py runs the quantizer
// and the unit decoder below against gguf-py)
HOST_DEVICE int dp4a_s8(int a, int b, int c) {
#ifdef __CUDA_ARCH__
    return __dp4a(a, b, c);
#else
    for (int j = 0; j < 4; ++j) c += (int)(signed char)(a >> (8 * j)) * (int)(signed char)(b >> (8 * j));
    return c;
#endif
}

// One 32-column block v[0 .. 32) (each multiplied by w first) as h and l bytes (8 words each),
// its step s / 254 and its float sum. A NaN in the block makes the step NaN, so outputs say so.
HOST_DEVICE void xq_block32(const float* v, float w, u32* h, u32* l, float& step, float& sum) {
    float amax = 0.f, part[4];
    for (int g = 0; g < 4; ++g) {
        float e[8];
        for (int j = 0; j < 8; ++j) {
            e[j] = v[8 * g + j] * w;
            amax = fmaxf(amax, fabsf(e[j]));
        }
        part[g] = sum8(e);
    }
    sum = (part[0] + part[1]) + (part[2] + part[3]);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int q = 0; q < 8; ++q) {
        u32 hw = 0u, lw = 0u;
        for (int j = 0; j < 4; ++j) {
            const float t = v[4 * q + j] * w * inv;
            const float hq = rintf(t);
            const float lq = rintf((t - hq) * (float)XQ_LEVELS);
            hw |= (u32)((int)hq & 0xFF) << (8 * j);
            lw |= (u32)((int)lq & 0xFF) << (8 * j);
        }
        h[q] = hw;
        l[q] = lw;
    }
    step = sum == sum ? amax * (1.f / (127.f * XQ_LEVELS)) : sum;   // sum: NaN
}

// where 32-column block b's 8 words start in the h and l arrays
HOST_DEVICE int xq_block_word(int b) { return (b >> 1) * XQ_UNIT_WORDS + 8 * (b & 1); }

// x[0 .. n) (n a multiple of 64) into q, a 32-column block a thread; with `seg_w`, column c is
// first multiplied by seg_w[c / seg_len] (moe_down folds the rank weights in)
__device__ void quantize_x(const float* __restrict__ x, int n, const float* __restrict__ seg_w,
                           int seg_len, const XQ& q) {
    for (int b = threadIdx.x; b < (n >> 5); b += blockDim.x) {
        float v[32];
        #pragma unroll
        for (int g = 0; g < 4; ++g) load8(x + 32 * (i64)b + 8 * g, v + 8 * g);
        const float w = seg_w != nullptr ? seg_w[32 * b / seg_len] : 1.f;
        const int at = xq_block_word(b);
        xq_block32(v, w, q.h + at, q.l + at, q.step[b], q.sum[b]);
    }
}

// One lane's activations of a 64-column unit v: h and l words, then per 32-column half its step
// and sum
struct XFrag {
    u32 h[16], l[16];
    float step[2], sum[2];
};

HOST_DEVICE void load_xfrag(XFrag& f, const XQ& q, int v) {
    const uint4* hp = reinterpret_cast<const uint4*>(q.h + v * XQ_UNIT_WORDS);
    const uint4* lp = reinterpret_cast<const uint4*>(q.l + v * XQ_UNIT_WORDS);
    #pragma unroll
    for (int g = 0; g < 4; ++g) {
        const uint4 a = hp[g], b = lp[g];
        f.h[4 * g] = a.x; f.h[4 * g + 1] = a.y; f.h[4 * g + 2] = a.z; f.h[4 * g + 3] = a.w;
        f.l[4 * g] = b.x; f.l[4 * g + 1] = b.y; f.l[4 * g + 2] = b.z; f.l[4 * g + 3] = b.w;
    }
    f.step[0] = q.step[2 * v]; f.step[1] = q.step[2 * v + 1];
    f.sum[0] = q.sum[2 * v]; f.sum[1] = q.sum[2 * v + 1];
}

// sum of 32 products q * (254 h + l), exact: the 8 words of q (4 int8 each) against half `half`
// of the fragment
HOST_DEVICE int dot32(const u32 (&q)[8], const XFrag& f, int half) {
    int a = 0, b = 0;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        a = dp4a_s8((int)q[i], (int)f.h[8 * half + i], a);
        b = dp4a_s8((int)q[i], (int)f.l[8 * half + i], b);
    }
    return a * XQ_LEVELS + b;
}

// The K-quant tail shared by Q4_K and Q5_K: pair p of a super-block (sub-blocks 2p and 2p + 1,
// their 32 stored integers each in lo and hi) against the unit's activations, scaled by d * scale
// and less dmin * min times the activations' float sum
HOST_DEVICE float k_pair_dot(const uint4& head, int p, const u32 (&lo)[8], const u32 (&hi)[8],
                             const XFrag& f) {
    int s0, m0, s1, m1;
    k_scale_min(head.y, head.z, head.w, 2 * p, s0, m0);
    k_scale_min(head.y, head.z, head.w, 2 * p + 1, s1, m1);
    const float d = h2f((u16)(head.x & 0xFFFF)), dmin = h2f((u16)(head.x >> 16));
    float r = (d * (float)s0) * ((float)dot32(lo, f, 0) * f.step[0]);
    r = fmaf(-(dmin * (float)m0), f.sum[0], r);
    r = fmaf(d * (float)s1, (float)dot32(hi, f, 1) * f.step[1], r);
    return fmaf(-(dmin * (float)m1), f.sum[1], r);
}

// Unit u (columns 64u .. 64u + 63) of a Q4_K row: pair u % 4 of super-block u / 4, its low
// nibbles sub-block 2p and its high nibbles sub-block 2p + 1, with the super-block's head.
HOST_DEVICE void q4_k_unit(const u8* __restrict__ row, int u, uint4& head, u32 (&lo)[8],
                           u32 (&hi)[8]) {
    const int sb = u >> 2, p = u & 3;
    const u8* blk = row + sb * 144;
    head = *reinterpret_cast<const uint4*>(blk);
    const uint4 a = reinterpret_cast<const uint4*>(blk + 16 + 32 * p)[0];
    const uint4 b = reinterpret_cast<const uint4*>(blk + 16 + 32 * p)[1];
    const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
        lo[j] = w[j] & 0x0F0F0F0Fu;
        hi[j] = (w[j] >> 4) & 0x0F0F0F0Fu;
    }
}

// Unit u of a Q4_K row against its activations
HOST_DEVICE float q4_k_unit_dot(const u8* __restrict__ row, int u, const XFrag& f) {
    uint4 head;
    u32 lo[8], hi[8];
    q4_k_unit(row, u, head, lo, hi);
    return k_pair_dot(head, u & 3, lo, hi, f);
}

#include "experts_int_iq.cuh"   // iq4_xs_unit_dot, iq3_s_unit_dot, iq2_xxs_unit_dot
#include "experts_int_k.cuh"    // q5_k_unit_dot, q6_k_unit_dot, q3_k_unit_dot, q2_k_unit_dot

// One unit's dot for type T. Instantiated for every type by the kernels' macro, called only
// where int_type(T): a type switched on there without a unit dot here fails to build.
template <int T>
HOST_DEVICE float int_unit_dot(const u8* __restrict__ row, int u, const XFrag& f) {
    static_assert(!int_type(T) || T == T_Q4_K || T == T_Q5_K || T == T_Q6_K || T == T_Q3_K ||
                  T == T_Q2_K || T == T_IQ4_XS || T == T_IQ3_S || T == T_IQ2_XXS,
                  "an integer-path type (int_type) without a unit dot");
    if constexpr (T == T_Q4_K) return q4_k_unit_dot(row, u, f);
    else if constexpr (T == T_Q5_K) return q5_k_unit_dot(row, u, f);
    else if constexpr (T == T_Q6_K) return q6_k_unit_dot(row, u, f);
    else if constexpr (T == T_Q3_K) return q3_k_unit_dot(row, u, f);
    else if constexpr (T == T_Q2_K) return q2_k_unit_dot(row, u, f);
    else if constexpr (T == T_IQ4_XS) return iq4_xs_unit_dot(row, u, f);
    else if constexpr (T == T_IQ3_S) return iq3_s_unit_dot(row, u, f);
    else if constexpr (T == T_IQ2_XXS) return iq2_xxs_unit_dot(row, u, f);
    else {                      // never called (int_type(T) is false): a NaN if it ever were
#ifdef __CUDA_ARCH__
        return NAN_F32;
#else
        union { u32 u; float f; } bits;
        bits.u = 0x7fc00000u;
        return bits.f;
#endif
    }
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// a warp copies `bytes` (a multiple of 16) from src to its stage at dst
__device__ __forceinline__ void stage_row(u8* dst, const u8* src, i64 bytes, int lane) {
    for (int c = lane; c < (int)(bytes >> 4); c += 32) cp_async16(dst + 16 * c, src + 16 * c);
}

// whether the addresses and sizes OR-ed in `bits` suit type T's rows on this path
template <int T>
__device__ __forceinline__ bool int_aligned(u64 bits) {
    return (bits & (u64)((int_direct(T) ? int_row_align(T) : 16) - 1)) == 0;
}

// Whether a block of moe_gate_up can take the integer path (uniform in the block)
template <int T>
__device__ __forceinline__ bool gate_up_int_ok(const ExpertSpec& sp, const u8* blob) {
    return blob != nullptr && int_aligned<T>((u64)blob | (u64)sp.up_at | (u64)sp.gate_row_bytes |
                                             (u64)sp.up_row_bytes) &&
           sp.n_embd % 64 == 0 && sp.n_embd <= INT_X_MAX &&
           (int_direct(T) || sp.gate_row_bytes + sp.up_row_bytes <= INT_STAGE_GATE_UP);
}

// act[i, r, f] = silu(gate_e[f] . x_i) * (up_e[f] . x_i) for the INT_FF_BLOCK f of this block:
// warp w takes f0 + w, f0 + w + INT_WARPS, ...; each lane the units lane, lane + 32, ... of both
// rows, then the warp's xor tree sums.
template <int T>
__device__ __forceinline__ void moe_gate_up_int(const ExpertSpec& sp, const float* __restrict__ x,
                                                const u8* __restrict__ blob,
                                                float* __restrict__ out) {
    __shared__ __align__(16) u32 xh[xq_words(INT_X_MAX)], xl[xq_words(INT_X_MAX)];
    __shared__ float xstep[INT_X_MAX / 32], xsum[INT_X_MAX / 32];
    constexpr bool direct = int_direct(T);
    __shared__ __align__(16) u8 stage[INT_WARPS][direct ? 16 : INT_STAGE_GATE_UP];
    const XQ q{xh, xl, xstep, xsum};
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int f_first = blockIdx.x * INT_FF_BLOCK + warp;
    const i64 g_bytes = sp.gate_row_bytes, u_bytes = sp.up_row_bytes;
    u8* st = stage[warp];
    auto stage_f = [&](int f) {
        stage_row(st, blob + (i64)f * g_bytes, g_bytes, lane);
        stage_row(st + g_bytes, blob + sp.up_at + (i64)f * u_bytes, u_bytes, lane);
    };
    if (!direct && f_first < sp.n_ff) stage_f(f_first);   // in flight while the block quantizes
    quantize_x(x, sp.n_embd, nullptr, 1, q);
    __syncthreads();
    const int units = sp.n_embd >> 6;
    for (int f = f_first; f < min(sp.n_ff, (int)(blockIdx.x + 1) * INT_FF_BLOCK); f += INT_WARPS) {
        const u8* g_row = direct ? blob + (i64)f * g_bytes : st;
        const u8* u_row = direct ? blob + sp.up_at + (i64)f * u_bytes : st + g_bytes;
        if (!direct) {
            if (f != f_first) stage_f(f);
            cp_async_wait_all();
            __syncwarp();
        }
        float g = 0.f, up = 0.f;
        for (int u = lane; u < units; u += 32) {
            XFrag xf;
            load_xfrag(xf, q, u);
            g += int_unit_dot<T>(g_row, u, xf);
            up += int_unit_dot<T>(u_row, u, xf);
        }
        g = warp_sum(g);
        up = warp_sum(up);
        if (lane == 0) out[f] = g / (1.f + __expf(-g)) * up;
        __syncwarp();                               // every lane read the stage before the next f
    }
}

// Whether a block of moe_down for row i can take the integer path (uniform in the block)
template <int T>
__device__ __forceinline__ bool down_int_ok(const ExpertSpec& sp, const u64* __restrict__ blobs,
                                            int i) {
    u64 bits = (u64)sp.down_at | (u64)sp.down_row_bytes;
    bool all = true;
    for (int r = 0; r < sp.k; ++r) {
        const u64 b = blobs[i * sp.k + r];
        all = all && b != 0ull;
        bits |= b;
    }
    return all && int_aligned<T>(bits) && sp.n_ff % 64 == 0 && sp.k * sp.n_ff <= INT_ACT_MAX &&
           (int_direct(T) || sp.down_row_bytes <= INT_STAGE_DOWN);
}

// h[i, d] += sum over r of down_e[d] . (wts[i, r] * act[i, r]), e = ids[i, r], for the
// INT_DOWN_BLOCK d of this block: warp w takes d0 + w, d0 + w + INT_WARPS, ...; for each it stages
// the k experts' rows d a few at a time (as many as its stage holds), the lanes taking the (row,
// unit) pairs of a group in turn, rows in rank order; then the warp's xor tree sums.
template <int T>
__device__ __forceinline__ void moe_down_int(const ExpertSpec& sp, const float* __restrict__ act,
                                             const u64* __restrict__ blobs,
                                             const float* __restrict__ wts,
                                             float* __restrict__ h) {
    __shared__ __align__(16) u32 xh[xq_words(INT_ACT_MAX)], xl[xq_words(INT_ACT_MAX)];
    __shared__ float xstep[INT_ACT_MAX / 32], xsum[INT_ACT_MAX / 32];
    constexpr bool direct = int_direct(T);
    __shared__ __align__(16) u8 stage[INT_WARPS][direct ? 16 : INT_STAGE_DOWN];
    const XQ q{xh, xl, xstep, xsum};
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, i = blockIdx.y;
    const int k = sp.k, units = sp.n_ff >> 6;
    const i64 rb = sp.down_row_bytes;
    const int group = direct ? k : (int)(INT_STAGE_DOWN / rb);   // rows staged at once (>= 1)
    const u64* b = blobs + i * k;
    const int d_first = blockIdx.x * INT_DOWN_BLOCK + warp;
    u8* st = stage[warp];
    auto stage_group = [&](int d, int r0) {
        for (int r = r0; r < min(k, r0 + group); ++r)
            stage_row(st + (r - r0) * rb, reinterpret_cast<const u8*>(b[r]) + sp.down_at + d * rb,
                      rb, lane);
    };
    if (!direct && d_first < sp.n_embd) stage_group(d_first, 0);   // in flight while quantizing
    quantize_x(act + (i64)i * k * sp.n_ff, k * sp.n_ff, wts + i * k, sp.n_ff, q);
    __syncthreads();
    for (int d = d_first; d < min(sp.n_embd, (int)(blockIdx.x + 1) * INT_DOWN_BLOCK); d += INT_WARPS) {
        float acc = 0.f;
        for (int r0 = 0; r0 < k; r0 += group) {
            if (!direct) {
                if (d != d_first || r0 != 0) stage_group(d, r0);
                cp_async_wait_all();
                __syncwarp();
            }
            const int pairs = (min(k, r0 + group) - r0) * units;
            for (int t = lane; t < pairs; t += 32) {
                const int rr = t / units, u = t - rr * units;
                XFrag xf;
                load_xfrag(xf, q, (r0 + rr) * units + u);
                const u8* row = direct ? reinterpret_cast<const u8*>(b[r0 + rr]) + sp.down_at +
                                         d * rb
                                       : st + rr * rb;
                acc += int_unit_dot<T>(row, u, xf);
            }
            if (!direct) __syncwarp();              // every lane read the stage before the next
        }
        acc = warp_sum(acc);
        if (lane == 0) h[(i64)i * sp.n_embd + d] += acc;
    }
}
