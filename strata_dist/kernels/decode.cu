// strata-dist decode kernels: one token (or up to MAX_ROWS rows) through a qwen3moe stage.
//
// Weights are read in their stored blocks by the helpers of weights.cuh; activations are float32.
// Positions and token ids are read from a device descriptor (`desc`), and the session's KV and
// RoPE tables through a device pointer table (`sess`), so a captured CUDA graph replays for any
// position and any session of the same shape.
//
// The hot kernels exist once per weight type (`matvec_q8_0_1`, `moe_down_q6_k`, ...) so each gets
// its own register budget; kernels/abi.py names them for the runner.
#include "weights.cuh"

#define ATTN_CHUNK 256      // the most keys per attention split (one block each)
// The expert kernels' shape; the defaults are what kernels/abi.py's KernelShape holds, and
// benchmarks/tune_decode.py compiles other values (-D) to measure them.
#ifndef FF_PER_BLOCK
#define FF_PER_BLOCK 4      // expert rows f of one block of moe_gate_up (its gate and up rows)
#endif
#ifndef DOWN_PER_BLOCK
#define DOWN_PER_BLOCK 4    // outputs of one block of moe_down
#endif
// Threads of a matvec block (128 or 256). With 128, a block's threads take two chunks of a
// 2048-column row each and reduce over 4 warps; twice the blocks fit an SM, so Qwen3-30B's q/k/v
// launch (640 blocks) runs in one wave instead of about 1.6. 256 stays the default: 128 measured
// no faster (docs/BENCHMARKS.md; kernels/abi.py KernelShape matvec_threads).
#ifndef MATVEC_THREADS
#define MATVEC_THREADS BLOCK_THREADS
#endif

// desc (kernels/abi.py DESC_*; backends/decode_rows.py packs it): [0] position of the first row,
// [1] rows, [2 .. 2+MAX_ROWS) token ids, then the words of one session's pointer table and, per
// row, its position, the slot of its session's table in `sess` and its session's step end (the
// newest cell the step writes, + 1). Table words 0: rows pos, pos + 1, ... of the table at slot
// 0 (a one-session writer's zeros mean that). attention.cuh row_position / row_table read it.
#define DESC_POS 0
#define DESC_ROWS 1
#define DESC_TOKENS 2
#define DESC_TABLE_WORDS (DESC_TOKENS + MAX_ROWS)
#define DESC_ROW_POS (DESC_TABLE_WORDS + 1)
#define DESC_ROW_TABLE (DESC_ROW_POS + MAX_ROWS)
#define DESC_ROW_END (DESC_ROW_TABLE + MAX_ROWS)

#ifndef MATVEC_ACCS
#define MATVEC_ACCS 32  // the dot sums a matvec thread holds at 2+ activation rows (KernelShape)
#endif
static_assert(MATVEC_ACCS == 8 || MATVEC_ACCS == 16 || MATVEC_ACCS == 32 || MATVEC_ACCS == 64,
              "MATVEC_ACCS is 8, 16, 32 or 64");
#ifndef MATVEC_MMA
#define MATVEC_MMA 0    // 1: dense matvecs on tensor cores at every row count (matvec_mma.cuh)
#endif
#ifndef MMA_THREADS
#define MMA_THREADS BLOCK_THREADS   // threads of a tensor-core matvec block (256 or 512)
#endif

// The rows a matvec kernel is built for (n rounded up to 1, 2, 4 or 8) and the weight rows each
// block takes. One activation row: 8 when `wide` (tall matrices: more loads in flight per thread),
// else 1 (short matrices such as the router: more blocks). N >= 2 rows: MATVEC_ACCS / N, so a
// thread holds MATVEC_ACCS sums; every thread reads each of its chunks' N activation rows once per
// block, so fewer weight rows a block means more activation reads per weight byte (at 8 rows and
// one weight row a block, 256 bytes of x for each 16 bytes of f16 weights). Which block takes an
// output changes none of its bits (block_dots: one order per output).
HOST_DEVICE constexpr int padded_rows(int n) { return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : 8; }
HOST_DEVICE constexpr int rows_per_block(int n, int wide) {
    return padded_rows(n) > 1 ? MATVEC_ACCS / padded_rows(n) : wide ? MAX_ROWS : 1;
}

static_assert(MATVEC_THREADS == 128 || MATVEC_THREADS == BLOCK_THREADS,
              "a matvec block is 128 or BLOCK_THREADS threads");

#include "experts.cuh"     // ExpertSpec, RouteSpec, the router's top-k, moe_gate_up / moe_down
#include "attention.cuh"   // norm_rope_head, qk_norm_rope_kv, attn_decode_128
#include "gated_delta.cuh" // GdnSpec, gdn_conv_step, gdn_delta_step (qwen3next's linear layers)
#include "next_attention.cuh" // qwen3next's gated attention (256-wide heads) and shared expert

// ---- dense projections ------------------------------------------------------------------------
// One spec per matrix; blockIdx.y picks the spec, so q, k and v of one type are one launch.
struct MatSpec {
    const u8* w;          // [nrows, ncols] in `type`
    float* y;             // [n, y_stride]
    const float* add;     // residual added to y (may alias y), or null
    i64 row_bytes;
    int nrows, ncols, y_stride, type;
};

// normed[i] = x_i * inv[i] * norm_w for the n rows (a matvec's fused RMSNorm, written out once by
// its block (0, 0) for the kernels after it)
__device__ __forceinline__ void write_normed(float* __restrict__ normed,
                                             const float* __restrict__ x, int x_stride, int n,
                                             int ncols, const float* inv,
                                             const float* __restrict__ norm_w) {
    for (int idx = threadIdx.x; idx < n * ncols; idx += blockDim.x) {
        const int i = idx / ncols, c = idx - i * ncols;
        normed[(i64)i * ncols + c] = x[(i64)i * x_stride + c] * inv[i] * norm_w[c];
    }
}

// y[i, o] = add[i, o] + v: a matvec's output of row i, weight row o (every matvec kernel's store)
__device__ __forceinline__ void store_output(const MatSpec& s, int i, int o, float v) {
    const i64 at = (i64)i * s.y_stride + o;
    s.y[at] = (s.add != nullptr ? s.add[at] : 0.f) + v;
}

// y[i, o] = add[i, o] + sum_c W[o, c] * xn[i, c], with xn = rms_norm(x) * norm_w when norm_w is
// given (else x), for the n <= N rows of x (buffers hold MAX_ROWS rows, so rows n..N-1 are read
// and dropped). A block takes R consecutive rows o. Block (0, 0) also writes xn to `normed`.
template <int T, int N, int R>
__device__ __forceinline__ void matvec_rows(const MatSpec* __restrict__ specs,
                                            const float* __restrict__ x, int x_stride, int n,
                                            const float* __restrict__ norm_w, float eps,
                                            float* __restrict__ normed) {
    __shared__ float inv[MAX_ROWS];
    __shared__ float sums[R * N + N];
    const MatSpec s = specs[blockIdx.y];
    const int o0 = blockIdx.x * R;
    if (o0 >= s.nrows) return;                          // the whole block: uniform
    const u8* rows[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) rows[r] = s.w + (i64)min(o0 + r, s.nrows - 1) * s.row_bytes;
    // the norm's scale (1 / rms of each row) applies to the sums, so the activations' sum of
    // squares is taken in the same pass as the dots
    if (norm_w == nullptr) {
        block_dots<T, N, R>(rows, s.ncols >> 3, x, x_stride, nullptr, sums);
    } else {
        block_dots<T, N, R, true>(rows, s.ncols >> 3, x, x_stride, norm_w, sums);
        if (threadIdx.x < N)
            inv[threadIdx.x] = rsqrtf(sums[R * N + threadIdx.x] / (float)s.ncols + eps);
        __syncthreads();
        if (normed != nullptr && blockIdx.x == 0 && blockIdx.y == 0)
            write_normed(normed, x, x_stride, n, s.ncols, inv, norm_w);
    }
    if (threadIdx.x < R * N) {
        const int r = threadIdx.x / N, i = threadIdx.x - r * N;
        if (i < n && o0 + r < s.nrows) {
            store_output(s, i, o0 + r, norm_w != nullptr ? sums[threadIdx.x] * inv[i]
                                                          : sums[threadIdx.x]);
        }
    }
}

#include "matvec_mma.cuh"  // MATVEC_MMA: the dense matvec on tensor cores (matvec_mma_rows)
#include "matvec_pieces.cuh"  // MATVEC_PIECES: K-quant matvecs, a warp's rows in 16-byte pieces

// Threads of one block of a type's matvec (kernels/abi.py matvec_block_threads): MMA_THREADS
// where this build takes the type on tensor cores (512: a 16-row tile's K over 16 warps, so a
// lane decodes as many chunks as a plain matvec thread at one row), PIECE_THREADS where it takes
// it in pieces
HOST_DEVICE constexpr int matvec_block_threads(int T) {
    return MATVEC_MMA && mma_scale_cols(T) != 0 ? MMA_THREADS
         : MATVEC_PIECES && piece_type(T) ? PIECE_THREADS : MATVEC_THREADS;
}

// route: null, or the router's RouteSpec (its top-k runs after the last block)
#define MATVEC_ARGS const MatSpec* __restrict__ specs, const float* __restrict__ x, int x_stride, \
                    int n, int wide, const float* __restrict__ norm_w, float eps,               \
                    float* __restrict__ normed, const RouteSpec* __restrict__ route
#define MATVEC_KERNEL(name, T, N)                                                               \
    extern "C" __global__ void __launch_bounds__(matvec_block_threads(T))                       \
    matvec_##name##_##N(MATVEC_ARGS) {                                                          \
        pdl_entry();                                                                            \
        if constexpr (MATVEC_MMA && mma_scale_cols(T) != 0) {                                   \
            if (norm_w == nullptr)                                                              \
                matvec_mma_rows<T, false>(specs, x, x_stride, n, norm_w, eps, normed);          \
            else                                                                                \
                matvec_mma_rows<T, true>(specs, x, x_stride, n, norm_w, eps, normed);           \
        } else if constexpr (MATVEC_PIECES && piece_type(T)) {                                  \
            matvec_pieces_rows<T, N>(specs, x, x_stride, n, norm_w, eps, normed);               \
        } else if (rows_per_block(N, wide) == rows_per_block(N, 1))                             \
            matvec_rows<T, N, rows_per_block(N, 1)>(specs, x, x_stride, n, norm_w, eps, normed); \
        else                                                                                    \
            matvec_rows<T, N, rows_per_block(N, 0)>(specs, x, x_stride, n, norm_w, eps, normed); \
        if (route != nullptr) route_after_last_block(route, n);                                 \
    }
#define MATVEC_KERNELS(name, T, ...) MATVEC_KERNEL(name, T, 1) MATVEC_KERNEL(name, T, 2) \
                                MATVEC_KERNEL(name, T, 4) MATVEC_KERNEL(name, T, 8)
FOR_EACH_TYPE(MATVEC_KERNELS)

// Rows of any supported type decoded to float32 (the correctness path's dequantize). rows: the
// row indices, or null for rows 0..nrows-1. One thread per chunk of 8.
__device__ __forceinline__ void store8(__half* p, const float* v) {
    __half2 h[4];
    #pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(h);
}

template <typename Out>
__device__ __forceinline__ void dequant_rows_body(const u8* __restrict__ src, int type,
                                                  i64 row_bytes, int ncols,
                                                  const int* __restrict__ rows, int nrows,
                                                  Out* __restrict__ dst) {
    const int per = ncols >> 3;
    const i64 chunks = (i64)nrows * per;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < chunks;
         t += (i64)gridDim.x * blockDim.x) {
        const int r = (int)(t / per), c = (int)(t - (i64)r * per);
        const u8* row = src + (i64)(rows != nullptr ? rows[r] : r) * row_bytes;
        float w[8];
        DISPATCH_TYPE(type, (chunk8<TT>(row, c, w)));
        store8(dst + (i64)r * ncols + 8 * c, w);
    }
}

extern "C" __global__ void dequant_rows(const u8* __restrict__ src, int type, i64 row_bytes,
                                        int ncols, const int* __restrict__ rows, int nrows,
                                        float* __restrict__ dst) {
    pdl_entry();
    dequant_rows_body(src, type, row_bytes, ncols, rows, nrows, dst);
}

// The same rows rounded to f16 (round to nearest): a prompt's quantized dense matrices for an f16
// GEMM on tensor cores (cupy_backend.py linear).
extern "C" __global__ void dequant_rows_f16(const u8* __restrict__ src, int type, i64 row_bytes,
                                            int ncols, const int* __restrict__ rows, int nrows,
                                            __half* __restrict__ dst) {
    pdl_entry();
    dequant_rows_body(src, type, row_bytes, ncols, rows, nrows, dst);
}

// The first stage's rows: embedding rows of the descriptor's token ids. An id outside the table
// gives a row of NaN, not a read past it: the host checks the ids it writes, but a step launched
// ahead reads the step before's argmax, which is no id when that step found no finite logit.
extern "C" __global__ void embed_tokens(const u8* __restrict__ table, int type, i64 row_bytes,
                                        int ncols, int nrows, const int* __restrict__ desc,
                                        float* __restrict__ h) {
    pdl_entry();
    const int i = blockIdx.y, id = desc[DESC_TOKENS + i];
    const bool ok = 0 <= id && id < nrows;
    const u8* row = table + (i64)(ok ? id : 0) * row_bytes;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < (ncols >> 3);
         c += gridDim.x * blockDim.x) {
        float w[8];
        if (ok) {
            DISPATCH_TYPE(type, (chunk8<TT>(row, c, w)));
        } else {
            #pragma unroll
            for (int j = 0; j < 8; ++j) w[j] = NAN_F32;
        }
        store8(h + (i64)i * ncols + 8 * c, w);
    }
}

// ---- the token --------------------------------------------------------------------------------
// The best (value, index) of the block's threads, in every thread on return: the largest value,
// the lowest index on ties (numpy's argmax).
__device__ void block_best(float& best, int& best_i) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (ob > best || (ob == best && oi < best_i)) { best = ob; best_i = oi; }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { bv[warp] = best; bi[warp] = best_i; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        best = lane < nw ? bv[lane] : -INF_F32;
        best_i = lane < nw ? bi[lane] : 0x7fffffff;
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            if (ob > best || (ob == best && oi < best_i)) { best = ob; best_i = oi; }
        }
        if (lane == 0) { bv[0] = best; bi[0] = best_i; }
    }
    __syncthreads();
    best = bv[0];
    best_i = bi[0];
}

// Greedy token of a logits row. Each block posts the best of its slice; the last block to finish
// (counted in `done`, which it resets for the next launch) picks the best post.
extern "C" __global__ void argmax_row(const float* __restrict__ logits, int n,
                                      float* __restrict__ post_v, int* __restrict__ post_i,
                                      u32* __restrict__ done, int* __restrict__ out) {
    pdl_entry();
    float best = -INF_F32;
    int best_i = 0x7fffffff;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
        const float v = logits[j];
        if (v > best) { best = v; best_i = j; }        // ascending j: first max kept
    }
    block_best(best, best_i);
    if (threadIdx.x == 0) {
        post_v[blockIdx.x] = best;
        post_i[blockIdx.x] = best_i;
    }
    if (!last_block_to_finish(done, gridDim.x)) return;
    best = -INF_F32;
    best_i = 0x7fffffff;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x) {
        const float v = __ldcg(post_v + b);
        const int i = __ldcg(post_i + b);
        if (v > best || (v == best && i < best_i)) { best = v; best_i = i; }
    }
    block_best(best, best_i);
    if (threadIdx.x == 0) *out = best_i;
}

// Holds its stream for `ns` nanoseconds. kernel_times queues a step's launches behind it, so the
// events between them time the kernels, not the Python that launches them.
extern "C" __global__ void spin(u64 ns) {
    u64 start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
