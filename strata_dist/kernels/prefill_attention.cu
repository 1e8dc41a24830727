// strata-dist prompt attention: the causal attention of a prompt chunk's rows over the session's
// f16 KV, flash style (tiles of keys in shared memory, an online softmax in registers, no score
// matrix in memory), on tensor cores (mma.sync m16n8k16: q and the softmax weights rounded to
// f16, every product accumulated in f32).
//
// Grid (n_head, ceil(n / FA_BM)), FA_WARPS_M * DSPLIT warps: block (h, y) takes query tile
// gridDim.y - 1 - y of head h (the tiles with the most keys start first, so the short ones fill
// the tail), warp w its rows 16 (w % FA_WARPS_M) .. +15 and output dims [w / FA_WARPS_M,
// +1) D / DSPLIT. The K and V tiles of BN keys are copied by cp.async into two stages of dynamic
// shared memory, tile i + 1 landing while tile i is computed; both are kept key-major as the
// cache holds them, and ldmatrix (.trans for V) hands out the fragments, so no thread transposes
// V through shared memory. Only the tiles a warp's rows straddle are masked; a warp whose rows
// all precede a tile skips it. A 256-wide head (qwen3next) is split over two warps so a warp's
// accumulators stay in registers; both compute the same scores (the same arithmetic, so the same
// softmax).
#include "weights.cuh"
#include "mma.cuh"
#include "async_copy.cuh"

#ifndef FA_WARPS_M
#define FA_WARPS_M 4                     // warps over a block's query rows, 16 rows each
#endif
#ifndef FA_MIN_BLOCKS
#define FA_MIN_BLOCKS 1                  // blocks an SM must hold (a register bound for ptxas)
#endif
#define FA_BM (16 * FA_WARPS_M)          // query rows of a block
#define FA_BN_128 64                     // keys a tile, 128-wide heads
#define FA_BN_256 32                     // keys a tile, 256-wide heads
// dynamic shared bytes of a block: two stages of a K and a V tile, rows padded by 8 halves
// (conflict-free ldmatrix: a row is 16 bytes past a multiple of 128)
#define FA_SHARED_BYTES(D, BN) (2 * 2 * (BN) * ((D) + 8) * 2)

__device__ __forceinline__ float fast_exp2(float x) {      // 2^x, 0 at -inf
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// q [n, n_head, D] float32 at positions pos0 ..; k, v [cells, n_kv, D] f16 (keys 0 .. pos0 + n - 1
// valid); out [n, n_head, D] float32.
template <int D, int BN, int DSPLIT>
__device__ __forceinline__ void prefill_attention_body(
        const float* __restrict__ q, const __half* __restrict__ kc, const __half* __restrict__ vc,
        int n, int pos0, int n_head, int n_kv, float scale, float* __restrict__ out) {
    constexpr int LD = D + 8;          // a tile row's stride in halves
    constexpr int DO = D / DSPLIT;     // output dims of one warp
    static_assert(D % 32 == 0 && DO % 16 == 0 && BN % 16 == 0, "whole ldmatrix_x4 steps");
    extern __shared__ __align__(16) unsigned char fa_shared[];
    __half (*ks)[BN][LD] = reinterpret_cast<__half (*)[BN][LD]>(fa_shared);   // [2][BN][LD]
    __half (*vs)[BN][LD] = ks + 2;
    const int h = blockIdx.x, kvh = h / (n_head / n_kv);
    const int tile = gridDim.y - 1 - blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int lm = lane >> 3, lr = lane & 7;     // ldmatrix: this lane's matrix and row in it
    const int r0 = tile * FA_BM + (warp % FA_WARPS_M) * 16;
    const int d0 = (warp / FA_WARPS_M) * DO;
    const bool idle = r0 >= n;                   // a ragged last tile's warps past the chunk
    // this thread's two query rows (past n: the last row, computed and never written)
    const int ra = min(r0 + g, n - 1), rb = min(r0 + g + 8, n - 1);
    const int qpos_a = pos0 + ra, qpos_b = pos0 + rb;
    const int warp_first = pos0 + r0, warp_last = pos0 + min(r0 + 15, n - 1);
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
    // scores in log2 units: one multiply folds the scale and exp's base change
    const float scale2 = scale * 1.4426950408889634f;
    float m_a = -INF_F32, m_b = -INF_F32, l_a = 0.f, l_b = 0.f;
    const int last_key = pos0 + min(n, (tile + 1) * FA_BM) - 1;
    const int n_tiles = last_key / BN + 1;

    auto load_tile = [&](int it, int stage) {    // keys past last_key repeat it (masked anyway)
        const int k0 = it * BN;
        for (int c = threadIdx.x; c < BN * (D / 8); c += blockDim.x) {
            const int key = c / (D / 8), d8 = 8 * (c % (D / 8));
            const i64 at = ((i64)min(k0 + key, last_key) * n_kv + kvh) * D + d8;
            cp_async16(&ks[stage][key][d8], kc + at, true);
            cp_async16(&vs[stage][key][d8], vc + at, true);
        }
        cp_async_commit();
    };
    load_tile(0, 0);
    for (int it = 0; it < n_tiles; ++it) {
        const int stage = it & 1, k0 = it * BN;
        if (it + 1 < n_tiles) load_tile(it + 1, stage ^ 1);
        else cp_async_commit();                  // an empty group: the wait below counts alike
        cp_async_wait_newest_pending();          // this thread's copies of tile it
        __syncthreads();                         // everyone's
        if (!idle && k0 <= warp_last) {
            // scores of the warp's 16 rows against the tile's BN keys (BN / 8 tiles of 8 keys)
            float s[BN / 8][4];
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
                #pragma unroll
                for (int kk = 0; kk < D / 16; kk += 2) {
                    unsigned b[4];
                    ldmatrix_x4(b, &ks[stage][8 * j + lr][16 * kk + 8 * lm]);
                    mma_16816(s[j], qa[kk], b[0], b[1]);
                    mma_16816(s[j], qa[kk + 1], b[2], b[3]);
                }
            }
            // scale, the causal mask where the tile reaches past the warp's first row, the
            // online softmax (a row's values live in the 4 lanes of a quad)
            const bool straddles = k0 + BN - 1 > warp_first;
            float mx_a = m_a, mx_b = m_b;
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = k0 + 8 * j + 2 * t + e;
                    s[j][e] *= scale2;
                    s[j][2 + e] *= scale2;
                    if (straddles) {
                        if (key > qpos_a) s[j][e] = -INF_F32;
                        if (key > qpos_b) s[j][2 + e] = -INF_F32;
                    }
                    mx_a = fmaxf(mx_a, s[j][e]);
                    mx_b = fmaxf(mx_b, s[j][2 + e]);
                }
            }
            #pragma unroll
            for (int o2 = 1; o2 < 4; o2 <<= 1) {
                mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, o2));
                mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, o2));
            }
            // key 0 is in the first tile and every row sees it: the maxima are finite from there
            // on (a row whose keys in a later tile are all masked keeps its maximum: factor 1)
            const float ca = fast_exp2(m_a - mx_a), cb = fast_exp2(m_b - mx_b);
            m_a = mx_a;
            m_b = mx_b;
            float rs_a = 0.f, rs_b = 0.f;
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    s[j][e] = fast_exp2(s[j][e] - m_a);
                    s[j][2 + e] = fast_exp2(s[j][2 + e] - m_b);
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
            // o += p v: the score fragments of two adjacent 8-key tiles are the A fragment of 16
            // keys; V's B fragments come transposed out of its key-major tile, two dim tiles a
            // load (matrix lm: keys + 8 (lm & 1), dims + 8 (lm >> 1))
            #pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                const unsigned pa[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]),
                                        pack_half2(s[2 * kk][2], s[2 * kk][3]),
                                        pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                        pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                #pragma unroll
                for (int i = 0; i < DO / 8; i += 2) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, &vs[stage][16 * kk + 8 * (lm & 1) + lr]
                                            [d0 + 8 * i + 8 * (lm >> 1)]);
                    mma_16816(o[i], pa, b[0], b[1]);
                    mma_16816(o[i + 1], pa, b[2], b[3]);
                }
            }
        }
        __syncthreads();                         // tile it read before its stage is refilled
    }
    if (idle) return;
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
extern "C" __global__ void __launch_bounds__(32 * FA_WARPS_M, FA_MIN_BLOCKS)
prefill_attention_128(const float* __restrict__ q, const __half* __restrict__ kc,
                      const __half* __restrict__ vc, int n, int pos0, int n_head, int n_kv,
                      float scale, float* __restrict__ out) {
    prefill_attention_body<128, FA_BN_128, 1>(q, kc, vc, n, pos0, n_head, n_kv, scale, out);
}

// 256-wide heads (qwen3next): 32 keys a tile, the output dims of a head over two warps.
extern "C" __global__ void __launch_bounds__(64 * FA_WARPS_M, FA_MIN_BLOCKS)
prefill_attention_256(const float* __restrict__ q, const __half* __restrict__ kc,
                      const __half* __restrict__ vc, int n, int pos0, int n_head, int n_kv,
                      float scale, float* __restrict__ out) {
    prefill_attention_body<256, FA_BN_256, 2>(q, kc, vc, n, pos0, n_head, n_kv, scale, out);
}
