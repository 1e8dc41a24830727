// The experts of the decode step (included by decode.cu): the router's top-k (run by the router
// matvec's last block) and the gate/up and down kernels reading each chosen expert's blob.
#pragma once
#include "routing.cuh"      // topk_softmax_row

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

// Row i's top-k and weights (routing.cuh), renormalised over the k when `normalize`, and each
// chosen expert's blob address for the expert kernels.
template <int PER>
__device__ __forceinline__ void route_row(const RouteSpec& rs, int i) {
    const int lane = threadIdx.x & 31, n_expert = rs.n_expert, k = rs.k;
    const u64* blob_of = rs.experts->blob_of;   // loaded now, not after the top-k (a dependent load)
    int mine;
    float mine_p, picked_sum;
    topk_softmax_row<PER>(rs.logits + (i64)i * n_expert, n_expert, k, lane, mine, mine_p,
                          picked_sum);
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
    if (!last_block_to_finish(route->done, gridDim.x * gridDim.y)) return;
    const RouteSpec rs = *route;
    const int warp = threadIdx.x >> 5;
    for (int i = warp; i < n; i += blockDim.x >> 5) {
        if (rs.n_expert <= 128) route_row<4>(rs, i);
        else route_row<16>(rs, i);
    }
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

// With Q4K_PAIRS (an experiment for benchmarks/tune_decode.py, off by default): moe_gate_up_q4_k
// gives each warp FF_PER_BLOCK / 8 expert rows f whole (gate and up) and each lane a pair of
// sub-blocks of a super-block (64 weights: one head load and two scale decodes, where a chunk of 8
// pays both), its integers summed against x before scaling; the warp's xor tree sums, with no
// shared memory and no barrier. A first form that held the pair's 64 activations in registers
// halved the kernel's instructions but took 123 registers and measured no faster (occupancy
// halved; docs/BENCHMARKS.md): this one reads them 8 at a time.
#ifndef Q4K_PAIRS
#define Q4K_PAIRS 0
#endif

// the 4 bytes of `word` as exact floats (each < 256), through the mantissa of 2^23
__device__ __forceinline__ void bytes_to_floats(u32 word, float* f) {
    #pragma unroll
    for (int b = 0; b < 4; ++b)
        f[b] = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540 | b)) - 8388608.f;
}

__device__ __forceinline__ void moe_gate_up_q4k_pairs(const ExpertSpec* __restrict__ spec_p,
                                                      const float* __restrict__ x,
                                                      const u64* __restrict__ blobs,
                                                      float* __restrict__ act) {
    constexpr int WARPS = BLOCK_THREADS / 32;
    constexpr int FPW = FF_PER_BLOCK >= WARPS ? FF_PER_BLOCK / WARPS : 1;
    static_assert(!Q4K_PAIRS || FPW * WARPS == FF_PER_BLOCK,
                  "Q4K_PAIRS: FF_PER_BLOCK a multiple of the block's warps");
    constexpr int NR = 2 * FPW;                         // gate rows, then up rows
    const ExpertSpec sp = *spec_p;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int f0 = blockIdx.x * FF_PER_BLOCK + warp * FPW, r = blockIdx.y, i = blockIdx.z;
    if (f0 >= sp.n_ff) return;                          // the whole warp: uniform
    float* out = act + ((i64)i * sp.k + r) * sp.n_ff;
    const u8* blob = reinterpret_cast<const u8*>(blobs[i * sp.k + r]);
    if (blob == nullptr) {      // not resident: the caller checked; NaN says so loudly
        if (lane < FPW && f0 + lane < sp.n_ff) out[f0 + lane] = NAN_F32;
        return;
    }
    const u8* rows[NR];
    #pragma unroll
    for (int q = 0; q < FPW; ++q) {
        const int f = min(f0 + q, sp.n_ff - 1);
        rows[q] = blob + (i64)f * sp.gate_row_bytes;
        rows[FPW + q] = blob + sp.up_at + (i64)f * sp.up_row_bytes;
    }
    const float* xi = x + (i64)i * sp.n_embd;
    float acc[NR];
    #pragma unroll
    for (int q = 0; q < NR; ++q) acc[q] = 0.f;
    for (int u = lane; u < (sp.n_embd >> 6); u += 32) {     // pair u: super-block u / 4, pair u % 4
        const int sb = u >> 2, p = u & 3;
        uint4 head[NR], qa[NR], qb[NR];
        #pragma unroll
        for (int q = 0; q < NR; ++q) {
            const u8* blk = rows[q] + (i64)sb * 144;
            head[q] = __ldg(reinterpret_cast<const uint4*>(blk));
            qa[q] = __ldg(reinterpret_cast<const uint4*>(blk + 16 + 32 * p));
            qb[q] = __ldg(reinterpret_cast<const uint4*>(blk + 16 + 32 * p) + 1);
        }
        const float* xp = xi + 256 * sb + 64 * p;      // sub-block 2p at xp, 2p + 1 at xp + 32
        float s_lo[NR], s_hi[NR], x_lo = 0.f, x_hi = 0.f;
        #pragma unroll
        for (int q = 0; q < NR; ++q) { s_lo[q] = 0.f; s_hi[q] = 0.f; }
        #pragma unroll
        for (int w = 0; w < 8; ++w) {                  // bytes 4w .. 4w + 3 of the pair
            const float4 lo4 = __ldg(reinterpret_cast<const float4*>(xp + 4 * w));
            const float4 hi4 = __ldg(reinterpret_cast<const float4*>(xp + 32 + 4 * w));
            const float xl[4] = {lo4.x, lo4.y, lo4.z, lo4.w}, xh[4] = {hi4.x, hi4.y, hi4.z, hi4.w};
            x_lo += (xl[0] + xl[1]) + (xl[2] + xl[3]);
            x_hi += (xh[0] + xh[1]) + (xh[2] + xh[3]);
            #pragma unroll
            for (int q = 0; q < NR; ++q) {
                const uint4 v = w < 4 ? qa[q] : qb[q];
                const u32 word = (w & 3) == 0 ? v.x : (w & 3) == 1 ? v.y : (w & 3) == 2 ? v.z : v.w;
                float nl[4], nh[4];
                bytes_to_floats(word & 0x0F0F0F0Fu, nl);
                bytes_to_floats((word >> 4) & 0x0F0F0F0Fu, nh);
                #pragma unroll
                for (int b = 0; b < 4; ++b) {
                    s_lo[q] = fmaf(nl[b], xl[b], s_lo[q]);
                    s_hi[q] = fmaf(nh[b], xh[b], s_hi[q]);
                }
            }
        }
        #pragma unroll
        for (int q = 0; q < NR; ++q) {
            int sc_lo, m_lo, sc_hi, m_hi;
            k_scale_min(head[q].y, head[q].z, head[q].w, 2 * p, sc_lo, m_lo);
            k_scale_min(head[q].y, head[q].z, head[q].w, 2 * p + 1, sc_hi, m_hi);
            const float d = h2f((u16)(head[q].x & 0xFFFF)), dmin = h2f((u16)(head[q].x >> 16));
            acc[q] = fmaf(d * (float)sc_lo, s_lo[q], acc[q]);
            acc[q] = fmaf(-(dmin * (float)m_lo), x_lo, acc[q]);
            acc[q] = fmaf(d * (float)sc_hi, s_hi[q], acc[q]);
            acc[q] = fmaf(-(dmin * (float)m_hi), x_hi, acc[q]);
        }
    }
    #pragma unroll
    for (int q = 0; q < FPW; ++q) {
        const float g = warp_sum(acc[q]), up = warp_sum(acc[FPW + q]);
        if (lane == q && f0 + q < sp.n_ff) out[f0 + q] = g / (1.f + __expf(-g)) * up;
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
        const float xsum = ChunkDot<T>::needs_xsum ? sum8(xv) : 0.f;
        #pragma unroll
        for (int q = 0; q < DOWN_PER_BLOCK; ++q) {
            ChunkDot<T> w;
            w.load(blob + row_at[q], c);
            acc[q] = w.dot(xv, xsum, acc[q]);
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
        if (Q4K_PAIRS && T == T_Q4_K) moe_gate_up_q4k_pairs(spec, x, blobs, act);               \
        else moe_gate_up_body<T>(spec, x, blobs, act);                                           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_down_##name(                  \
            const ExpertSpec* __restrict__ spec, const float* __restrict__ act,                  \
            const u64* __restrict__ blobs, const float* __restrict__ wts, float* __restrict__ h) { \
        pdl_entry();                                                                             \
        moe_down_body<T>(spec, act, blobs, wts, h);                                              \
    }
FOR_EACH_TYPE(MOE_KERNELS)
