// strata-dist: a prompt chunk's Gated DeltaNet mixer (CupyBackend.linear_attention), the same
// arithmetic as gated_delta.cuh's decode kernels, but spread over the chunk's rows where they
// are independent. The decode kernels take the rows in order, a block a head, a few barriers a
// row: at 4,096 rows that token loop is ~20 ms a layer on an H200 (docs/BENCHMARKS.md), nearly
// all of it latency. Here, four launches:
//
//   gdn_conv_rows        every (row, channel) at once: the causal convolution over the K inputs
//                        ending at the row (the conv state's values for the first K - 1 rows),
//                        SiLU, the q/k heads' L2 norm; the state is only read
//   gdn_conv_tail        the conv state after the chunk: its last K - 1 inputs
//   gdn_delta_rows       a warp a state column (value head h, column j): the column's head_k
//                        values in the lanes' registers (rows lane, lane + 32, ..), the rows of
//                        the chunk in order; the columns are independent given q and k, so no
//                        barrier, only two warp sums a row, and the next row's loads in flight
//                        while this one computes. Writes o = S^T q, not yet normed
//   gdn_gated_norm_rows  the gated RMSNorm of every (row, value head), in place over o
//
// The convolution and both norms are gated_delta.cuh's expressions, value for value (the norm's
// block of head_v threads sums its warps in the decode kernel's order); the delta rule sums kv
// and o over a column's rows in a warp's butterfly order instead of the decode kernel's
// 16-row groups, so the two agree within float32 rounding.
#include "weights.cuh"
#include "gated_delta.cuh"

#define GDN_MAX_K 8          // the longest convolution gdn_conv_tail keeps in registers
#define GDN_LANE_ROWS 4      // rows of a state column a lane holds: key heads of up to 128
                             // (Qwen3-Next's); 8 took 111 registers, two waves of blocks
#define GDN_COLUMNS_PER_BLOCK 4

// Grid (conv_dim / head_k, n), block head_k threads: row blockIdx.y of channel
// blockIdx.x head_k + threadIdx.x; a block is one head (q and k heads normalised over it).
extern "C" __global__ void gdn_conv_rows(const GdnSpec* __restrict__ spec, int n) {
    __shared__ float scratch[32];
    const GdnSpec p = *spec;
    const int c = blockIdx.x * p.head_k + threadIdx.x, t = blockIdx.y;
    const float* conv_state = reinterpret_cast<const float*>(p.sess[2 * p.layer_slot]);
    const float* w = p.conv_w + (i64)c * p.K;
    const int key_dim = p.n_k * p.head_k;
    const bool is_q = c < key_dim, is_k = !is_q && c < 2 * key_dim;   // uniform over the block
    // the window [x_{t-K+1} .. x_t], oldest first; a negative row is the state's (its K - 1
    // values are the inputs before the chunk), as gdn_conv_channel sums it
    float acc = 0.f;
    for (int j = 0; j < p.K; ++j) {
        const int at = t + j - (p.K - 1);
        const float x = at < 0 ? conv_state[(i64)(at + p.K - 1) * p.conv_dim + c]
                               : p.qkv[(i64)at * p.conv_dim + c];
        acc += x * w[j];
    }
    float m = gdn_silu(acc);
    if (is_q || is_k) {
        const float ss = gdn_block_sum(m * m, scratch);
        m = m / sqrtf(ss + GDN_L2_EPS) * (is_q ? rsqrtf((float)p.head_k) : 1.f);
    }
    p.mixed[(i64)t * p.conv_dim + c] = m;
}

// Grid (ceil(conv_dim / blockDim.x)): each channel's conv state after the chunk's n rows, the
// last K - 1 inputs (some of the old state's where n < K - 1). Launched after gdn_conv_rows,
// which reads the old state; a thread reads all its values before it writes any.
extern "C" __global__ void gdn_conv_tail(const GdnSpec* __restrict__ spec, int n) {
    const GdnSpec p = *spec;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.conv_dim) return;
    float* conv_state = reinterpret_cast<float*>(p.sess[2 * p.layer_slot]);
    float keep[GDN_MAX_K - 1];
    #pragma unroll
    for (int j = 0; j < GDN_MAX_K - 1; ++j) {
        const int at = n + j - (p.K - 1);
        if (j < p.K - 1)
            keep[j] = at < 0 ? conv_state[(i64)(at + p.K - 1) * p.conv_dim + c]
                             : p.qkv[(i64)at * p.conv_dim + c];
    }
    #pragma unroll
    for (int j = 0; j < GDN_MAX_K - 1; ++j)
        if (j < p.K - 1) conv_state[(i64)j * p.conv_dim + c] = keep[j];
}

// A warp's state column (value head h, column j): lane l holds rows l, l + 32, .. of it (rl of
// them, head_k / 32) in registers, read once before a chunk's rows and written once after.
__device__ __forceinline__ float* gdn_state_column(const GdnSpec& p, int h, int j) {
    return reinterpret_cast<float*>(p.sess[2 * p.layer_slot + 1]) + (i64)h * p.head_k * p.head_v
           + j;
}

__device__ __forceinline__ void gdn_column_load(float (&s)[GDN_LANE_ROWS], const float* column,
                                                int head_v, int rl, int lane) {
    #pragma unroll
    for (int m = 0; m < GDN_LANE_ROWS; ++m)
        s[m] = m < rl ? column[(i64)(lane + 32 * m) * head_v] : 0.f;
}

__device__ __forceinline__ void gdn_column_store(const float (&s)[GDN_LANE_ROWS], float* column,
                                                 int head_v, int rl, int lane) {
    #pragma unroll
    for (int m = 0; m < GDN_LANE_ROWS; ++m)
        if (m < rl) column[(i64)(lane + 32 * m) * head_v] = s[m];
}

// One row of the delta rule on a warp's state column, q and k the lane's rows of the row's
// (q[m] is row lane + 32 m): S <- exp(g) S; kv = S^T k; S <- S + k (beta (v - kv))^T; returns
// o = S^T q (the warp's sum, in every lane), as gdn_delta_step.
__device__ __forceinline__ float gdn_column_row(float (&s)[GDN_LANE_ROWS], int rl,
                                                const float (&q)[GDN_LANE_ROWS],
                                                const float (&k)[GDN_LANE_ROWS], float v, float b,
                                                float a, float ssm_a, float dt) {
    float beta, gexp;
    gdn_gates(b, a, ssm_a, dt, beta, gexp);
    float kv = 0.f;
    #pragma unroll
    for (int m = 0; m < GDN_LANE_ROWS; ++m)
        if (m < rl) kv += s[m] * gexp * k[m];
    kv = warp_sum(kv);
    const float delta = (v - kv) * beta;
    float o = 0.f;
    #pragma unroll
    for (int m = 0; m < GDN_LANE_ROWS; ++m) {
        if (m < rl) {
            s[m] = s[m] * gexp + k[m] * delta;
            o += s[m] * q[m];
        }
    }
    return warp_sum(o);
}

// One row's inputs to a column's delta rule, as a lane reads them.
struct GdnRowInputs {
    float q[GDN_LANE_ROWS], k[GDN_LANE_ROWS], v, b, a;
};

__device__ __forceinline__ void gdn_load_row(GdnRowInputs& in, const GdnSpec& p, int t, int rl,
                                             const float* qk, int key_dim, const float* vj,
                                             const float* bap, int ba_stride, int r) {
    const float* row = qk + (i64)t * p.conv_dim;
    #pragma unroll
    for (int m = 0; m < GDN_LANE_ROWS; ++m) {
        if (m < rl) {
            in.q[m] = row[32 * m];
            in.k[m] = row[key_dim + 32 * m];
        }
    }
    in.v = vj[(i64)t * p.conv_dim];
    in.b = bap[(i64)t * ba_stride];
    in.a = bap[(i64)t * ba_stride + r];
}

// Grid (ceil(n_v head_v / GDN_COLUMNS_PER_BLOCK)), GDN_COLUMNS_PER_BLOCK warps a block: warp w
// of block x is state column x GDN_COLUMNS_PER_BLOCK + w of all value heads' (head h, column j),
// the chunk's rows through gdn_column_row in order.
extern "C" __global__ void __launch_bounds__(32 * GDN_COLUMNS_PER_BLOCK) gdn_delta_rows(
        const GdnSpec* __restrict__ spec, int n) {
    const GdnSpec p = *spec;
    const int lane = threadIdx.x & 31;
    const int col = blockIdx.x * GDN_COLUMNS_PER_BLOCK + (threadIdx.x >> 5);
    if (col >= p.n_v * p.head_v) return;                // a whole warp: no shuffle is left short
    const int h = col / p.head_v, j = col % p.head_v, r = p.n_v / p.n_k, kh = h / r;
    const int key_dim = p.n_k * p.head_k, value_dim = p.n_v * p.head_v, rl = p.head_k >> 5;
    float* column = gdn_state_column(p, h, j);
    float s[GDN_LANE_ROWS];
    gdn_column_load(s, column, p.head_v, rl, lane);
    const float ssm_a = p.ssm_a[h], dt = p.ssm_dt[h];
    const float* qk = p.mixed + kh * p.head_k + lane;  // q of the key head; k key_dim further
    const float* vj = p.mixed + 2 * key_dim + h * p.head_v + j;
    const int ba_stride = p.n_k * 2 * r;               // per key head r b, then r a
    const float* bap = p.ba + kh * 2 * r + h % r;
    GdnRowInputs cur, next;
    if (n > 0) gdn_load_row(cur, p, 0, rl, qk, key_dim, vj, bap, ba_stride, r);
    for (int t = 0; t < n; ++t) {
        // the next row's loads issued first: they do not depend on the state
        gdn_load_row(next, p, min(t + 1, n - 1), rl, qk, key_dim, vj, bap, ba_stride, r);
        const float o = gdn_column_row(s, rl, cur.q, cur.k, cur.v, cur.b, cur.a, ssm_a, dt);
        if (lane == 0) p.out[(i64)t * value_dim + h * p.head_v + j] = o;
        cur = next;
    }
    gdn_column_store(s, column, p.head_v, rl, lane);
}

// Grid (n_v, n), block head_v threads: row blockIdx.y of value head blockIdx.x,
// out = o / sqrt(mean(o^2) + eps) * ssm_norm * SiLU(z), in place over gdn_delta_rows' o.
extern "C" __global__ void gdn_gated_norm_rows(const GdnSpec* __restrict__ spec, int n) {
    __shared__ float scratch[32];
    const GdnSpec p = *spec;
    const int h = blockIdx.x, t = blockIdx.y, j = threadIdx.x;
    const i64 at = (i64)t * p.n_v * p.head_v + h * p.head_v + j;
    const float o = p.out[at];
    const float ss = gdn_block_sum(o * o, scratch);
    p.out[at] = o / sqrtf(ss / (float)p.head_v + p.eps) * p.norm_w[j] * gdn_silu(p.z[at]);
}
