// strata-dist prompt operations: a prompt chunk's row-wise steps that the array path runs as
// several array operations each (several launches, a pass over memory each), as one launch:
//
//   rms_norm_rows   y = x / sqrt(mean(x^2) + eps) * w over each row (backends/array_ops.py
//                   rms_norm's arithmetic; only the order of the sum of squares differs)
//   combine_ranked  out = sum over r of wts[i, r] * y[i, r] in rank order r = 0, 1, .., each
//                   product and sum rounded on its own: the bits of array_ops.moe_combine's
//                   loop of `out += wts[:, r] * y[:, r]`
//
// The chunk's q/k RMSNorm, RoPE and K/V write take decode.cu's qk_norm_rope_kv (the decode step's
// own kernel; CupyBackend.qk_norm_rope_kv).
#include "weights.cuh"

#define OPS_THREADS 256

// the sum of v over the block (OPS_THREADS threads), in every thread
__device__ __forceinline__ float ops_block_sum(float v, float* scratch) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    #pragma unroll
    for (int w = 0; w < OPS_THREADS / 32; ++w) total += scratch[w];
    __syncthreads();
    return total;
}

// Grid (rows), OPS_THREADS threads: row blockIdx.x of x [rows, d] into y (may alias x).
extern "C" __global__ void __launch_bounds__(OPS_THREADS) rms_norm_rows(
        const float* __restrict__ x, const float* __restrict__ w, int d, float eps,
        float* __restrict__ y) {
    __shared__ float scratch[OPS_THREADS / 32];
    const float* row = x + (i64)blockIdx.x * d;
    float ss = 0.f;
    for (int c = threadIdx.x; c < d; c += OPS_THREADS) ss = fmaf(row[c], row[c], ss);
    const float denom = sqrtf(ops_block_sum(ss, scratch) / (float)d + eps);
    float* out = y + (i64)blockIdx.x * d;
    for (int c = threadIdx.x; c < d; c += OPS_THREADS) out[c] = __fmul_rn(row[c] / denom, w[c]);
}

// Grid (ceil(d / OPS_THREADS), n), OPS_THREADS threads: y [n, k, d], wts [n, k], out [n, d].
extern "C" __global__ void __launch_bounds__(OPS_THREADS) combine_ranked(
        const float* __restrict__ y, const float* __restrict__ wts, int k, int d,
        float* __restrict__ out) {
    const int c = blockIdx.x * OPS_THREADS + threadIdx.x, i = blockIdx.y;
    if (c >= d) return;
    float acc = 0.f;
    for (int r = 0; r < k; ++r)
        acc = __fadd_rn(acc, __fmul_rn(wts[(i64)i * k + r], y[((i64)i * k + r) * d + c]));
    out[(i64)i * d + c] = acc;
}
