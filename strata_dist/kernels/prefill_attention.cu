// strata-dist prompt attention: the causal attention of a prompt chunk's rows over the session's
// f16 KV, flash style (tiles of keys in shared memory, an online softmax in registers, no score
// matrix in memory), on tensor cores (mma.sync m16n8k16: q and the softmax weights rounded to
// f16, every product accumulated in f32).
//
// Grid (n_head, ceil(n / rows)), FA_WARPS_M warps, rows = FA_ROWS(MT): block (h, y) takes query
// tile gridDim.y - 1 - y of head h (the tiles with the most keys start first, so the short ones
// fill the tail), warp w the block's rows 16 MT w .. 16 MT (w + 1) - 1, every output dim of the
// head. The K and V tiles of BN keys are copied by cp.async into two stages of dynamic shared
// memory, tile i + 1 landing while tile i is computed; both are kept key-major as the cache
// holds them, and ldmatrix (.trans for V) hands out the fragments, so no thread transposes V
// through shared memory. A warp of two 16-row tiles (MT = 2, 128-wide heads) uses each K and V
// fragment twice, which halves the shared-memory reads a product costs. Only the tiles a warp's
// rows straddle are masked; a warp whose rows all precede a tile skips it.
#include "weights.cuh"
#include "mma.cuh"
#include "async_copy.cuh"

#ifndef FA_WARPS_M
#define FA_WARPS_M 4                     // warps over a block's query rows
#endif
// a build's query tiles of 16 rows a warp (MT), keys a tile (BN), blocks an SM must hold (a
// register bound for ptxas); -D overrides them (benchmarks/bench_prompt_attention.py --variant)
#ifndef FA_MT_128
#define FA_MT_128 2
#endif
#ifndef FA_BN_128
#define FA_BN_128 32
#endif
#ifndef FA_MIN_BLOCKS_128
#define FA_MIN_BLOCKS_128 1
#endif
#ifndef FA_MT_256
#define FA_MT_256 1
#endif
#ifndef FA_BN_256
#define FA_BN_256 32
#endif
#define FA_ROWS(MT) (16 * (MT) * FA_WARPS_M)           // query rows of a block
// q stays in registers for one 16-row tile of a 128-wide head; beside the accumulators of two
// tiles, or of a 256-wide head, it would not fit, and is read from shared memory instead
#define FA_Q_SHARED(D, MT) ((MT) > 1 || (D) > 128)
// dynamic shared bytes of a block: two stages of a K and a V tile, and the block's q rounded to
// f16 where it is shared; rows padded by 8 halves: ldmatrix without bank conflicts (a row is 16
// bytes past a multiple of 128)
#define FA_SHARED_BYTES(D, BN, MT) \
    ((2 * 2 * (BN) + (FA_Q_SHARED(D, MT) ? FA_ROWS(MT) : 0)) * ((D) + 8) * 2)

__device__ __forceinline__ float fast_exp2(float x) {      // 2^x, 0 at -inf
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// q [n, n_head, D] float32 at positions pos0 ..; k, v [cells, n_kv, D] f16 (keys 0 .. pos0 + n - 1
// valid); out [n, n_head, D] float32.
template <int D, int BN, int MT>
__device__ __forceinline__ void prefill_attention_body(
        const float* __restrict__ q, const __half* __restrict__ kc, const __half* __restrict__ vc,
        int n, int pos0, int n_head, int n_kv, float scale, float* __restrict__ out) {
    constexpr int LD = D + 8;          // a shared row's stride in halves
    constexpr int BM = FA_ROWS(MT);
    constexpr bool Q_SHARED = FA_Q_SHARED(D, MT);
    static_assert(D % 32 == 0 && BN % 16 == 0, "whole ldmatrix_x4 steps");
    extern __shared__ __align__(16) unsigned char fa_shared[];
    __half (*ks)[BN][LD] = reinterpret_cast<__half (*)[BN][LD]>(fa_shared);   // [2][BN][LD]
    __half (*vs)[BN][LD] = ks + 2;
    __half (*qs)[LD] = reinterpret_cast<__half (*)[LD]>(ks + 4);              // [BM][LD]
    const int h = blockIdx.x, kvh = h / (n_head / n_kv);
    const int tile = gridDim.y - 1 - blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int lm = lane >> 3, lr = lane & 7;     // ldmatrix: this lane's matrix and row in it
    const int w0 = warp * 16 * MT;               // the warp's first row in the block
    const int r0 = tile * BM + w0;
    const bool idle = r0 >= n;                   // a ragged last tile's warps past the chunk
    // this thread's query positions: rows g and g + 8 of each 16-row tile (rows past n: the
    // last row, computed and never written)
    int qpos[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        qpos[mt][0] = pos0 + min(r0 + 16 * mt + g, n - 1);
        qpos[mt][1] = pos0 + min(r0 + 16 * mt + g + 8, n - 1);
    }
    const int warp_first = pos0 + r0, warp_last = pos0 + min(r0 + 16 * MT - 1, n - 1);
    // q as A fragments: in registers for one 16-row tile a warp, else through shared memory
    unsigned qa[Q_SHARED ? 1 : D / 16][4];
    if constexpr (Q_SHARED) {
        for (int c = threadIdx.x; c < BM * (D / 4); c += blockDim.x) {
            const int row = c / (D / 4), d4 = 4 * (c % (D / 4));
            const float4 x = *reinterpret_cast<const float4*>(
                q + ((i64)min(tile * BM + row, n - 1) * n_head + h) * D + d4);
            *reinterpret_cast<uint2*>(&qs[row][d4]) = make_uint2(pack_half2(x.x, x.y),
                                                                 pack_half2(x.z, x.w));
        }                                        // visible after the loop's first barrier
    } else {
        const float* qra = q + ((i64)(qpos[0][0] - pos0) * n_head + h) * D;
        const float* qrb = q + ((i64)(qpos[0][1] - pos0) * n_head + h) * D;
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
    float o[MT][D / 8][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int i = 0; i < D / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    // scores in log2 units: one multiply folds the scale and exp's base change
    const float scale2 = scale * 1.4426950408889634f;
    float m[MT][2], l[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INF_F32, l[mt][0] = l[mt][1] = 0.f;
    const int last_key = pos0 + min(n, (tile + 1) * BM) - 1;
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
            // scores of the warp's rows against the tile's BN keys (BN / 8 tiles of 8 keys); a
            // K fragment pair serves every 16-row tile of the warp
            float s[MT][BN / 8][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int j = 0; j < BN / 8; ++j)
                    s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
            #pragma unroll
            for (int kk = 0; kk < D / 16; kk += 2) {
                unsigned a[MT][2][4];            // q of steps kk, kk + 1
                if constexpr (Q_SHARED) {
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        #pragma unroll
                        for (int x = 0; x < 2; ++x)
                            ldmatrix_x4(a[mt][x], &qs[w0 + 16 * mt + lr + 8 * (lm & 1)]
                                                     [16 * (kk + x) + 8 * (lm >> 1)]);
                }
                #pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    unsigned b[4];
                    ldmatrix_x4(b, &ks[stage][8 * j + lr][16 * kk + 8 * lm]);
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        if constexpr (Q_SHARED) {
                            mma_16816(s[mt][j], a[mt][0], b[0], b[1]);
                            mma_16816(s[mt][j], a[mt][1], b[2], b[3]);
                        } else {
                            mma_16816(s[mt][j], qa[kk], b[0], b[1]);
                            mma_16816(s[mt][j], qa[kk + 1], b[2], b[3]);
                        }
                    }
                }
            }
            // scale, the causal mask where the tile reaches past the warp's first row, the
            // online softmax (a row's values live in the 4 lanes of a quad)
            const bool straddles = k0 + BN - 1 > warp_first;
            float p_scale[MT][2];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float mx[2] = {m[mt][0], m[mt][1]};
                #pragma unroll
                for (int j = 0; j < BN / 8; ++j)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = k0 + 8 * j + 2 * t + (e & 1), r = e >> 1;
                        s[mt][j][e] *= scale2;
                        if (straddles && key > qpos[mt][r]) s[mt][j][e] = -INF_F32;
                        mx[r] = fmaxf(mx[r], s[mt][j][e]);
                    }
                #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    #pragma unroll
                    for (int o2 = 1; o2 < 4; o2 <<= 1)
                        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], o2));
                    // key 0 is in the first tile and every row sees it: the maxima are finite
                    // from there on (a row whose keys in a later tile are all masked keeps its
                    // maximum: factor 1)
                    p_scale[mt][r] = fast_exp2(m[mt][r] - mx[r]);
                    m[mt][r] = mx[r];
                }
                float rs[2] = {0.f, 0.f};
                #pragma unroll
                for (int j = 0; j < BN / 8; ++j)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[mt][j][e] = fast_exp2(s[mt][j][e] - m[mt][e >> 1]);
                        rs[e >> 1] += s[mt][j][e];
                    }
                #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    #pragma unroll
                    for (int o2 = 1; o2 < 4; o2 <<= 1)
                        rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], o2);
                    l[mt][r] = l[mt][r] * p_scale[mt][r] + rs[r];
                }
                #pragma unroll
                for (int i = 0; i < D / 8; ++i) {
                    o[mt][i][0] *= p_scale[mt][0]; o[mt][i][1] *= p_scale[mt][0];
                    o[mt][i][2] *= p_scale[mt][1]; o[mt][i][3] *= p_scale[mt][1];
                }
            }
            // o += p v: the score fragments of two adjacent 8-key tiles are the A fragment of 16
            // keys; V's B fragments come transposed out of its key-major tile, two dim tiles a
            // load (matrix lm: keys + 8 (lm & 1), dims + 8 (lm >> 1)), each serving every
            // 16-row tile of the warp
            #pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                unsigned pa[MT][4];
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    pa[mt][0] = pack_half2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                    pa[mt][1] = pack_half2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                    pa[mt][2] = pack_half2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                    pa[mt][3] = pack_half2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                }
                #pragma unroll
                for (int i = 0; i < D / 8; i += 2) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, &vs[stage][16 * kk + 8 * (lm & 1) + lr]
                                            [8 * i + 8 * (lm >> 1)]);
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816(o[mt][i], pa[mt], b[0], b[1]);
                        mma_16816(o[mt][i + 1], pa[mt], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();                         // tile it read before its stage is refilled
    }
    if (idle) return;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = r0 + 16 * mt + g + 8 * r;
            if (row >= n) continue;
            const float inv = 1.f / l[mt][r];
            float* dst = out + ((i64)row * n_head + h) * D + 2 * t;
            #pragma unroll
            for (int i = 0; i < D / 8; ++i)
                *reinterpret_cast<float2*>(dst + 8 * i) =
                    make_float2(o[mt][i][2 * r] * inv, o[mt][i][2 * r + 1] * inv);
        }
}

// 128-wide heads (qwen3moe): a warp the whole head, FA_MT_128 tiles of 16 rows.
extern "C" __global__ void __launch_bounds__(32 * FA_WARPS_M, FA_MIN_BLOCKS_128)
prefill_attention_128(const float* __restrict__ q, const __half* __restrict__ kc,
                      const __half* __restrict__ vc, int n, int pos0, int n_head, int n_kv,
                      float scale, float* __restrict__ out) {
    prefill_attention_body<128, FA_BN_128, FA_MT_128>(q, kc, vc, n, pos0, n_head, n_kv, scale,
                                                      out);
}

// 256-wide heads (qwen3next): one 16-row tile a warp, its q from shared memory.
extern "C" __global__ void __launch_bounds__(32 * FA_WARPS_M)
prefill_attention_256(const float* __restrict__ q, const __half* __restrict__ kc,
                      const __half* __restrict__ vc, int n, int pos0, int n_head, int n_kv,
                      float scale, float* __restrict__ out) {
    prefill_attention_body<256, FA_BN_256, FA_MT_256>(q, kc, vc, n, pos0, n_head, n_kv, scale,
                                                      out);
}
