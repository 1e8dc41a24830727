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

// desc: [0] position of the first row, [1] rows, [2 .. 2+MAX_ROWS) token ids
#define DESC_POS 0
#define DESC_TOKENS 2

// The rows a matvec kernel is built for (n rounded up to 1, 2, 4 or 8) and the weight rows each
// block takes: 8 / N when `wide` (tall matrices: more loads in flight per thread), else 1 for one
// activation row (short matrices such as the router: more blocks).
HOST_DEVICE constexpr int padded_rows(int n) { return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : 8; }
HOST_DEVICE constexpr int rows_per_block(int n, int wide) {
    return wide || padded_rows(n) > 1 ? MAX_ROWS / padded_rows(n) : 1;
}

// ---- routing ----------------------------------------------------------------------------------
// Where a layer's experts are: each one's blob (gate rows, then up rows, then down rows, each
// part in its stored type) in the stage's cache.
struct ExpertSpec {
    const u64* blob_of;       // [n_expert] device address of each expert's blob (0: not resident)
    i64 up_at, down_at;       // byte offsets of the up and down parts inside a blob
    i64 gate_row_bytes, up_row_bytes, down_row_bytes;
    int gate_type, up_type, down_type;
    int n_ff, n_embd, k;
};

// The router's matvec routes too: its last block to finish (counted in `done`, which it resets
// for the next launch) turns the logits into the top-k.
struct RouteSpec {
    const ExpertSpec* experts;
    const float* logits;      // [n, n_expert], written by this launch's other blocks
    int* ids;                 // [n, k] chosen experts in rank order
    float* wts;               // [n, k] their weights
    u64* blobs;               // [n, k] their blob addresses (0: not resident)
    u32* done;                // blocks finished, 0 between launches
    int n_expert, k, normalize;
};

// Softmax over row i's router logits, the top-k in rank order (ties: the lower expert id, as a
// stable sort does), weights renormalised over the k when `normalize`, and each chosen expert's
// blob address for the expert kernels. One warp. The logits were written by other blocks of
// this launch: read through L2 (__ldcg), not a possibly stale L1.
__device__ void route_row(const RouteSpec& rs, int i) {
    const int lane = threadIdx.x & 31, n_expert = rs.n_expert, k = rs.k;
    const u64* blob_of = rs.experts->blob_of;   // loaded now, not after the top-k (a dependent load)
    float v[16];
    const float* l = rs.logits + (i64)i * n_expert;
    float m = -INF_F32;
    #pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int e = lane + 32 * j;
        v[j] = e < n_expert ? __ldcg(l + e) : -INF_F32;
        m = fmaxf(m, v[j]);
    }
    m = warp_max(m);
    float sum = 0.f;
    #pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int e = lane + 32 * j;
        v[j] = e < n_expert ? __expf(v[j] - m) : -1.f;   // probabilities are >= 0
        if (e < n_expert) sum += v[j];
    }
    sum = warp_sum(sum);
    float picked_sum = 0.f;
    int mine = 0;                                         // lane r keeps the r-th pick
    float mine_p = 0.f;
    for (int r = 0; r < k; ++r) {
        float best = -1.f; int best_e = 0x7fffffff;
        #pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int e = lane + 32 * j;
            if (v[j] > best || (v[j] == best && e < best_e)) { best = v[j]; best_e = e; }
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) { best = ob; best_e = oe; }
        }
        const float p = best / sum;
        picked_sum += p;
        if (lane == r) { mine = best_e; mine_p = p; }
        #pragma unroll
        for (int j = 0; j < 16; ++j)                      // taken (static indices: registers)
            if (lane + 32 * j == best_e) v[j] = -2.f;
    }
    if (lane < k) {
        // NaN or infinite logits pick nothing: no address, so the expert kernels write NaN
        const bool picked = mine >= 0 && mine < n_expert;
        rs.ids[i * k + lane] = picked ? mine : -1;
        rs.wts[i * k + lane] = !picked ? NAN_F32 : rs.normalize ? mine_p / picked_sum : mine_p;
        rs.blobs[i * k + lane] = picked ? blob_of[mine] : 0ull;
    }
}

// Called by every block of the router's launch after its rows are written.
__device__ void route_after_last_block(const RouteSpec* __restrict__ route, int n) {
    __shared__ bool last;
    __threadfence();                                      // this block's logits, before counting
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicAdd(route->done, 1u) == gridDim.x * gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const RouteSpec rs = *route;
    const int warp = threadIdx.x >> 5;
    for (int i = warp; i < n; i += blockDim.x >> 5) route_row(rs, i);
    if (threadIdx.x == 0) *rs.done = 0u;
}

// ---- dense projections ------------------------------------------------------------------------
// One spec per matrix; blockIdx.y picks the spec, so q, k and v of one type are one launch.
struct MatSpec {
    const u8* w;          // [nrows, ncols] in `type`
    float* y;             // [n, y_stride]
    const float* add;     // residual added to y (may alias y), or null
    i64 row_bytes;
    int nrows, ncols, y_stride, type;
};

// y[i, o] = add[i, o] + sum_c W[o, c] * xn[i, c], with xn = rms_norm(x) * norm_w when norm_w is
// given (else x), for the n <= N rows of x (buffers hold MAX_ROWS rows, so rows n..N-1 are read
// and dropped). A block takes R consecutive rows o. Block (0, 0) also writes xn to `normed`.
template <int T, int N, int R>
__device__ __forceinline__ void matvec_rows(const MatSpec* __restrict__ specs,
                                            const float* __restrict__ x, int x_stride, int n,
                                            const float* __restrict__ norm_w, float eps,
                                            float* __restrict__ normed) {
    __shared__ float inv[MAX_ROWS];
    __shared__ float sums[R * N];
    const MatSpec s = specs[blockIdx.y];
    const int o0 = blockIdx.x * R;
    if (o0 >= s.nrows) return;                          // the whole block: uniform
    const u8* rows[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) rows[r] = s.w + (i64)min(o0 + r, s.nrows - 1) * s.row_bytes;
    if (norm_w != nullptr) {
        // the weight rows start on their way to L2 while the block computes the norm
        #pragma unroll
        for (int r = 0; r < R; ++r)
            for (i64 b = 128 * threadIdx.x; b < s.row_bytes; b += 128 * blockDim.x)
                asm volatile("prefetch.global.L2 [%0];" :: "l"(rows[r] + b));
        block_inv_rms(x, x_stride, s.ncols, n, eps, inv);
        if (normed != nullptr && blockIdx.x == 0 && blockIdx.y == 0) {
            for (int idx = threadIdx.x; idx < n * s.ncols; idx += blockDim.x) {
                const int i = idx / s.ncols, c = idx - i * s.ncols;
                normed[(i64)i * s.ncols + c] = x[(i64)i * x_stride + c] * inv[i] * norm_w[c];
            }
        }
    }
    block_dots<T, N, R>(rows, s.ncols >> 3, x, x_stride, norm_w, sums);
    if (threadIdx.x < R * N) {
        const int r = threadIdx.x / N, i = threadIdx.x - r * N;
        if (i < n && o0 + r < s.nrows) {
            const float v = norm_w != nullptr ? sums[threadIdx.x] * inv[i] : sums[threadIdx.x];
            const i64 at = (i64)i * s.y_stride + o0 + r;
            s.y[at] = (s.add != nullptr ? s.add[at] : 0.f) + v;
        }
    }
}

// route: null, or the router's RouteSpec (its top-k runs after the last block)
#define MATVEC_ARGS const MatSpec* __restrict__ specs, const float* __restrict__ x, int x_stride, \
                    int n, int wide, const float* __restrict__ norm_w, float eps,               \
                    float* __restrict__ normed, const RouteSpec* __restrict__ route
#define MATVEC_KERNEL(name, T, N)                                                               \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)                                 \
    matvec_##name##_##N(MATVEC_ARGS) {                                                          \
        pdl_entry();                                                                            \
        if (rows_per_block(N, wide) == rows_per_block(N, 1))                                    \
            matvec_rows<T, N, rows_per_block(N, 1)>(specs, x, x_stride, n, norm_w, eps, normed); \
        else                                                                                    \
            matvec_rows<T, N, rows_per_block(N, 0)>(specs, x, x_stride, n, norm_w, eps, normed); \
        if (route != nullptr) route_after_last_block(route, n);                                 \
    }
#define MATVEC_KERNELS(name, T) MATVEC_KERNEL(name, T, 1) MATVEC_KERNEL(name, T, 2) \
                                MATVEC_KERNEL(name, T, 4) MATVEC_KERNEL(name, T, 8)
FOR_EACH_TYPE(MATVEC_KERNELS)

// Rows of any supported type decoded to float32 (the correctness path's dequantize). rows: the
// row indices, or null for rows 0..nrows-1. One thread per chunk of 8.
extern "C" __global__ void dequant_rows(const u8* __restrict__ src, int type, i64 row_bytes,
                                        int ncols, const int* __restrict__ rows, int nrows,
                                        float* __restrict__ dst) {
    pdl_entry();
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

// The first stage's rows: embedding rows of the descriptor's token ids.
extern "C" __global__ void embed_tokens(const u8* __restrict__ table, int type, i64 row_bytes,
                                        int ncols, const int* __restrict__ desc,
                                        float* __restrict__ h) {
    pdl_entry();
    const int i = blockIdx.y;
    const u8* row = table + (i64)desc[DESC_TOKENS + i] * row_bytes;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < (ncols >> 3);
         c += gridDim.x * blockDim.x) {
        float w[8];
        DISPATCH_TYPE(type, (chunk8<TT>(row, c, w)));
        store8(h + (i64)i * ncols + 8 * c, w);
    }
}

// ---- attention --------------------------------------------------------------------------------
// sess: k base of stage layer j at [2j], v base at [2j+1] (f16 [cells, n_kv, D]); the RoPE cos and
// sin tables (f32 [cells, rot/2]) at [2*n_layers], [2*n_layers+1]. The flash-decoding partials
// (`part` [rows, n_head, n_split, D], `ml` [rows, n_head, n_split, 2]) are the step's own scratch.

// Per head: RMSNorm (q_norm / k_norm), NEOX RoPE over the first `rot` dims at the row's position,
// then q back in place and k, v into the session's cache at that position. One warp per head.
extern "C" __global__ void qk_norm_rope_kv(float* __restrict__ q, const float* __restrict__ k,
                                           const float* __restrict__ v,
                                           const float* __restrict__ qn, const float* __restrict__ kn,
                                           const u64* __restrict__ sess, int layer_slot, int n_layers,
                                           const int* __restrict__ desc, int n_head, int n_kv,
                                           int D, int rot, float eps) {
    pdl_entry();
    const int i = blockIdx.y, head = blockIdx.x, lane = threadIdx.x;
    const int pos = desc[DESC_POS] + i;
    const bool is_q = head < n_head;
    const int hh = is_q ? head : head - n_head;
    const float* src = is_q ? q + ((i64)i * n_head + hh) * D : k + ((i64)i * n_kv + hh) * D;
    const float* nw = is_q ? qn : kn;
    float vals[8];
    const int per = D >> 5;
    float ss = 0.f;
    for (int j = 0; j < per; ++j) { vals[j] = src[lane + 32 * j]; ss += vals[j] * vals[j]; }
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / (float)D + eps);
    for (int j = 0; j < per; ++j) vals[j] = vals[j] * inv * nw[lane + 32 * j];
    const int half = rot >> 1, hj = half >> 5;
    const float* cosT = reinterpret_cast<const float*>(sess[2 * n_layers]) + (i64)pos * half;
    const float* sinT = reinterpret_cast<const float*>(sess[2 * n_layers + 1]) + (i64)pos * half;
    for (int j = 0; j < hj; ++j) {
        const int d = lane + 32 * j;
        const float c = cosT[d], s = sinT[d], x1 = vals[j], x2 = vals[j + hj];
        vals[j] = x1 * c - x2 * s;
        vals[j + hj] = x2 * c + x1 * s;
    }
    if (is_q) {
        float* dst = q + ((i64)i * n_head + hh) * D;
        for (int j = 0; j < per; ++j) dst[lane + 32 * j] = vals[j];
    } else {
        __half* kc = reinterpret_cast<__half*>(sess[2 * layer_slot]) + ((i64)pos * n_kv + hh) * D;
        __half* vc = reinterpret_cast<__half*>(sess[2 * layer_slot + 1]) + ((i64)pos * n_kv + hh) * D;
        const float* vs = v + ((i64)i * n_kv + hh) * D;
        for (int j = 0; j < per; ++j) {
            kc[lane + 32 * j] = __float2half(vals[j]);
            vc[lane + 32 * j] = __float2half(vs[lane + 32 * j]);
        }
    }
}

// Flash-decoding, first half: block (kv head, split, row) scores `chunk` (<= ATTN_CHUNK) keys for
// the G query heads sharing that kv head and writes an unnormalised partial (max, sum, weighted V).
// A block whose split starts past the row's keys returns at once (it still counts as finished).
// Short chunks spread a short context over more blocks; the runner picks the chunk.
template <int D>
__device__ void attn_partial_body(const float* __restrict__ q, const u64* __restrict__ sess,
                                  int layer_slot, const int* __restrict__ desc,
                                  int n_head, int n_kv, int n_split, int chunk, float scale,
                                  float* __restrict__ part, float* __restrict__ ml) {
    constexpr int MAX_G = 16, PAIRS = D / 2;
    // q and the scores first; the same bytes hold the cross-thread sums of weighted V at the end
    __shared__ __align__(16) float smem[MAX_G * D + MAX_G * ATTN_CHUNK];
    __shared__ float ms[MAX_G], ls[MAX_G];
    float* qs = smem;
    float* ps = smem + MAX_G * D;
    const int kvh = blockIdx.x, split = blockIdx.y, i = blockIdx.z;
    const int G = n_head / n_kv, t = threadIdx.x;
    const int len = desc[DESC_POS] + i + 1;              // keys this row sees (causal)
    const int start = split * chunk;
    if (start >= len) return;
    const int count = min(chunk, len - start);
    const __half* kc = reinterpret_cast<const __half*>(sess[2 * layer_slot]);
    const __half* vc = reinterpret_cast<const __half*>(sess[2 * layer_slot + 1]);
    // Every load that needs nothing computed here goes out first, so the block waits on memory
    // once: the first round's K of this thread, its first V_AHEAD keys of V, and q.
    constexpr int SPLIT = 4;                 // threads per key in the scores
    constexpr int KQ = BLOCK_THREADS / PAIRS, V_AHEAD = 64 / KQ;  // V: KQ threads per dim pair
    constexpr int KW = D / (4 * SPLIT);      // a thread's 4-dim pieces of a key
    const int u = t % SPLIT, dp = t % PAIRS, kq = t / PAIRS;
    uint2 k_ahead[KW];
    {
        const int kk = min(t / SPLIT, count - 1);
        const uint2* krow = reinterpret_cast<const uint2*>(kc + ((i64)(start + kk) * n_kv + kvh) * D);
        #pragma unroll
        for (int j = 0; j < KW; ++j) k_ahead[j] = __ldg(krow + u + SPLIT * j);
    }
    const __half2* vp = reinterpret_cast<const __half2*>(vc + ((i64)start * n_kv + kvh) * D) + dp;
    const i64 vstride = (i64)n_kv * PAIRS;
    __half2 v_ahead[V_AHEAD];
    #pragma unroll
    for (int m = 0; m < V_AHEAD; ++m) {
        const int c = kq + KQ * m;
        v_ahead[m] = c < count ? __ldg(vp + c * vstride) : __float2half2_rn(0.f);
    }
    for (int idx = t; idx < G * D; idx += blockDim.x)
        qs[idx] = q[((i64)i * n_head + kvh * G) * D + idx];
    __syncthreads();
    // scores: SPLIT threads per key, thread u taking dims 4u + 16j: its q reads from shared memory
    // are conflict-free and the G heads' sums are independent chains. Every thread runs every
    // round (the shuffles need whole warps); a round's keys past `count` are computed and dropped.
    for (int base = 0; base < count; base += blockDim.x / SPLIT) {
        const int key = base + t / SPLIT, kk = min(key, count - 1);
        if (base > 0) {
            const uint2* krow =
                reinterpret_cast<const uint2*>(kc + ((i64)(start + kk) * n_kv + kvh) * D);
            #pragma unroll
            for (int j = 0; j < KW; ++j) k_ahead[j] = __ldg(krow + u + SPLIT * j);
        }
        float acc[MAX_G];
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g) acc[g] = 0.f;
        #pragma unroll
        for (int j = 0; j < KW; ++j) {
            const float2 k01 = __half22float2(*reinterpret_cast<const __half2*>(&k_ahead[j].x));
            const float2 k23 = __half22float2(*reinterpret_cast<const __half2*>(&k_ahead[j].y));
            #pragma unroll
            for (int g = 0; g < MAX_G; ++g) {
                if (g < G) {
                    const float4 qv =
                        *reinterpret_cast<const float4*>(qs + g * D + 4 * u + 4 * SPLIT * j);
                    acc[g] = fmaf(qv.x, k01.x, acc[g]);
                    acc[g] = fmaf(qv.y, k01.y, acc[g]);
                    acc[g] = fmaf(qv.z, k23.x, acc[g]);
                    acc[g] = fmaf(qv.w, k23.y, acc[g]);
                }
            }
        }
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
            if (g < G) {
                float v = acc[g];
                #pragma unroll
                for (int o = 1; o < SPLIT; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                if (u == 0 && key < count) ps[g * ATTN_CHUNK + key] = v * scale;
            }
        }
    }
    __syncthreads();
    const int warp = t >> 5, lane = t & 31, nwarps = blockDim.x >> 5;
    for (int g = warp; g < G; g += nwarps) {
        float m = -INF_F32;
        for (int c = lane; c < count; c += 32) m = fmaxf(m, ps[g * ATTN_CHUNK + c]);
        m = warp_max(m);
        float l = 0.f;
        for (int c = lane; c < count; c += 32) {
            float e = __expf(ps[g * ATTN_CHUNK + c] - m);
            ps[g * ATTN_CHUNK + c] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) { ms[g] = m; ls[g] = l; }
    }
    __syncthreads();
    // weighted V: thread (kq, dp) takes keys kq, kq + KQ, ... for the dim pair dp of every head
    // (one half2 load of V serves all G), then the KQ partial sums are added in kq order
    float2 acc[MAX_G];
    #pragma unroll
    for (int g = 0; g < MAX_G; ++g) acc[g] = make_float2(0.f, 0.f);
    #pragma unroll
    for (int m = 0; m < V_AHEAD; ++m) {       // the keys whose V is already in registers
        const int c = kq + KQ * m;
        if (c < count) {
            const float2 v = __half22float2(v_ahead[m]);
            #pragma unroll
            for (int g = 0; g < MAX_G; ++g) {
                if (g < G) {
                    const float p = ps[g * ATTN_CHUNK + c];
                    acc[g].x += p * v.x;
                    acc[g].y += p * v.y;
                }
            }
        }
    }
    #pragma unroll 4
    for (int c = kq + KQ * V_AHEAD; c < count; c += KQ) {
        const float2 v = __half22float2(__ldg(vp + c * vstride));
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
            if (g < G) {
                const float p = ps[g * ATTN_CHUNK + c];
                acc[g].x += p * v.x;
                acc[g].y += p * v.y;
            }
        }
    }
    __syncthreads();                                     // qs and ps are read for the last time
    float2* red = reinterpret_cast<float2*>(smem);       // [KQ - 1][MAX_G][PAIRS]
    if (kq > 0) {
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g)
            if (g < G) red[((kq - 1) * MAX_G + g) * PAIRS + dp] = acc[g];
    }
    __syncthreads();
    if (kq == 0) {
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
            if (g < G) {
                float2 a = acc[g];
                for (int o = 1; o < KQ; ++o) {
                    const float2 b = red[((o - 1) * MAX_G + g) * PAIRS + dp];
                    a.x += b.x;
                    a.y += b.y;
                }
                const i64 at = ((i64)i * n_head + kvh * G + g) * n_split + split;
                reinterpret_cast<float2*>(part + at * D)[dp] = a;
                if (dp == 0) { ml[2 * at] = ms[g]; ml[2 * at + 1] = ls[g]; }
            }
        }
    }
}

// Flash-decoding, second half, run by the last of a (row, kv head)'s split blocks to finish
// (counted in done[i * n_kv + kvh], which it resets for the next launch): the splits of each of
// the G heads combined in split order. The partials were written by other blocks: read via L2.
// Latency, not bandwidth, bounds this: each head's max is found by a warp with all its loads in
// flight, each tile's split weights go to shared memory once, and a thread's partial values are
// loaded COMBINE_AHEAD at a time before they are summed. The sums run in split order with the same
// expressions as one thread per output walking the splits, so the result is that one's, bit for bit.
#define COMBINE_TILE 64     // splits whose weights are in shared memory at a time
#define COMBINE_AHEAD 8     // partial values a thread has in flight
template <int D>
__device__ void attn_combine_heads(const float* part, const float* ml, int len, int n_head,
                                   int n_kv, int n_split, int chunk, float* __restrict__ out) {
    constexpr int MAX_G = 16, PER = (MAX_G * D + BLOCK_THREADS - 1) / BLOCK_THREADS;
    __shared__ float m_s[MAX_G], w_s[MAX_G][COMBINE_TILE], l_s[MAX_G][COMBINE_TILE];
    const int kvh = blockIdx.x, i = blockIdx.z, G = n_head / n_kv;
    const int used = (len + chunk - 1) / chunk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (int g = warp; g < G; g += nwarps) {
        const i64 base = ((i64)i * n_head + kvh * G + g) * n_split;
        float m = -INF_F32;
        for (int s = lane; s < used; s += 32) m = fmaxf(m, __ldcg(ml + 2 * (base + s)));
        m = warp_max(m);
        if (lane == 0) m_s[g] = m;
    }
    float num[PER], den[PER];
    #pragma unroll
    for (int r = 0; r < PER; ++r) { num[r] = 0.f; den[r] = 0.f; }
    for (int s0 = 0; s0 < used; s0 += COMBINE_TILE) {
        const int s1 = min(used, s0 + COMBINE_TILE);
        __syncthreads();                      // m_s written; the last tile's weights read
        for (int idx = threadIdx.x; idx < G * COMBINE_TILE; idx += blockDim.x) {
            const int g = idx / COMBINE_TILE, s = s0 + idx % COMBINE_TILE;
            if (s < s1) {
                const i64 at = ((i64)i * n_head + kvh * G + g) * n_split + s;
                w_s[g][s - s0] = __expf(__ldcg(ml + 2 * at) - m_s[g]);
                l_s[g][s - s0] = __ldcg(ml + 2 * at + 1);
            }
        }
        __syncthreads();
        #pragma unroll
        for (int r = 0; r < PER; ++r) {
            const int idx = threadIdx.x + r * BLOCK_THREADS;
            if (idx < G * D) {
                const int g = idx / D, d = idx % D;
                const float* p = part + (((i64)i * n_head + kvh * G + g) * n_split) * D + d;
                for (int s = s0; s < s1; s += COMBINE_AHEAD) {
                    float v[COMBINE_AHEAD];
                    #pragma unroll
                    for (int u = 0; u < COMBINE_AHEAD; ++u)
                        v[u] = s + u < s1 ? __ldcg(p + (i64)(s + u) * D) : 0.f;
                    #pragma unroll
                    for (int u = 0; u < COMBINE_AHEAD; ++u) {
                        if (s + u < s1) {
                            const float w = w_s[g][s + u - s0];
                            num[r] += w * v[u];
                            den[r] += w * l_s[g][s + u - s0];
                        }
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < PER; ++r) {
        const int idx = threadIdx.x + r * BLOCK_THREADS;
        if (idx < G * D) {
            const int g = idx / D, d = idx % D;
            out[((i64)i * n_head + kvh * G + g) * D + d] = num[r] / den[r];
        }
    }
}

// Grid (n_kv, n_split, rows), BLOCK_THREADS threads: out [rows, n_head, D] is the attention of
// each row's query heads over its causal keys.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
attn_decode_128(const float* q, const u64* sess, int layer_slot, const int* desc, int n_head,
                int n_kv, int n_split, int chunk, float scale, float* part, float* ml,
                u32* __restrict__ done, float* __restrict__ out) {
    pdl_entry();
    __shared__ bool last;
    attn_partial_body<128>(q, sess, layer_slot, desc, n_head, n_kv, n_split, chunk, scale, part,
                           ml);
    __threadfence();                          // this block's partials, before it is counted
    __syncthreads();
    u32* mine = done + blockIdx.z * n_kv + blockIdx.x;
    if (threadIdx.x == 0) last = atomicAdd(mine, 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    attn_combine_heads<128>(part, ml, desc[DESC_POS] + blockIdx.z + 1, n_head, n_kv, n_split,
                            chunk, out);
    if (threadIdx.x == 0) *mine = 0u;
}

// ---- experts ----------------------------------------------------------------------------------
// act[i, r, f] = silu(gate_e[f] . x_i) * (up_e[f] . x_i), e = ids[i, r] (gate and up stored in
// one type). A block takes FF_PER_BLOCK consecutive f: their gate and up rows load together.
// Grid (f blocks, k, rows).
template <int T>
__device__ __forceinline__ void moe_gate_up_body(const ExpertSpec* __restrict__ spec_p,
                                                 const float* __restrict__ x,
                                                 const u64* __restrict__ blobs,
                                                 float* __restrict__ act) {
    __shared__ float sums[2 * FF_PER_BLOCK];
    const ExpertSpec sp = *spec_p;
    const int f0 = blockIdx.x * FF_PER_BLOCK, r = blockIdx.y, i = blockIdx.z;
    float* out = act + ((i64)i * sp.k + r) * sp.n_ff;
    const u8* blob = reinterpret_cast<const u8*>(blobs[i * sp.k + r]);
    if (blob == nullptr) {      // not resident: the caller checked; NaN says so loudly
        if (threadIdx.x < FF_PER_BLOCK && f0 + threadIdx.x < sp.n_ff)
            out[f0 + threadIdx.x] = NAN_F32;
        return;
    }
    const u8* rows[2 * FF_PER_BLOCK];
    #pragma unroll
    for (int q = 0; q < FF_PER_BLOCK; ++q) {
        const int f = min(f0 + q, sp.n_ff - 1);
        rows[q] = blob + (i64)f * sp.gate_row_bytes;
        rows[FF_PER_BLOCK + q] = blob + sp.up_at + (i64)f * sp.up_row_bytes;
    }
    block_dots<T, 1, 2 * FF_PER_BLOCK>(rows, sp.n_embd >> 3, x + (i64)i * sp.n_embd, 0, nullptr,
                                       sums);
    if (threadIdx.x < FF_PER_BLOCK && f0 + threadIdx.x < sp.n_ff) {
        const float g = sums[threadIdx.x], u = sums[FF_PER_BLOCK + threadIdx.x];
        out[f0 + threadIdx.x] = g / (1.f + __expf(-g)) * u;
    }
}

// h[i, d] += sum over r of wts[i, r] * (down_e[d] . act[i, r]), e = ids[i, r]. The k experts'
// rows are one sequence of chunks in rank order (as act[i] is), split over the block's threads
// like one long row, with the rank weight folded into the activations: all k experts' loads are
// in flight together and each sum has one fixed order. A block takes DOWN_PER_BLOCK outputs d.
// Grid (d blocks, rows).
template <int T>
__device__ __forceinline__ void moe_down_body(const ExpertSpec* __restrict__ spec_p,
                                              const float* __restrict__ act,
                                              const u64* __restrict__ blobs,
                                              const float* __restrict__ wts,
                                              float* __restrict__ h) {
    __shared__ float sums[DOWN_PER_BLOCK];
    const ExpertSpec sp = *spec_p;
    const int d0 = blockIdx.x * DOWN_PER_BLOCK, i = blockIdx.y;
    const int per = sp.n_ff >> 3, total = per * sp.k;
    const float* a = act + (i64)i * sp.k * sp.n_ff;
    i64 row_at[DOWN_PER_BLOCK];
    #pragma unroll
    for (int q = 0; q < DOWN_PER_BLOCK; ++q)
        row_at[q] = sp.down_at + (i64)min(d0 + q, sp.n_embd - 1) * sp.down_row_bytes;
    float acc[DOWN_PER_BLOCK];
    #pragma unroll
    for (int q = 0; q < DOWN_PER_BLOCK; ++q) acc[q] = 0.f;
    bool missing = false;
    #pragma unroll 2
    for (int t = threadIdx.x; t < total; t += blockDim.x) {
        const int r = t / per, c = t - r * per;
        const u8* blob = reinterpret_cast<const u8*>(blobs[i * sp.k + r]);
        if (blob == nullptr) {
            missing = true;
            continue;
        }
        const float wr = wts[i * sp.k + r];
        float xv[8];
        load8(a + 8 * (i64)t, xv);
        #pragma unroll
        for (int j = 0; j < 8; ++j) xv[j] *= wr;
        #pragma unroll
        for (int q = 0; q < DOWN_PER_BLOCK; ++q) {
            float w[8];
            chunk8<T>(blob + row_at[q], c, w);
            #pragma unroll
            for (int j = 0; j < 8; ++j) acc[q] = fmaf(w[j], xv[j], acc[q]);
        }
    }
    missing = __syncthreads_or(missing);
    block_reduce<DOWN_PER_BLOCK>(acc, sums);
    if (threadIdx.x < DOWN_PER_BLOCK && d0 + threadIdx.x < sp.n_embd)
        h[(i64)i * sp.n_embd + d0 + threadIdx.x] += missing ? NAN_F32 : sums[threadIdx.x];
}

#define MOE_KERNELS(name, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_gate_up_##name(               \
            const ExpertSpec* __restrict__ spec, const float* __restrict__ x,                    \
            const u64* __restrict__ blobs, float* __restrict__ act) {                            \
        pdl_entry();                                                                             \
        moe_gate_up_body<T>(spec, x, blobs, act);                                                \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_down_##name(                  \
            const ExpertSpec* __restrict__ spec, const float* __restrict__ act,                  \
            const u64* __restrict__ blobs, const float* __restrict__ wts, float* __restrict__ h) { \
        pdl_entry();                                                                             \
        moe_down_body<T>(spec, act, blobs, wts, h);                                              \
    }
FOR_EACH_TYPE(MOE_KERNELS)

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
    __shared__ bool last;
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
        __threadfence();
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    best = -INF_F32;
    best_i = 0x7fffffff;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x) {
        const float v = __ldcg(post_v + b);
        const int i = __ldcg(post_i + b);
        if (v > best || (v == best && i < best_i)) { best = v; best_i = i; }
    }
    block_best(best, best_i);
    if (threadIdx.x == 0) { *out = best_i; *done = 0u; }
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
