// strata-dist decode kernels: one token (or up to MAX_ROWS rows) through a qwen3moe stage.
//
// Weights are read in the file's stored block format (F32, F16, Q8_0, Q4_K, Q5_K, Q6_K);
// activations are float32. Every kernel computes a row's result with one fixed reduction order
// (lanes over 32-element groups in group order, then a fixed xor-shuffle tree), whatever the
// number of rows in the launch: a row's bits do not depend on its neighbours (batch invariance).
//
// Positions and token ids are read from a device descriptor (`desc`), and the session's KV and
// RoPE tables through a device pointer table (`sess`), so a captured CUDA graph replays for any
// position and any session of the same shape.
#include <cuda_fp16.h>

// NVRTC has no <math.h>: the one constant we need from it
#define INF_F32 __int_as_float(0x7f800000)

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define MAX_ROWS 8          // rows of one decode step (plan.pricing.DECODE_ROWS)
#define ATTN_CHUNK 256      // the most keys per attention split (one block each)

// GGML type ids, as in the GGUF file
#define T_F32 0
#define T_F16 1
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14

// desc: [0] position of the first row, [1] rows, [2 .. 2+MAX_ROWS) token ids
#define DESC_POS 0
#define DESC_TOKENS 2

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float h2f(u16 bits) { return __half2float(__ushort_as_half(bits)); }

// ---- the 32 weights of group g of a row, decoded exactly as gguf-py decodes them -------------
__device__ __forceinline__ void k_scale_min(const u8* sc, int j, int& s, int& m) {
    if (j < 4) { s = sc[j] & 63; m = sc[j + 4] & 63; }
    else {
        s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

template <int T>
__device__ __forceinline__ void group32(const u8* __restrict__ row, int g, float* w) {
    if (T == T_F32) {
        const float4* p = reinterpret_cast<const float4*>(row + (i64)g * 128);
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            float4 v = __ldg(p + j);
            w[4 * j] = v.x; w[4 * j + 1] = v.y; w[4 * j + 2] = v.z; w[4 * j + 3] = v.w;
        }
    } else if (T == T_F16) {
        const uint4* p = reinterpret_cast<const uint4*>(row + (i64)g * 64);
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint4 v = __ldg(p + j);
            u32 parts[4] = {v.x, v.y, v.z, v.w};
            #pragma unroll
            for (int t = 0; t < 4; ++t) {
                w[8 * j + 2 * t] = h2f((u16)(parts[t] & 0xFFFF));
                w[8 * j + 2 * t + 1] = h2f((u16)(parts[t] >> 16));
            }
        }
    } else if (T == T_Q8_0) {
        // 34-byte block: f16 d, 32 int8 quants (2-byte aligned only)
        const u16* p = reinterpret_cast<const u16*>(row + (i64)g * 34);
        float d = h2f(__ldg(p));
        #pragma unroll
        for (int j = 0; j < 16; ++j) {
            u16 v = __ldg(p + 1 + j);
            w[2 * j] = d * (float)(signed char)(v & 0xFF);
            w[2 * j + 1] = d * (float)(signed char)(v >> 8);
        }
    } else if (T == T_Q4_K || T == T_Q5_K) {
        // super-block of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, [Q5_K: 32 bytes of
        // high bits], 128 bytes of nibbles; sub-block j holds the low (j even) or high nibbles of
        // bytes 32*(j/2) .. +32
        const int bytes = (T == T_Q4_K) ? 144 : 176;
        const u8* b = row + (i64)(g >> 3) * bytes;
        const int j = g & 7;
        float d = h2f(__ldg(reinterpret_cast<const u16*>(b)));
        float dmin = h2f(__ldg(reinterpret_cast<const u16*>(b) + 1));
        int s, m;
        k_scale_min(b + 4, j, s, m);
        const float ds = d * (float)s, dm = dmin * (float)m;
        const u8* qs = b + ((T == T_Q4_K) ? 16 : 48) + 32 * (j >> 1);
        const int shift = (j & 1) * 4;
        const uint4* q4 = reinterpret_cast<const uint4*>(qs);
        uint4 lo = __ldg(q4), hi = __ldg(q4 + 1);
        u32 words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        u32 hw[8];
        if (T == T_Q5_K) {
            const uint4* h4 = reinterpret_cast<const uint4*>(b + 16);
            uint4 a = __ldg(h4), c = __ldg(h4 + 1);
            hw[0] = a.x; hw[1] = a.y; hw[2] = a.z; hw[3] = a.w;
            hw[4] = c.x; hw[5] = c.y; hw[6] = c.z; hw[7] = c.w;
        }
        #pragma unroll
        for (int l = 0; l < 32; ++l) {
            int q = (words[l >> 2] >> (8 * (l & 3) + shift)) & 0xF;
            if (T == T_Q5_K) q += ((hw[l >> 2] >> (8 * (l & 3) + j)) & 1) << 4;
            w[l] = ds * (float)q - dm;
        }
    } else if (T == T_Q6_K) {
        // 210 bytes: ql[128], qh[64], int8 scales[16], f16 d (2-byte aligned only)
        const u8* b = row + (i64)(g >> 3) * 210;
        const int gi = g & 7, h = gi >> 2, t = gi & 3;
        const u16* ql = reinterpret_cast<const u16*>(b + 64 * h + 32 * (t & 1));
        const u16* qh = reinterpret_cast<const u16*>(b + 128 + 32 * h);
        const signed char* sc = reinterpret_cast<const signed char*>(b + 192) + 8 * h + 2 * t;
        const float d = h2f(__ldg(reinterpret_cast<const u16*>(b + 208)));
        const float d0 = d * (float)sc[0], d1 = d * (float)sc[1];
        const int nshift = (t >> 1) * 4, hshift = 2 * t;
        #pragma unroll
        for (int j = 0; j < 16; ++j) {
            u16 lv = __ldg(ql + j), hv = __ldg(qh + j);
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                int l = 2 * j + e;
                int lo = ((lv >> (8 * e)) >> nshift) & 0xF;
                int hb = ((hv >> (8 * e)) >> hshift) & 3;
                w[l] = (l < 16 ? d0 : d1) * (float)((lo | (hb << 4)) - 32);
            }
        }
    }
}

// Dot products of one weight row with up to MAX_ROWS activation rows; each lane takes groups
// lane, lane+32, ... in order, then one fixed reduction tree. `scale` (per row) multiplies x
// elementwise when given (a fused RMSNorm weight).
template <int T>
__device__ __forceinline__ void row_dots(const u8* __restrict__ wrow, int ncols,
                                         const float* __restrict__ x, int x_stride, int n,
                                         const float* __restrict__ xw, float* acc) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int i = 0; i < MAX_ROWS; ++i) acc[i] = 0.f;
    #pragma unroll 2
    for (int g = lane; g < (ncols >> 5); g += 32) {
        float w[32];
        group32<T>(wrow, g, w);
        if (xw != nullptr) {
            const float4* wp = reinterpret_cast<const float4*>(xw + 32 * g);
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
                float4 v = __ldg(wp + j);
                w[4 * j] *= v.x; w[4 * j + 1] *= v.y; w[4 * j + 2] *= v.z; w[4 * j + 3] *= v.w;
            }
        }
        #pragma unroll
        for (int i = 0; i < MAX_ROWS; ++i) {
            if (i < n) {
                const float4* xp = reinterpret_cast<const float4*>(x + (i64)i * x_stride + 32 * g);
                float a = acc[i];
                #pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float4 v = __ldg(xp + j);
                    a += w[4 * j] * v.x; a += w[4 * j + 1] * v.y;
                    a += w[4 * j + 2] * v.z; a += w[4 * j + 3] * v.w;
                }
                acc[i] = a;
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < MAX_ROWS; ++i) if (i < n) acc[i] = warp_sum(acc[i]);
}

// One lane's share of a dot product: groups sub, sub+stride, ... of one row (the caller reduces
// over the `stride` lanes with a fixed tree).
template <int T>
__device__ __forceinline__ float lane_dot(const u8* __restrict__ wrow, int ncols,
                                          const float* __restrict__ x, int sub, int stride) {
    float acc = 0.f;
    #pragma unroll 3
    for (int g = sub; g < (ncols >> 5); g += stride) {
        float w[32];
        group32<T>(wrow, g, w);
        const float4* xp = reinterpret_cast<const float4*>(x + 32 * g);
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            float4 v = __ldg(xp + j);
            acc += w[4 * j] * v.x; acc += w[4 * j + 1] * v.y;
            acc += w[4 * j + 2] * v.z; acc += w[4 * j + 3] * v.w;
        }
    }
    return acc;
}

// Two rows of the same type against one x (an expert's gate and up rows), lanes over groups.
template <int T>
__device__ __forceinline__ void pair_dot(const u8* __restrict__ a, const u8* __restrict__ b,
                                         int ncols, const float* __restrict__ x, float& da,
                                         float& db) {
    float sa = 0.f, sb = 0.f;
    #pragma unroll 2
    for (int g = threadIdx.x & 31; g < (ncols >> 5); g += 32) {
        float wa[32], wb[32];
        group32<T>(a, g, wa);
        group32<T>(b, g, wb);
        const float4* xp = reinterpret_cast<const float4*>(x + 32 * g);
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float4 v = __ldg(xp + j);
            sa += wa[4 * j] * v.x; sa += wa[4 * j + 1] * v.y;
            sa += wa[4 * j + 2] * v.z; sa += wa[4 * j + 3] * v.w;
            sb += wb[4 * j] * v.x; sb += wb[4 * j + 1] * v.y;
            sb += wb[4 * j + 2] * v.z; sb += wb[4 * j + 3] * v.w;
        }
    }
    da = sa;
    db = sb;
}

#define DISPATCH_TYPE(type, CALL)                                    \
    switch (type) {                                                  \
        case T_F32: { const int TT = T_F32; CALL; } break;           \
        case T_F16: { const int TT = T_F16; CALL; } break;           \
        case T_Q8_0: { const int TT = T_Q8_0; CALL; } break;         \
        case T_Q4_K: { const int TT = T_Q4_K; CALL; } break;         \
        case T_Q5_K: { const int TT = T_Q5_K; CALL; } break;         \
        case T_Q6_K: { const int TT = T_Q6_K; CALL; } break;         \
        default: break;                                              \
    }

// 1 / rms of each of the n rows of x, computed by the whole block (float4 loads, a fixed
// reduction order) and shared with every thread through `inv`.
__device__ void block_inv_rms(const float* __restrict__ x, int x_stride, int ncols, int n,
                              float eps, float* inv /* shared [MAX_ROWS] */) {
    __shared__ float part[MAX_ROWS][32];
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (int i = 0; i < n; ++i) {
        float s = 0.f;
        for (int c = 4 * threadIdx.x; c < ncols; c += 4 * blockDim.x) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(x + (i64)i * x_stride + c));
            s += v.x * v.x; s += v.y * v.y; s += v.z * v.z; s += v.w * v.w;
        }
        s = warp_sum(s);
        if (lane == 0) part[i][warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        for (int i = 0; i < n; ++i) {
            float s = warp_sum(lane < nwarps ? part[i][lane] : 0.f);
            if (lane == 0) inv[i] = rsqrtf(s / (float)ncols + eps);
        }
    }
    __syncthreads();
}

// ---- dense projections ------------------------------------------------------------------------
// One spec per matrix; blockIdx.y picks the spec, so q, k and v are one launch.
struct MatSpec {
    const u8* w;          // [nrows, ncols] in `type`
    float* y;             // [n, y_stride]
    const float* add;     // residual added to y (may alias y), or null
    i64 row_bytes;
    int nrows, ncols, y_stride, type;
};

// y[i, o] = add[i, o] + sum_c W[o, c] * xn[i, c], with xn = rms_norm(x) * norm_w when norm_w is
// given (else x). One warp per output row. Block (0, 0) also writes xn to `normed` when given.
extern "C" __global__ void __launch_bounds__(256, 2) matvec(const MatSpec* __restrict__ specs, const float* __restrict__ x,
                                  int x_stride, int n, const float* __restrict__ norm_w, float eps,
                                  float* __restrict__ normed) {
    __shared__ float inv[MAX_ROWS];
    const MatSpec s = specs[blockIdx.y];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + warp;
    if (norm_w != nullptr) {
        if ((int)(blockIdx.x * (blockDim.x >> 5)) >= s.nrows) return;   // whole block idle
        block_inv_rms(x, x_stride, s.ncols, n, eps, inv);
        if (normed != nullptr && blockIdx.x == 0 && blockIdx.y == 0) {
            for (int idx = threadIdx.x; idx < n * s.ncols; idx += blockDim.x) {
                int i = idx / s.ncols, c = idx - i * s.ncols;
                normed[(i64)i * s.ncols + c] = x[(i64)i * x_stride + c] * inv[i] * norm_w[c];
            }
        }
    }
    if (o >= s.nrows) return;
    float acc[MAX_ROWS];
    const u8* wrow = s.w + (i64)o * s.row_bytes;
    DISPATCH_TYPE(s.type, (row_dots<TT>(wrow, s.ncols, x, x_stride, n, norm_w, acc)));
    if (lane == 0) {
        #pragma unroll
        for (int i = 0; i < MAX_ROWS; ++i) {
            if (i < n) {
                const float v = norm_w != nullptr ? acc[i] * inv[i] : acc[i];
                const i64 at = (i64)i * s.y_stride + o;
                s.y[at] = (s.add != nullptr ? s.add[at] : 0.f) + v;
            }
        }
    }
}

// Rows of any supported type decoded to float32 (embedding lookups on the fast path, and the
// correctness path's dequantize). rows: the row indices, or null for rows 0..nrows-1.
extern "C" __global__ void dequant_rows(const u8* __restrict__ src, int type, i64 row_bytes,
                                        int ncols, const int* __restrict__ rows, int nrows,
                                        float* __restrict__ dst) {
    const i64 groups = (i64)nrows * (ncols >> 5);
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < groups;
         t += (i64)gridDim.x * blockDim.x) {
        int r = (int)(t / (ncols >> 5)), g = (int)(t - (i64)r * (ncols >> 5));
        const u8* row = src + (i64)(rows != nullptr ? rows[r] : r) * row_bytes;
        float w[32];
        DISPATCH_TYPE(type, (group32<TT>(row, g, w)));
        float* out = dst + (i64)r * ncols + 32 * g;
        #pragma unroll
        for (int l = 0; l < 32; ++l) out[l] = w[l];
    }
}

// The first stage's rows: embedding rows of the descriptor's token ids.
extern "C" __global__ void embed_tokens(const u8* __restrict__ table, int type, i64 row_bytes,
                                        int ncols, const int* __restrict__ desc,
                                        float* __restrict__ h) {
    const int i = blockIdx.y;
    const u8* row = table + (i64)desc[DESC_TOKENS + i] * row_bytes;
    for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < (ncols >> 5); g += gridDim.x * blockDim.x) {
        float w[32];
        DISPATCH_TYPE(type, (group32<TT>(row, g, w)));
        #pragma unroll
        for (int l = 0; l < 32; ++l) h[(i64)i * ncols + 32 * g + l] = w[l];
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
    for (int idx = t; idx < G * D; idx += blockDim.x)
        qs[idx] = q[((i64)i * n_head + kvh * G) * D + idx];
    __syncthreads();
    // scores: one key per thread, its row in registers, q read four at a time
    if (t < count) {
        const uint4* kp = reinterpret_cast<const uint4*>(kc + ((i64)(start + t) * n_kv + kvh) * D);
        float kf[D];
        #pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            uint4 raw = __ldg(kp + j);
            const __half2* h2 = reinterpret_cast<const __half2*>(&raw);
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                float2 f = __half22float2(h2[e]);
                kf[8 * j + 2 * e] = f.x; kf[8 * j + 2 * e + 1] = f.y;
            }
        }
        for (int g = 0; g < G; ++g) {
            const float4* q4 = reinterpret_cast<const float4*>(qs + g * D);
            float s = 0.f;
            #pragma unroll
            for (int d = 0; d < D / 4; ++d) {
                const float4 qv = q4[d];
                s += qv.x * kf[4 * d]; s += qv.y * kf[4 * d + 1];
                s += qv.z * kf[4 * d + 2]; s += qv.w * kf[4 * d + 3];
            }
            ps[g * ATTN_CHUNK + t] = s * scale;
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
    const int KQ = blockDim.x / PAIRS, dp = t % PAIRS, kq = t / PAIRS;
    float2 acc[MAX_G];
    #pragma unroll
    for (int g = 0; g < MAX_G; ++g) acc[g] = make_float2(0.f, 0.f);
    const __half2* vp = reinterpret_cast<const __half2*>(vc + ((i64)start * n_kv + kvh) * D) + dp;
    const i64 vstride = (i64)n_kv * PAIRS;
    #pragma unroll 4
    for (int c = kq; c < count; c += KQ) {
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

extern "C" __global__ void attn_partial_128(const float* q, const u64* sess, int layer_slot,
                                            const int* desc, int n_head, int n_kv, int n_split,
                                            int chunk, float scale, float* part, float* ml) {
    attn_partial_body<128>(q, sess, layer_slot, desc, n_head, n_kv, n_split, chunk, scale, part,
                           ml);
}

// Flash-decoding, second half: the splits of one (row, head) combined in split order.
extern "C" __global__ void attn_combine(const float* __restrict__ part,
                                        const float* __restrict__ ml,
                                        const int* __restrict__ desc, int n_head, int n_split,
                                        int chunk, int D, float* __restrict__ out) {
    const int i = blockIdx.y, h = blockIdx.x;
    const int len = desc[DESC_POS] + i + 1;
    const int used = (len + chunk - 1) / chunk;
    const i64 base = ((i64)i * n_head + h) * n_split;
    float m = -INF_F32;
    for (int s = 0; s < used; ++s) m = fmaxf(m, ml[2 * (base + s)]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.f, den = 0.f;
        for (int s = 0; s < used; ++s) {
            const float w = __expf(ml[2 * (base + s)] - m);
            num += w * part[(base + s) * D + d];
            den += w * ml[2 * (base + s) + 1];
        }
        out[((i64)i * n_head + h) * D + d] = num / den;
    }
}

// ---- routing and experts ----------------------------------------------------------------------
// Where a layer's experts are: blob = arena + offsets[slot_of[expert]], gate rows then up rows
// then down rows, each part in its stored type.
struct ExpertSpec {
    const u8* arena;
    const i64* offsets;       // byte offset of each slot
    const int* slot_of;       // [n_expert] slot of each expert of this layer
    i64 up_at, down_at;       // byte offsets of the up and down parts inside a blob
    i64 gate_row_bytes, up_row_bytes, down_row_bytes;
    int gate_type, up_type, down_type;
    int n_ff, n_embd, k;
};

// Softmax over the router logits, the top-k in rank order (ties: the lower expert id, as a stable
// sort does), weights renormalised over the k when `normalize`, and each chosen expert's blob
// address (0 when it is not resident) for the expert kernels. One warp per row.
extern "C" __global__ void topk_route(const float* __restrict__ logits, int n_expert, int k,
                                      int normalize, const ExpertSpec* __restrict__ spec,
                                      int* __restrict__ ids, float* __restrict__ wts,
                                      u64* __restrict__ blobs) {
    const int i = blockIdx.x, lane = threadIdx.x;
    float v[16];
    const float* l = logits + (i64)i * n_expert;
    float m = -INF_F32;
    #pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int e = lane + 32 * j;
        v[j] = e < n_expert ? l[e] : -INF_F32;
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
        if (lane == 0) { ids[i * k + r] = best_e; wts[i * k + r] = p; }
        if ((best_e & 31) == lane) v[best_e >> 5] = -2.f;   // taken
    }
    __syncwarp();
    if (lane < k) {
        if (normalize) wts[i * k + lane] /= picked_sum;
        const int slot = spec->slot_of[ids[i * k + lane]];
        blobs[i * k + lane] = slot < 0 ? 0ull
                                       : reinterpret_cast<u64>(spec->arena + spec->offsets[slot]);
    }
}

// act[i, r, f] = silu(gate_e . x_i) * (up_e . x_i), e = ids[i, r]. One warp per f.
extern "C" __global__ void moe_gate_up(const ExpertSpec* __restrict__ spec_p,
                                       const float* __restrict__ x, const u64* __restrict__ blobs,
                                       float* __restrict__ act) {
    const ExpertSpec sp = *spec_p;
    const int f = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int r = blockIdx.y, i = blockIdx.z, lane = threadIdx.x & 31;
    if (f >= sp.n_ff) return;
    const u8* blob = reinterpret_cast<const u8*>(blobs[i * sp.k + r]);
    float out;
    if (blob == nullptr) {
        out = __int_as_float(0x7fc00000);    // not resident: the caller checked; NaN says loudly
    } else {
        const float* xi = x + (i64)i * sp.n_embd;
        const u8* grow = blob + (i64)f * sp.gate_row_bytes;
        const u8* urow = blob + sp.up_at + (i64)f * sp.up_row_bytes;
        float g, u;
        if (sp.gate_type == sp.up_type) {     // both rows' loads in flight together
            DISPATCH_TYPE(sp.gate_type, (pair_dot<TT>(grow, urow, sp.n_embd, xi, g, u)));
        } else {
            DISPATCH_TYPE(sp.gate_type, (g = lane_dot<TT>(grow, sp.n_embd, xi, lane, 32)));
            DISPATCH_TYPE(sp.up_type, (u = lane_dot<TT>(urow, sp.n_embd, xi, lane, 32)));
        }
        g = warp_sum(g);
        u = warp_sum(u);
        out = g / (1.f + __expf(-g)) * u;
    }
    if (lane == 0) act[((i64)i * sp.k + r) * sp.n_ff + f] = out;
}

// h[i, d] += sum over r in rank order of wts[i, r] * (down_e . act[i, r]). One warp per d: the
// warp's lanes are split among the k experts (lpe lanes each), so all k rows load at once; each
// expert's lanes reduce with a fixed tree, then lane 0 adds the k dots in rank order.
extern "C" __global__ void moe_down_combine(const ExpertSpec* __restrict__ spec_p,
                                            const float* __restrict__ act,
                                            const u64* __restrict__ blobs,
                                            const float* __restrict__ wts, float* __restrict__ h) {
    const ExpertSpec sp = *spec_p;
    const int d = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int i = blockIdx.y, lane = threadIdx.x & 31;
    if (d >= sp.n_embd) return;
    int lpe = 32;
    while (lpe * sp.k > 32) lpe >>= 1;
    const int r = lane / lpe, sub = lane - r * lpe;
    float dot = 0.f;
    if (r < sp.k) {
        const u8* blob = reinterpret_cast<const u8*>(blobs[i * sp.k + r]);
        if (blob == nullptr) {
            dot = __int_as_float(0x7fc00000);
        } else {
            const u8* row = blob + sp.down_at + (i64)d * sp.down_row_bytes;
            const float* a = act + ((i64)i * sp.k + r) * sp.n_ff;
            DISPATCH_TYPE(sp.down_type, (dot = lane_dot<TT>(row, sp.n_ff, a, sub, lpe)));
        }
    }
    for (int o = lpe >> 1; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    float total = 0.f;
    for (int rr = 0; rr < sp.k; ++rr)
        total += wts[i * sp.k + rr] * __shfl_sync(0xffffffffu, dot, rr * lpe);
    if (lane == 0) h[(i64)i * sp.n_embd + d] += total;
}

// ---- the token --------------------------------------------------------------------------------
// Greedy token of a logits row: the largest value, the lowest id on ties (numpy's argmax).
extern "C" __global__ void argmax_row(const float* __restrict__ logits, int n, int* __restrict__ out) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    float best = -INF_F32; int best_i = 0x7fffffff;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float v = logits[j];
        if (v > best) { best = v; best_i = j; }        // ascending j: first max kept
    }
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
        if (lane == 0) out[0] = best_i;
    }
}
