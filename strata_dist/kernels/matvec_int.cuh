// The integer path of the dense decode matvecs (included by decode.cu after experts.cuh, whose
// experts_int.cuh holds the pieces reused here: XQ / xq_block32 / load_xfrag / int_unit_dot<T>).
//
// Why: the float path (weights.cuh block_dots) decodes every weight to a float before its FMA;
// the expert kernels measured issue-bound on that path (docs/BENCHMARKS.md "The integer expert
// path") and llama.cpp's dense matvecs (mmvq) take int8 __dp4a. Here the block quantizes its N
// activation rows into shared memory exactly as the expert kernels do (x = s (254 h + l) per
// 32-column block, the fused RMSNorm's x * inv * norm_w folded in before quantizing) and each
// type's unit dot meets them with __dp4a.
//
// Behind INT_MATVEC (kernels/abi.py KernelShape int_matvec), default 0: written and checked on the
// host on 2026-12-06; no GPU has run or measured it yet.
// Types: those with a unit dot (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS, IQ3_S, IQ2_XXS), whatever
// the experts' int_q* / int_iq* switches say (those pick the expert kernels' path only). F32,
// F16, BF16 and Q8_0 keep the float path (no unit dot: a float or 34-byte block is not read as
// packed integers), and so does every other quantized type.
// A matrix whose ncols is not a multiple of 64, or whose address / row_bytes the unit dot cannot
// read in place (experts_int.cuh int_row_align), keeps the float path too (matvec_int_ok: uniform,
// one spec a block).
#pragma once

#ifndef INT_MATVEC
#define INT_MATVEC 0        // the dense matvecs of the unit-dot types take this path
#endif

// Columns of one row quantized into shared memory at once (a tile); wider rows loop over tiles.
// 8192 columns over the N rows (22.5 KB), but never under 2048 a row: a tile is then a whole
// number of 32-unit rounds, so lane l always takes the units u with u % 32 == l and a row's sum
// runs in one order whatever N is (batch invariance, as the float path). N = 8 thus holds 8 x 2048
// columns (45 KB of the 48 KB a block may hold statically).
HOST_DEVICE constexpr int matvec_int_tile(int n) { return 8192 / n > 2048 ? 8192 / n : 2048; }

HOST_DEVICE constexpr bool matvec_int_type(int T) {
    return INT_MATVEC && (T == T_Q4_K || T == T_Q5_K || T == T_Q6_K || T == T_Q3_K ||
                          T == T_Q2_K || T == T_IQ4_XS || T == T_IQ3_S || T == T_IQ2_XXS);
}

// Whether rows at the address and row size OR-ed in `bits`, of `ncols` columns, can be read in
// place by type T's unit dot (uniform in the block: one spec a block)
template <int T>
HOST_DEVICE bool matvec_int_ok_bits(u64 bits, int ncols) {
    return ncols % 64 == 0 && (bits & (u64)(int_row_align(T) - 1)) == 0;
}
template <int T>
__device__ __forceinline__ bool matvec_int_ok(const u8* w, i64 row_bytes, int ncols) {
    return matvec_int_ok_bits<T>((u64)w | (u64)row_bytes, ncols);
}

// One 32-column block v (as loaded) of an activation row into its h and l words, step and sum:
// times inv * norm_w[0 .. 32) first when norm_w is given (the fused RMSNorm, in write_normed's
// order). The host test (tests/test_matvec_int_host.py) runs it against gguf-py too.
HOST_DEVICE void matvec_xq_block32(float (&v)[32], const float* norm_w, float inv, u32* h, u32* l,
                                   float& step, float& sum) {
    if (norm_w != nullptr) {
        #pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = v[j] * inv * norm_w[j];
    }
    xq_block32(v, 1.f, h, l, step, sum);
}

// The N rows' quantized tile. One variable per N, not per matvec_int_dots instantiation: the N = 1
// kernels instantiate it for two R (wide or not), which would otherwise hold two copies.
template <int N>
struct MatvecXQ {
    static constexpr int TILE = matvec_int_tile(N), WORDS = xq_words(TILE), BLOCKS = TILE / 32;
    u32 h[N * WORDS], l[N * WORDS];
    float step[N * BLOCKS], sum[N * BLOCKS];
};
template <int N>
__device__ __forceinline__ MatvecXQ<N>& matvec_xq_tile() {
    __shared__ __align__(16) MatvecXQ<N> tile;
    return tile;
}

// sums[r * N + i] = W[r] . xq_i for the R rows of `rows`, xq_i row i of x quantized (times
// inv[i] * norm_w when norm_w is given; inv[i] = 1 / rms(x_i) is then computed into `inv` first).
// Warp w takes rows w, w + warps, ...; its lane l the units l, l + 32, ...; the warp's xor tree
// sums. Ends with a barrier: sums and inv are read by the caller.
template <int T, int N, int R>
__device__ __forceinline__ void matvec_int_dots(const u8* const (&rows)[R], int ncols,
                                                const float* __restrict__ x, int x_stride,
                                                const float* __restrict__ norm_w, float eps,
                                                float* inv, float* sums) {
    using Tile = MatvecXQ<N>;
    constexpr int TILE = Tile::TILE, WORDS = Tile::WORDS, BLOCKS = Tile::BLOCKS;
    constexpr int WARPS_MV = MATVEC_THREADS / 32;
    static_assert(TILE % 2048 == 0, "a tile is whole 32-unit rounds (batch invariance)");
    Tile& tile = matvec_xq_tile<N>();
    u32* xh = tile.h;
    u32* xl = tile.l;
    float* xstep = tile.step;
    float* xsum = tile.sum;
    __shared__ float part[WARPS_MV][N];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (norm_w != nullptr) {
        // the norm scales the activations before they are quantized, so it comes first here
        float ss[N];
        #pragma unroll
        for (int i = 0; i < N; ++i) ss[i] = 0.f;
        for (int c = threadIdx.x; c < (ncols >> 3); c += blockDim.x) {
            #pragma unroll
            for (int i = 0; i < N; ++i) {
                float v[8];
                load8(x + (i64)i * x_stride + 8 * c, v);
                #pragma unroll
                for (int j = 0; j < 8; ++j) ss[i] = fmaf(v[j], v[j], ss[i]);
            }
        }
        #pragma unroll
        for (int i = 0; i < N; ++i) {
            const float t = warp_sum(ss[i]);
            if (lane == 0) part[warp][i] = t;
        }
        __syncthreads();
        if (threadIdx.x < N) {
            float t = 0.f;
            #pragma unroll
            for (int w = 0; w < WARPS_MV; ++w) t += part[w][threadIdx.x];
            inv[threadIdx.x] = rsqrtf(t / (float)ncols + eps);
        }
        __syncthreads();
    }
    float acc[R * N];
    #pragma unroll
    for (int k = 0; k < R * N; ++k) acc[k] = 0.f;
    for (int c0 = 0; c0 < ncols; c0 += TILE) {
        const int nb = min(TILE, ncols - c0) >> 5;          // 32-column blocks of this tile
        if (c0 > 0) __syncthreads();                        // every warp is done with the last tile
        for (int t = threadIdx.x; t < N * nb; t += blockDim.x) {
            const int i = t / nb, b = t - i * nb, c = c0 + 32 * b;
            float v[32];
            #pragma unroll
            for (int g = 0; g < 4; ++g) load8(x + (i64)i * x_stride + c + 8 * g, v + 8 * g);
            const int at = i * WORDS + xq_block_word(b);
            matvec_xq_block32(v, norm_w != nullptr ? norm_w + c : nullptr,
                              norm_w != nullptr ? inv[i] : 1.f, xh + at, xl + at,
                              xstep[i * BLOCKS + b], xsum[i * BLOCKS + b]);
        }
        __syncthreads();
        const int units = nb >> 1, u0 = c0 >> 6;
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r % WARPS_MV != warp) continue;             // warp-uniform
            for (int u = lane; u < units; u += 32) {
                #pragma unroll
                for (int i = 0; i < N; ++i) {
                    const XQ q{xh + i * WORDS, xl + i * WORDS, xstep + i * BLOCKS,
                               xsum + i * BLOCKS};
                    XFrag f;
                    load_xfrag(f, q, u);
                    acc[r * N + i] += int_unit_dot<T>(rows[r], u0 + u, f);
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r % WARPS_MV != warp) continue;
        #pragma unroll
        for (int i = 0; i < N; ++i) {
            const float t = warp_sum(acc[r * N + i]);
            if (lane == 0) sums[r * N + i] = t;
        }
    }
    __syncthreads();
}
