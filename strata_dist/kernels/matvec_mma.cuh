// The f16 dense matvec on tensor cores (KernelShape matvec_mma): y = W . x for up to MAX_ROWS
// activation rows, W in f16 as the A operand of mma.m16n8k16 (a block takes 16 weight rows), the
// activation rows as B (one column each; a step of fewer rows leaves columns at zero).
//
// Why: at 8 rows the plain matvec's block re-reads all 8 activation rows for each weight row it
// takes (decode.cu rows_per_block), so a 16-row step's f16 matvecs took 7.5x one row's, though the
// weights are read once per replay (docs/BENCHMARKS.md, "Serving many streams"). Here a lane reads
// 16 bytes of two weight rows and 32 bytes of one activation row per 32 columns, and one mma
// serves all 8 activation rows.
//
// Precision: an activation is split into two f16 parts, x = hi + lo (lo = the f16 of x - hi), and
// each part goes through its own mma into one f32 accumulator, so the products carry ~22 bits of x
// (a float32's 24), not f16's 11.
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
#define MMA_UNROLL 8   // 32-column steps a warp loads before it multiplies (loads in flight)

// x split into its f16 part and the f16 of what that part misses, as fragment pairs
__device__ __forceinline__ void split_half2(float a, float b, unsigned& hi, unsigned& lo) {
    const __half2 h = __floats2half2_rn(a, b);
    const float2 back = __half22float2(h);
    hi = *reinterpret_cast<const unsigned*>(&h);
    lo = pack_half2(a - back.x, b - back.y);
}

// y[i, o] = add[i, o] + sum_c W[o, c] * xn[i, c] (xn as in decode.cu matvec_rows) for the n
// rows of x, block blockIdx.x taking weight rows 16 * blockIdx.x .. + 15 of spec blockIdx.y
template <bool NORM>
__device__ __forceinline__ void matvec_mma_rows(const MatSpec* __restrict__ specs,
                                                const float* __restrict__ x, int x_stride, int n,
                                                const float* __restrict__ norm_w, float eps,
                                                float* __restrict__ normed) {
    constexpr int W = MATVEC_THREADS / 32;
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
    for (int s0 = warp; s0 < steps; s0 += W * MMA_UNROLL) {
        uint4 a[MMA_UNROLL][2];
        #pragma unroll
        for (int u = 0; u < MMA_UNROLL; ++u) {
            const int col = (s0 + u * W) * 32 + 8 * t;
            const bool in = s0 + u * W < steps && col < s.ncols;   // ncols: whole chunks of 8
            a[u][0] = in ? __ldg(reinterpret_cast<const uint4*>(w_lo + 2 * (i64)col)) : make_uint4(0, 0, 0, 0);
            a[u][1] = in ? __ldg(reinterpret_cast<const uint4*>(w_hi + 2 * (i64)col)) : make_uint4(0, 0, 0, 0);
        }
        #pragma unroll
        for (int u = 0; u < MMA_UNROLL; ++u) {
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
            const unsigned first[4] = {a[u][0].x, a[u][1].x, a[u][0].y, a[u][1].y};
            const unsigned second[4] = {a[u][0].z, a[u][1].z, a[u][0].w, a[u][1].w};
            mma_16816(c, first, hi[0], hi[1]);
            mma_16816(c, first, lo[0], lo[1]);
            mma_16816(c, second, hi[2], hi[3]);
            mma_16816(c, second, lo[2], lo[3]);
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
            const i64 at = (i64)i * s.y_stride + o0 + r;
            s.y[at] = (s.add != nullptr ? s.add[at] : 0.f) + v;
        }
    }
}
