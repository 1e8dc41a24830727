// The dense matvec on tensor cores (KernelShape matvec_mma): y = W . x for up to MAX_ROWS
// activation rows, W as the A operand of mma.m16n8k16 (a block takes 16 weight rows), the
// activation rows as B (one column each; a step of fewer rows leaves columns at zero). f16 rows go
// in as stored; a quantized row's stored integers go in exactly as f16 values and the scale of
// each 32 columns (16 for Q6_K, Q2_K, Q3_K: two sums a step) is applied to the step's sums after
// the mma, its min times the activations' sum over those columns (the factored form of
// weights.cuh chunk8_q: w = a q + b). Types whose stored values are not small integers with one
// scale per 16 or 32 columns (F32, BF16, the i-quants but IQ4_NL / IQ4_XS) keep the plain matvec.
//
// Why: the plain matvec's block reads all N activation rows for the matvec_accs / N weight rows
// it takes (decode.cu rows_per_block), so a 16-row step's matvecs cost several times one row's,
// though the weights are read once per replay (docs/BENCHMARKS.md, "Serving many streams"). Here
// a lane reads 16 bytes of two weight rows and 32 bytes of one activation row per 32 columns, and
// one mma serves all 8 activation rows. Measured: the shortest 16-row step, but a slower one-row
// decode (BENCHMARKS: fewer threads in flight at one row), hence off by default and mma_threads.
//
// Precision: an activation is split into two f16 parts, x = hi + lo (lo = the f16 of x - hi), and
// each part goes through its own mma into one f32 accumulator, so the products carry ~22 bits of x
// (a float32's 24) for |x| >= 2^-3 or so, and an absolute error near 2^-25 below (lo is then an f16
// subnormal). Known limit: |x| >= 65,520 (past f16's range) makes hi infinite and the row's
// outputs NaN, where the plain matvec stays finite; with the fused norm the split takes the raw
// residual times norm_w (1 / rms is applied to the sums), so an outlier of a real model's residual
// stream could reach it. Not to be made the default before that is handled.
//
// Batch invariance: every output is summed in one order whatever the step's rows: a tensor-core
// column's sums do not read the other columns, each warp takes the same columns of the row, and
// the warps' partials are added in warp order. One row takes this kernel too (its other columns
// zero), so a row's bits are the same alone and among others. They are not the plain matvec's
// bits (another order), which is why the build decides (matvec_mma), never the row count.
//
// Columns: lane (g, t) of the PTX fragment layout (mma.cuh) holds k = 2t, 2t + 1, 2t + 8, 2t + 9
// of a 16-wide step. Any assignment of stored columns to k sums the same products as long as A
// and B use the same one, so lane t's four k of two consecutive steps are the 8 stored columns
// 32s + 8t .. 32s + 8t + 7: one 16-byte load of each of its two weight rows (g and g + 8) and two
// 16-byte loads of activation row g.
#pragma once
#include "mma.cuh"

#define MMA_ROWS 16    // weight rows of a block: one m16 tile (kernels/abi.py MMA_ROWS)

// Columns sharing one scale per row, for the types on this path (kernels/abi.py MMA_SCALE_COLS);
// 0: the type keeps the plain matvec
HOST_DEVICE constexpr int mma_scale_cols(int T) {
    return (T == T_F16 || T == T_Q8_0 || T == T_Q4_K || T == T_Q5_K || T == T_Q4_0 ||
            T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1 || T == T_IQ4_NL || T == T_IQ4_XS) ? 32
         : (T == T_Q6_K || T == T_Q2_K || T == T_Q3_K) ? 16 : 0;
}
static_assert(MMA_THREADS == BLOCK_THREADS || MMA_THREADS == 2 * BLOCK_THREADS,
              "a tensor-core matvec block is BLOCK_THREADS or twice as many threads");
// 32-column steps a warp loads before it multiplies (loads in flight; a quantized step holds its
// scales beside the values)
HOST_DEVICE constexpr int mma_unroll(int T) { return T == T_F16 ? 8 : 4; }

// x split into its f16 part and the f16 of what that part misses, as fragment pairs
__device__ __forceinline__ void split_half2(float a, float b, unsigned& hi, unsigned& lo) {
    const __half2 h = __floats2half2_rn(a, b);
    const float2 back = __half22float2(h);
    hi = *reinterpret_cast<const unsigned*>(&h);
    lo = pack_half2(a - back.x, b - back.y);
}

// One weight row's 8 columns of a step as four f16 pairs, and (quantized) their scale and min
struct MmaChunk {
    uint4 h;
    float a, b;
};

template <int T>
__device__ __forceinline__ MmaChunk mma_chunk(const u8* __restrict__ row, int c, bool in) {
    MmaChunk k{make_uint4(0, 0, 0, 0), 0.f, 0.f};
    if (!in) return k;
    if constexpr (T == T_F16) {
        k.h = __ldg(reinterpret_cast<const uint4*>(row) + c);
    } else {
        float q[8];
        chunk8_q<T>(row, c, q, k.a, k.b);      // small integers: exact as f16
        k.h = make_uint4(pack_half2(q[0], q[1]), pack_half2(q[2], q[3]), pack_half2(q[4], q[5]),
                         pack_half2(q[6], q[7]));
    }
    return k;
}

// the four mma of one step (two 16-wide halves, each with x's two parts) into acc; `keep`: whether
// this lane's columns count (the 16-column types sum each half of the lanes apart)
__device__ __forceinline__ void mma_step(float (&acc)[4], const MmaChunk& lo_row,
                                         const MmaChunk& hi_row, const unsigned (&hi)[4],
                                         const unsigned (&lo)[4], bool keep) {
    const unsigned first[4] = {keep ? lo_row.h.x : 0u, keep ? hi_row.h.x : 0u,
                               keep ? lo_row.h.y : 0u, keep ? hi_row.h.y : 0u};
    const unsigned second[4] = {keep ? lo_row.h.z : 0u, keep ? hi_row.h.z : 0u,
                                keep ? lo_row.h.w : 0u, keep ? hi_row.h.w : 0u};
    mma_16816(acc, first, hi[0], hi[1]);
    mma_16816(acc, first, lo[0], lo[1]);
    mma_16816(acc, second, hi[2], hi[3]);
    mma_16816(acc, second, lo[2], lo[3]);
}

// c += the step's sums of one scale group scaled: a of weight rows g / g + 8 times the sums, then
// b times the activations' sum over the group's columns (activation rows 2t, 2t + 1)
__device__ __forceinline__ void mma_scale_add(float (&c)[4], const float (&sums)[4], float a_lo,
                                              float a_hi, float b_lo, float b_hi, float xs0,
                                              float xs1, bool min) {
    c[0] = fmaf(a_lo, sums[0], c[0]);
    c[1] = fmaf(a_lo, sums[1], c[1]);
    c[2] = fmaf(a_hi, sums[2], c[2]);
    c[3] = fmaf(a_hi, sums[3], c[3]);
    if (min) {
        c[0] = fmaf(b_lo, xs0, c[0]);
        c[1] = fmaf(b_lo, xs1, c[1]);
        c[2] = fmaf(b_hi, xs0, c[2]);
        c[3] = fmaf(b_hi, xs1, c[3]);
    }
}

// y[i, o] = add[i, o] + sum_c W[o, c] * xn[i, c] (xn as in decode.cu matvec_rows) for the n
// rows of x, block blockIdx.x taking weight rows 16 * blockIdx.x .. + 15 of spec blockIdx.y
template <int T, bool NORM>
__device__ __forceinline__ void matvec_mma_rows(const MatSpec* __restrict__ specs,
                                                const float* __restrict__ x, int x_stride, int n,
                                                const float* __restrict__ norm_w, float eps,
                                                float* __restrict__ normed) {
    constexpr int W = MMA_THREADS / 32, U = mma_unroll(T), G = mma_scale_cols(T);
    constexpr bool MIN = T != T_F16 && has_min(T);
    static_assert(G == 32 || G == 16, "a tensor-core matvec type has 16 or 32 columns a scale");
    __shared__ float part[W][MMA_ROWS][MAX_ROWS];
    __shared__ float sumsq[W][MAX_ROWS];
    __shared__ float inv[MAX_ROWS];
    const MatSpec s = specs[blockIdx.y];
    const int o0 = blockIdx.x * MMA_ROWS;
    if (o0 >= s.nrows) return;                          // the whole block: uniform
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const u8* w_lo = s.w + (i64)min(o0 + g, s.nrows - 1) * s.row_bytes;
    const u8* w_hi = s.w + (i64)min(o0 + g + 8, s.nrows - 1) * s.row_bytes;
    const bool has_x = g < n;                           // column g of B: activation row g
    const float* xg = x + (i64)(has_x ? g : 0) * x_stride;
    const int steps = (s.ncols + 31) >> 5;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    float sq = 0.f;
    for (int s0 = warp; s0 < steps; s0 += W * U) {
        MmaChunk rows[U][2];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int chunk = 4 * (s0 + u * W) + t;
            const bool in = s0 + u * W < steps && 8 * chunk < s.ncols;  // ncols: whole chunks of 8
            rows[u][0] = mma_chunk<T>(w_lo, chunk, in);
            rows[u][1] = mma_chunk<T>(w_hi, chunk, in);
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int col = (s0 + u * W) * 32 + 8 * t;
            if (s0 + u * W >= steps) break;             // warp-uniform
            float xv[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (has_x && col < s.ncols) load8(xg + col, xv);
            if (NORM) {
                #pragma unroll
                for (int j = 0; j < 8; ++j) sq = fmaf(xv[j], xv[j], sq);
                if (col < s.ncols) {
                    float nw[8];
                    load8(norm_w + col, nw);
                    #pragma unroll
                    for (int j = 0; j < 8; ++j) xv[j] *= nw[j];
                }
            }
            unsigned hi[4], lo[4];
            #pragma unroll
            for (int j = 0; j < 4; ++j) split_half2(xv[2 * j], xv[2 * j + 1], hi[j], lo[j]);
            const MmaChunk& r0 = rows[u][0];
            const MmaChunk& r1 = rows[u][1];
            if constexpr (T == T_F16) {
                mma_step(c, r0, r1, hi, lo, true);
            } else {
                // the activations' sum over each scale group, for activation rows 2t and 2t + 1
                float xs[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
                if (MIN) {
                    float p = 0.f;
                    #pragma unroll
                    for (int j = 0; j < 8; ++j) p += xv[j];
                    p += __shfl_xor_sync(0xffffffffu, p, 1);
                    if (G == 32) p += __shfl_xor_sync(0xffffffffu, p, 2);
                    #pragma unroll
                    for (int k = 0; k < 32 / G; ++k) {   // from lane (row 2t + e, group k's first)
                        xs[k][0] = __shfl_sync(0xffffffffu, p, 8 * t + 2 * k);
                        xs[k][1] = __shfl_sync(0xffffffffu, p, 8 * t + 4 + 2 * k);
                    }
                }
                if constexpr (G == 32) {
                    float sums[4] = {0.f, 0.f, 0.f, 0.f};
                    mma_step(sums, r0, r1, hi, lo, true);
                    mma_scale_add(c, sums, r0.a, r1.a, r0.b, r1.b, xs[0][0], xs[0][1], MIN);
                } else {
                    // lanes t < 2 hold group 0's scales, t >= 2 group 1's: each lane takes the
                    // other group's from lane t ^ 2 of its row
                    const float oa0 = __shfl_xor_sync(0xffffffffu, r0.a, 2);
                    const float oa1 = __shfl_xor_sync(0xffffffffu, r1.a, 2);
                    const float ob0 = __shfl_xor_sync(0xffffffffu, r0.b, 2);
                    const float ob1 = __shfl_xor_sync(0xffffffffu, r1.b, 2);
                    const bool first = t < 2;
                    #pragma unroll
                    for (int k = 0; k < 2; ++k) {
                        const bool own = first == (k == 0);
                        float sums[4] = {0.f, 0.f, 0.f, 0.f};
                        mma_step(sums, r0, r1, hi, lo, own);
                        mma_scale_add(c, sums, own ? r0.a : oa0, own ? r1.a : oa1,
                                      own ? r0.b : ob0, own ? r1.b : ob1, xs[k][0], xs[k][1], MIN);
                    }
                }
            }
        }
    }
    // C fragment: c[0..1] = (weight row g, activation rows 2t, 2t + 1), c[2..3] = (row g + 8, ..)
    part[warp][g][2 * t] = c[0];
    part[warp][g][2 * t + 1] = c[1];
    part[warp][g + 8][2 * t] = c[2];
    part[warp][g + 8][2 * t + 1] = c[3];
    if (NORM) {             // row g's squares: the warp's four lanes t, then the warps in order
        sq += __shfl_xor_sync(0xffffffffu, sq, 1);
        sq += __shfl_xor_sync(0xffffffffu, sq, 2);
        if (t == 0) sumsq[warp][g] = sq;
    }
    __syncthreads();
    if (NORM) {
        if (threadIdx.x < MAX_ROWS) {
            float total = 0.f;
            for (int w = 0; w < W; ++w) total += sumsq[w][threadIdx.x];
            inv[threadIdx.x] = rsqrtf(total / (float)s.ncols + eps);
        }
        __syncthreads();
        if (normed != nullptr && blockIdx.x == 0 && blockIdx.y == 0)
            write_normed(normed, x, x_stride, n, s.ncols, inv, norm_w);
    }
    if (threadIdx.x < MMA_ROWS * MAX_ROWS) {
        const int r = threadIdx.x / MAX_ROWS, i = threadIdx.x - r * MAX_ROWS;
        if (i < n && o0 + r < s.nrows) {
            float v = 0.f;
            for (int w = 0; w < W; ++w) v += part[w][r][i];
            if (NORM) v *= inv[i];
            store_output(s, i, o0 + r, v);
        }
    }
}
