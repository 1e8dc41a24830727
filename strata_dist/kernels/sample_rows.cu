// strata-dist: the greedy facts of a batched decode step's rows, on the card, in one launch.
//
//   greedy_rows   grid (rows), a block a row (a multiple of 32 threads, at most 1,024): for row r
//                 of logits [rows, n_vocab], out[r] the index numpy's argmax gives (the first
//                 maximum; the first NaN where the row holds one), out[rows + r] 1 where the
//                 value at that index is finite, out[2 * rows + r] 1 where the row holds a NaN
//
// backends/batched_decode.py reads these 3 x rows words back instead of the rows (a row of
// Qwen3's vocabulary is 600 KB). Built ahead with the other sources (kernels/prebuild.py), so
// the first batched step of a process compiles nothing: made of CuPy array operations, it
// compiled several kernels with NVRTC on a fresh machine, seconds that stalled every running
// stream once (docs/BENCHMARKS.md, serving many streams).
#define GREEDY_NONE 0x7fffffff      // no index yet: larger than any row's
#ifndef INF_F32
#define INF_F32 __int_as_float(0x7f800000)
#endif

// the block's best (value, first index) and its first NaN index, in every thread (once a
// kernel: a second call would need a barrier before its shared slots are written again)
__device__ __forceinline__ void greedy_block(float& best, int& best_i, int& first_nan) {
    __shared__ float bv[32];
    __shared__ int bi[32], bn[32];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        const int on = __shfl_xor_sync(0xffffffffu, first_nan, o);
        if (ob > best || (ob == best && oi < best_i)) { best = ob; best_i = oi; }
        if (on < first_nan) first_nan = on;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { bv[warp] = best; bi[warp] = best_i; bn[warp] = first_nan; }
    __syncthreads();
    best = bv[0];
    best_i = bi[0];
    first_nan = bn[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
        if (bv[w] > best || (bv[w] == best && bi[w] < best_i)) { best = bv[w]; best_i = bi[w]; }
        if (bn[w] < first_nan) first_nan = bn[w];
    }
}

extern "C" __global__ void __launch_bounds__(1024) greedy_rows(
        const float* __restrict__ logits, int n_vocab, int rows, int* __restrict__ out) {
    const float* row = logits + (long long)blockIdx.x * n_vocab;
    float best = -INF_F32;
    int best_i = GREEDY_NONE, first_nan = GREEDY_NONE;
    for (int j = threadIdx.x; j < n_vocab; j += blockDim.x) {    // ascending j: first kept
        const float v = row[j];
        if (v != v) {
            if (first_nan == GREEDY_NONE) first_nan = j;
        } else if (v > best) {
            best = v;
            best_i = j;
        }
    }
    greedy_block(best, best_i, first_nan);
    if (threadIdx.x != 0) return;
    const int r = blockIdx.x;
    const bool nan = first_nan != GREEDY_NONE;
    // a row of -inf only: numpy's argmax is 0, whose value is not finite
    out[r] = nan ? first_nan : (best_i == GREEDY_NONE ? 0 : best_i);
    out[rows + r] = !nan && best > -INF_F32 && best < INF_F32;
    out[2 * rows + r] = nan;
}
