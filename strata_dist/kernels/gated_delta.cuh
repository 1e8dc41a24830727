// The Gated DeltaNet mixer of a qwen3next decode step (included by decode.cu), between its input
// matvecs (attn_qkv, attn_gate, ssm_ba) and its output matvec (ssm_out), in two launches:
//
//   gdn_conv_step   the causal depthwise convolution of each channel over its conv state, SiLU,
//                   and the L2 norm of every q and k head (q also scaled by 1/sqrt(head_k)): one
//                   block a head of head_k channels, one thread a channel; the thread that reads a
//                   channel's state is the one that shifts it, so no block waits on another.
//   gdn_delta_step  the gated delta rule on each value head's state [head_k, head_v] and the gated
//                   RMSNorm of its output: one block a value head; thread (g, j) holds rows
//                   [g R, (g + 1) R) of state column j in registers (R = GDN_ROWS; the columns
//                   of a head are independent given q and k), so the state is read and written
//                   once a step,
//                   all of a block's loads in flight together, and the R-row partial sums of a
//                   column meet in shared memory in g order.
//
// The rows of one step are consecutive positions of one session, so both take them in order. The
// arithmetic is models/qwen3next.py's (`_linear_attention`) and models/delta_rule.py's
// `gated_delta_steps`, in the same order per value; the per-value steps are HOST_DEVICE functions
// so that tests/test_kernels_compile.py runs them on the host against that numpy reference.
#pragma once

#define GDN_L2_EPS 1e-6f     // the q/k L2 norm's epsilon (models/qwen3next.py L2_EPS)

// One linear layer's pointers and sizes (kernels/abi.py GDN_SPEC). Its state is the bound
// session's, read through the decode graph's pointer table as K and V are (cuda_decode.py
// `_bind`): a linear layer's two entries are its conv state and its recurrent state, so one
// captured graph serves every session.
struct GdnSpec {
    const float* qkv;         // [n, conv_dim] attn_qkv's rows: q of every key head | k | v
    const float* z;           // [n, n_v * head_v] attn_gate's rows
    const float* ba;          // [n, n_k * 2r] ssm_ba's rows: per key head r b, then r a
    const float* conv_w;      // [conv_dim, K] ssm_conv1d
    const float* ssm_a;       // [n_v] -exp(A_log)
    const float* ssm_dt;      // [n_v] the dt bias
    const float* norm_w;      // [head_v] ssm_norm
    float* mixed;             // [n, conv_dim] the convolved rows (q and k normalised)
    float* out;               // [n, n_v * head_v] the gated-normed output, ssm_out's input
    const u64* sess;          // the pointer table: [2 layer_slot] the conv state [K - 1, conv_dim]
                              // (the last K - 1 inputs), [2 layer_slot + 1] the recurrent state
                              // [n_v, head_k, head_v]; both updated in place
    int layer_slot, n_k, n_v, head_k, head_v, conv_dim, K;
    float eps;                // the gated RMSNorm's
};

// the backends' forms (backends/base.py): sigmoid through tanh, SiLU as x sigmoid(x)
HOST_DEVICE float gdn_sigmoid(float x) { return 0.5f * tanhf(0.5f * x) + 0.5f; }
HOST_DEVICE float gdn_silu(float x) { return x * gdn_sigmoid(x); }
// log(1 + e^x) as numpy's logaddexp(0, x) computes it: max + log1p(exp(-|x|))
HOST_DEVICE float gdn_softplus(float x) { return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x))); }

// One channel of one row: acc = sum_j window[j] w[j] over [its K - 1 state values | x], then the
// state shifts by one (the oldest input drops out). Returns SiLU(acc).
HOST_DEVICE float gdn_conv_channel(float* state, int stride, const float* w, float x, int K) {
    float acc = 0.f;
    for (int j = 0; j < K - 1; ++j) acc += state[(long long)j * stride] * w[j];
    acc += x * w[K - 1];
    for (int j = 0; j + 1 < K - 1; ++j) state[(long long)j * stride] = state[(long long)(j + 1) * stride];
    if (K > 1) state[(long long)(K - 2) * stride] = x;
    return gdn_silu(acc);
}

// A value head's gates for one row: beta = sigmoid(b), exp(g) with g = ssm_a * softplus(a + dt)
HOST_DEVICE void gdn_gates(float b, float a, float ssm_a, float dt, float& beta, float& gexp) {
    beta = gdn_sigmoid(b);
    gexp = expf(ssm_a * gdn_softplus(a + dt));
}

// The rows of a state column one thread of gdn_delta_step holds: a block of head_k head_v / 16
// threads (at most 1,024), so heads of up to 16,384 state values (Qwen3-Next: 128 x 128).
#define GDN_ROWS 16

// One row's delta rule on R rows of a state column s (values S[i, j], i in [i0, i0 + R)), in two
// steps, since kv needs all of the column's rows between them:
//   gdn_decay_dot:   the part of kv_j = sum_i exp(g) S[i, j] k[i] over these rows;
//   gdn_rows_update: S[i, j] <- exp(g) S[i, j] + k[i] delta_j, returning this part of
//                    o_j = sum_i S[i, j] q[i];
// with delta_j = beta (v_j - kv_j) between them: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T;
// o = S^T q, as models/delta_rule.py's gated_delta_steps.
template <int R>
HOST_DEVICE float gdn_decay_dot(const float (&s)[R], float gexp, const float* k) {
    float kv = 0.f;
    #pragma unroll
    for (int i = 0; i < R; ++i) kv += s[i] * gexp * k[i];
    return kv;
}

template <int R>
HOST_DEVICE float gdn_rows_update(float (&s)[R], float gexp, const float* k, float delta,
                                  const float* q) {
    float o = 0.f;
    #pragma unroll
    for (int i = 0; i < R; ++i) {
        s[i] = s[i] * gexp + k[i] * delta;
        o += s[i] * q[i];
    }
    return o;
}

// Sum of v over the block (blockDim.x a multiple of 32, <= 1024), in every thread.
__device__ __forceinline__ float gdn_block_sum(float v, float* scratch) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    __syncthreads();                            // scratch free from any earlier call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    return total;
}

// Grid (conv_dim / head_k), block head_k threads: block b holds channels [b head_k, (b+1) head_k);
// the blocks of the q and k parts are each one head, normalised here.
extern "C" __global__ void gdn_conv_step(const GdnSpec* __restrict__ spec, int n) {
    pdl_entry();
    __shared__ float scratch[32];
    const GdnSpec p = *spec;
    const int c = blockIdx.x * p.head_k + threadIdx.x;
    float* conv_state = reinterpret_cast<float*>(p.sess[2 * p.layer_slot]);
    const int key_dim = p.n_k * p.head_k;
    const bool is_q = c < key_dim, is_k = !is_q && c < 2 * key_dim;   // uniform over the block
    const float scale = is_q ? rsqrtf((float)p.head_k) : 1.f;
    for (int t = 0; t < n; ++t) {
        float m = gdn_conv_channel(conv_state + c, p.conv_dim, p.conv_w + (long long)c * p.K,
                                   p.qkv[(long long)t * p.conv_dim + c], p.K);
        if (is_q || is_k) {
            const float ss = gdn_block_sum(m * m, scratch);
            m = m / sqrtf(ss + GDN_L2_EPS) * scale;
        }
        p.mixed[(long long)t * p.conv_dim + c] = m;
    }
}

// Grid (n_v), block head_k head_v / R threads (thread j + head_v g: column j, rows [g R, (g+1) R));
// shared memory 2 head_k floats (q and k of the row) and head_k head_v / R partial sums.
template <int R>
__device__ __forceinline__ void gdn_delta_body(const GdnSpec p, int n) {
    extern __shared__ float smem[];
    __shared__ float scratch[32];
    const int h = blockIdx.x, r = p.n_v / p.n_k, kh = h / r;
    const int j = threadIdx.x % p.head_v, grp = threadIdx.x / p.head_v, groups = p.head_k / R;
    const int key_dim = p.n_k * p.head_k, value_dim = p.n_v * p.head_v;
    float* q = smem;
    float* k = smem + p.head_k;
    float* part = smem + 2 * p.head_k;          // [groups, head_v]
    float* state = reinterpret_cast<float*>(p.sess[2 * p.layer_slot + 1]);
    float* col = state + (long long)h * p.head_k * p.head_v + (long long)grp * R * p.head_v + j;
    float s[R];
    #pragma unroll
    for (int i = 0; i < R; ++i) s[i] = col[(long long)i * p.head_v];
    for (int t = 0; t < n; ++t) {
        const float* row = p.mixed + (long long)t * p.conv_dim;
        __syncthreads();                        // the previous row's q, k and partials are read
        for (int i = threadIdx.x; i < p.head_k; i += blockDim.x) {
            q[i] = row[kh * p.head_k + i];
            k[i] = row[key_dim + kh * p.head_k + i];
        }
        __syncthreads();
        const float* ba = p.ba + (long long)t * p.n_k * 2 * r + kh * 2 * r;
        float beta, gexp;
        gdn_gates(ba[h % r], ba[r + h % r], p.ssm_a[h], p.ssm_dt[h], beta, gexp);
        part[grp * p.head_v + j] = gdn_decay_dot<R>(s, gexp, k + grp * R);
        __syncthreads();
        float kv = 0.f;
        for (int g = 0; g < groups; ++g) kv += part[g * p.head_v + j];
        const float delta = (row[2 * key_dim + h * p.head_v + j] - kv) * beta;
        const float o_part = gdn_rows_update<R>(s, gexp, k + grp * R, delta, q + grp * R);
        __syncthreads();                        // every kv read before part is reused
        part[grp * p.head_v + j] = o_part;
        __syncthreads();
        float o = 0.f;
        for (int g = 0; g < groups; ++g) o += part[g * p.head_v + j];
        // the gated RMSNorm over the head's head_v outputs (every group holds them all: group 0's
        // are summed)
        const float ss = gdn_block_sum(grp == 0 ? o * o : 0.f, scratch);
        if (grp == 0) {
            const long long at = (long long)t * value_dim + h * p.head_v + j;
            p.out[at] = o / sqrtf(ss / (float)p.head_v + p.eps) * p.norm_w[j] * gdn_silu(p.z[at]);
        }
    }
    #pragma unroll
    for (int i = 0; i < R; ++i) col[(long long)i * p.head_v] = s[i];
}

extern "C" __global__ void __launch_bounds__(1024) gdn_delta_step(const GdnSpec* __restrict__ spec,
                                                                   int n) {
    pdl_entry();
    gdn_delta_body<GDN_ROWS>(*spec, n);
}
