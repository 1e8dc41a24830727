// strata-dist prompt attention: the causal attention of a prompt chunk's rows over the session's
// f16 KV, flash style (tiles of keys in shared memory, an online softmax in registers, no score
// matrix in memory), on tensor cores (mma.sync m16n8k16: q and the softmax weights rounded to
// f16, every product accumulated in f32).
//
// Grid (ceil(n / 64), n_head), 128 DSPLIT threads: warp w of block b takes query rows
// 64 b + 16 (w % 4) .. +15 of head blockIdx.y against its kv head's keys 0 .. the block's last
// position, BN keys a tile, and writes the output dims [w / 4, w / 4 + 1) D / DSPLIT of them. A
// 256-wide head (qwen3next) is split over two warps so a warp's accumulators stay in registers;
// both compute the same scores (the same arithmetic, so the same softmax).
#include "weights.cuh"
#include "mma.cuh"

#define FA_BM 64          // query rows of a block (16 per warp)

// q [n, n_head, D] float32 at positions pos0 ..; k, v [cells, n_kv, D] f16 (keys 0 .. pos0 + n - 1
// valid); out [n, n_head, D] float32.
template <int D, int BN, int DSPLIT>
__device__ __forceinline__ void prefill_attention_body(
        const float* __restrict__ q, const __half* __restrict__ kc, const __half* __restrict__ vc,
        int n, int pos0, int n_head, int n_kv, float scale, float* __restrict__ out) {
    constexpr int KLD = D + 8;        // K tile row stride in halves (conflict-free fragment loads)
    constexpr int VLD = BN + 8;       // transposed V tile row stride in halves
    constexpr int DO = D / DSPLIT;    // output dims of one warp
    __shared__ __align__(16) __half ks[BN][KLD];
    __shared__ __align__(16) __half vt[D][VLD];    // V transposed: [dim][key]
    const int h = blockIdx.y, kvh = h / (n_head / n_kv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // the warp's rows and output dims (one warp a head: the four warps are the block's rows)
    const int r0 = blockIdx.x * FA_BM + (DSPLIT == 1 ? warp : warp % 4) * 16;
    const int d0 = DSPLIT == 1 ? 0 : (warp / 4) * DO;
    // this thread's two query rows (past n: the last row, computed and never written)
    const int ra = min(r0 + g, n - 1), rb = min(r0 + g + 8, n - 1);
    const int qpos_a = pos0 + ra, qpos_b = pos0 + rb;
    // the warp's 16 rows of q as A fragments, one per k16 step of the head
    unsigned qa[D / 16][4];
    {
        const float* qra = q + ((i64)ra * n_head + h) * D;
        const float* qrb = q + ((i64)rb * n_head + h) * D;
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const int d = 16 * kk + 2 * t;
            const float2 a0 = *reinterpret_cast<const float2*>(qra + d);
            const float2 a1 = *reinterpret_cast<const float2*>(qrb + d);
            const float2 a2 = *reinterpret_cast<const float2*>(qra + d + 8);
            const float2 a3 = *reinterpret_cast<const float2*>(qrb + d + 8);
            qa[kk][0] = pack_half2(a0.x, a0.y);
            qa[kk][1] = pack_half2(a1.x, a1.y);
            qa[kk][2] = pack_half2(a2.x, a2.y);
            qa[kk][3] = pack_half2(a3.x, a3.y);
        }
    }
    float o[DO / 8][4];
    #pragma unroll
    for (int i = 0; i < DO / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_a = -INF_F32, m_b = -INF_F32, l_a = 0.f, l_b = 0.f;
    const int last_key = pos0 + min(n, (int)(blockIdx.x + 1) * FA_BM) - 1;
    for (int k0 = 0; k0 <= last_key; k0 += BN) {
        __syncthreads();                                  // the last tile has been read
        for (int c = threadIdx.x; c < BN * (D / 8); c += blockDim.x) {
            const int key = c / (D / 8), d8 = 8 * (c % (D / 8));
            const i64 at = ((i64)min(k0 + key, last_key) * n_kv + kvh) * D + d8;
            *reinterpret_cast<uint4*>(&ks[key][d8]) = __ldg(reinterpret_cast<const uint4*>(kc + at));
            const uint4 vv = __ldg(reinterpret_cast<const uint4*>(vc + at));
            const __half* vh = reinterpret_cast<const __half*>(&vv);
            #pragma unroll
            for (int i = 0; i < 8; ++i) vt[d8 + i][key] = vh[i];
        }
        __syncthreads();
        // scores of the warp's 16 rows against the tile's BN keys (BN / 8 tiles of 8 keys)
        float s[BN / 8][4];
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const unsigned b0 = *reinterpret_cast<const unsigned*>(&ks[8 * j + g][16 * kk + 2 * t]);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(&ks[8 * j + g][16 * kk + 8 + 2 * t]);
                mma_16816(s[j], qa[kk], b0, b1);
            }
        }
        // causal mask, scale, the online softmax (a row's values live in the 4 lanes of a quad)
        float mx_a = m_a, mx_b = m_b;
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = k0 + 8 * j + 2 * t + e;
                s[j][e] = key <= qpos_a ? s[j][e] * scale : -INF_F32;
                s[j][2 + e] = key <= qpos_b ? s[j][2 + e] * scale : -INF_F32;
                mx_a = fmaxf(mx_a, s[j][e]);
                mx_b = fmaxf(mx_b, s[j][2 + e]);
            }
        }
        #pragma unroll
        for (int o2 = 1; o2 < 4; o2 <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, o2));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, o2));
        }
        // key 0 is in the first tile and every row sees it: the maxima are finite from there on
        const float ca = __expf(m_a - mx_a), cb = __expf(m_b - mx_b);
        m_a = mx_a;
        m_b = mx_b;
        float rs_a = 0.f, rs_b = 0.f;
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[j][e] = __expf(s[j][e] - m_a);
                s[j][2 + e] = __expf(s[j][2 + e] - m_b);
                rs_a += s[j][e];
                rs_b += s[j][2 + e];
            }
        }
        #pragma unroll
        for (int o2 = 1; o2 < 4; o2 <<= 1) {
            rs_a += __shfl_xor_sync(0xffffffffu, rs_a, o2);
            rs_b += __shfl_xor_sync(0xffffffffu, rs_b, o2);
        }
        l_a = l_a * ca + rs_a;
        l_b = l_b * cb + rs_b;
        #pragma unroll
        for (int i = 0; i < DO / 8; ++i) {
            o[i][0] *= ca; o[i][1] *= ca;
            o[i][2] *= cb; o[i][3] *= cb;
        }
        // o += p v: the score fragments of two adjacent 8-key tiles are the A fragment of 16 keys
        #pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const unsigned pa[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]),
                                    pack_half2(s[2 * kk][2], s[2 * kk][3]),
                                    pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            #pragma unroll
            for (int i = 0; i < DO / 8; ++i) {
                const unsigned b0 = *reinterpret_cast<const unsigned*>(&vt[d0 + 8 * i + g][16 * kk + 2 * t]);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(&vt[d0 + 8 * i + g][16 * kk + 8 + 2 * t]);
                mma_16816(o[i], pa, b0, b1);
            }
        }
    }
    const bool write_a = r0 + g < n, write_b = r0 + g + 8 < n;
    const float ia = 1.f / l_a, ib = 1.f / l_b;
    #pragma unroll
    for (int i = 0; i < DO / 8; ++i) {
        const int d = d0 + 8 * i + 2 * t;
        if (write_a)
            *reinterpret_cast<float2*>(out + ((i64)(r0 + g) * n_head + h) * D + d) =
                make_float2(o[i][0] * ia, o[i][1] * ia);
        if (write_b)
            *reinterpret_cast<float2*>(out + ((i64)(r0 + g + 8) * n_head + h) * D + d) =
                make_float2(o[i][2] * ib, o[i][3] * ib);
    }
}

// 128-wide heads (qwen3moe): 64 keys a tile, a warp the whole head.
extern "C" __global__ void __launch_bounds__(128)
prefill_attention_128(const float* __restrict__ q, const __half* __restrict__ kc,
                      const __half* __restrict__ vc, int n, int pos0, int n_head, int n_kv,
                      float scale, float* __restrict__ out) {
    prefill_attention_body<128, 64, 1>(q, kc, vc, n, pos0, n_head, n_kv, scale, out);
}

// 256-wide heads (qwen3next): 32 keys a tile (the K and V tiles in 37 KB of shared memory), the
// output dims of a head over two warps.
extern "C" __global__ void __launch_bounds__(256)
prefill_attention_256(const float* __restrict__ q, const __half* __restrict__ kc,
                      const __half* __restrict__ vc, int n, int pos0, int n_head, int n_kv,
                      float scale, float* __restrict__ out) {
    prefill_attention_body<256, 32, 2>(q, kc, vc, n, pos0, n_head, n_kv, scale, out);
}
