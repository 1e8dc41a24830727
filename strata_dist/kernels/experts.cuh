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
// chosen expert's blob address for the expert kernels. With at most 128 experts (PER 4) each lane
// reads the addresses of its own experts (lane + 32 j) beside the logits, and a pick's address
// comes from that lane by shuffle: no load after the top-k (the router tail's last round trip).
template <int PER>
__device__ __forceinline__ void route_row(const RouteSpec& rs, const u64* __restrict__ blob_of,
                                          int i) {
    const int lane = threadIdx.x & 31, n_expert = rs.n_expert, k = rs.k;
    constexpr bool held = PER <= 4;
    u64 own[held ? PER : 1];
    if constexpr (held) {
        #pragma unroll
        for (int j = 0; j < PER; ++j)
            own[j] = lane + 32 * j < n_expert ? blob_of[lane + 32 * j] : 0ull;
    }
    int mine;
    float mine_p, picked_sum;
    topk_softmax_row<PER>(rs.logits + (i64)i * n_expert, n_expert, k, lane, mine, mine_p,
                          picked_sum);
    // NaN or infinite logits pick nothing: no address, so the expert kernels write NaN
    const bool picked = mine >= 0 && mine < n_expert;
    u64 blob = 0ull;
    if constexpr (held) {
        const int src = picked ? mine & 31 : 0, slot = picked ? mine >> 5 : 0;
        #pragma unroll
        for (int j = 0; j < PER; ++j) {            // every lane takes part in every shuffle
            const u64 b = __shfl_sync(0xffffffffu, own[j], src);
            if (j == slot) blob = b;
        }
    } else if (lane < k && picked) {
        blob = blob_of[mine];
    }
    if (lane < k) {
        rs.ids[i * k + lane] = picked ? mine : -1;
        rs.wts[i * k + lane] = !picked ? NAN_F32 : rs.normalize ? mine_p / picked_sum : mine_p;
        rs.blobs[i * k + lane] = picked ? blob : 0ull;
    }
}

// Called by every block of the router's launch after its rows are written. The spec and the
// address table are read before the count (they are not this launch's output), so their loads
// overlap the fence and the atomic.
__device__ void route_after_last_block(const RouteSpec* __restrict__ route, int n) {
    const RouteSpec rs = *route;
    const u64* blob_of = rs.experts->blob_of;
    if (!last_block_to_finish(route->done, gridDim.x * gridDim.y)) return;
    const int warp = threadIdx.x >> 5;
    for (int i = warp; i < n; i += blockDim.x >> 5) {
        if (rs.n_expert <= 128) route_row<4>(rs, blob_of, i);
        else route_row<16>(rs, blob_of, i);
    }
}

// ---- experts ----------------------------------------------------------------------------------
// The gate rows and then the up rows of expert rows f0 .. f0 + FF_PER_BLOCK of the expert at
// `blob` (a row past n_ff repeats the last: its sums are dropped), as moe_gate_up_body reads them.
__device__ __forceinline__ void gate_up_rows(const ExpertSpec& sp, const u8* blob, int f0,
                                             const u8* (&rows)[2 * FF_PER_BLOCK]) {
    #pragma unroll
    for (int q = 0; q < FF_PER_BLOCK; ++q) {
        const int f = min(f0 + q, sp.n_ff - 1);
        rows[q] = blob + (i64)f * sp.gate_row_bytes;
        rows[FF_PER_BLOCK + q] = blob + sp.up_at + (i64)f * sp.up_row_bytes;
    }
}

// act[i, r, f] = silu(gate_e[f] . x_i) * (up_e[f] . x_i), e = ids[i, r] (gate and up stored in
// one type). A block takes FF_PER_BLOCK consecutive f from f0: their gate and up rows load
// together. Grid (f blocks, k, rows).
template <int T>
__device__ __forceinline__ void moe_gate_up_body(const ExpertSpec& sp, const float* __restrict__ x,
                                                 const u64* __restrict__ blobs,
                                                 float* __restrict__ act, int f0) {
    __shared__ float sums[2 * FF_PER_BLOCK];
    const int r = blockIdx.y, i = blockIdx.z;
    float* out = act + ((i64)i * sp.k + r) * sp.n_ff;
    const u8* blob = reinterpret_cast<const u8*>(blobs[i * sp.k + r]);
    if (blob == nullptr) {      // not resident: the caller checked; NaN says so loudly
        if (threadIdx.x < FF_PER_BLOCK && f0 + threadIdx.x < sp.n_ff)
            out[f0 + threadIdx.x] = NAN_F32;
        return;
    }
    const u8* rows[2 * FF_PER_BLOCK];
    gate_up_rows(sp, blob, f0, rows);
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
__device__ __forceinline__ void moe_down_body(const ExpertSpec& sp, const float* __restrict__ act,
                                              const u64* __restrict__ blobs,
                                              const float* __restrict__ wts,
                                              float* __restrict__ h, int d0) {
    __shared__ float sums[DOWN_PER_BLOCK];
    const int i = blockIdx.y;
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

#include "experts_int.cuh"   // the integer path (Q4_K; seven more types behind switches)
// the float body's passes must tile an integer-path block exactly (moe_down adds into h)
static_assert((!INT_GATE_UP || INT_FF_BLOCK % FF_PER_BLOCK == 0) &&
              (!INT_DOWN || INT_DOWN_BLOCK % DOWN_PER_BLOCK == 0),
              "an integer-path block is a whole number of float-path blocks");

// The kernels, once per type. The integer types (int_type: Q4_K, and Q5_K ... IQ2_XXS where
// their switches are on) take the integer path (grids of INT_FF_BLOCK and INT_DOWN_BLOCK; kernels/abi.py
// KernelShape.gate_up_block / down_block), and a block that cannot
// (an expert not resident, an address or size it does not take) computes its range with the float
// path's body, FF_PER_BLOCK or DOWN_PER_BLOCK at a time.
#define MOE_KERNELS(name, T, ...)                                                                \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_gate_up_##name(               \
            const ExpertSpec* __restrict__ spec, const float* __restrict__ x,                    \
            const u64* __restrict__ blobs, float* __restrict__ act) {                            \
        pdl_entry();                                                                             \
        const ExpertSpec sp = *spec;                                                             \
        if (INT_GATE_UP && int_type(T)) {                                                        \
            const int r = blockIdx.y, i = blockIdx.z;                                            \
            const u8* blob = reinterpret_cast<const u8*>(blobs[i * sp.k + r]);                   \
            if (gate_up_int_ok<T>(sp, blob)) {                                                   \
                moe_gate_up_int<T>(sp, x + (i64)i * sp.n_embd, blob,                             \
                                   act + ((i64)i * sp.k + r) * sp.n_ff);                         \
            } else {                                                                             \
                const int f_end = min((int)(blockIdx.x + 1) * INT_FF_BLOCK, sp.n_ff);             \
                for (int f0 = blockIdx.x * INT_FF_BLOCK; f0 < f_end; f0 += FF_PER_BLOCK)          \
                    moe_gate_up_body<T>(sp, x, blobs, act, f0);                                  \
            }                                                                                    \
        } else {                                                                                 \
            moe_gate_up_body<T>(sp, x, blobs, act, blockIdx.x * FF_PER_BLOCK);                   \
        }                                                                                        \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_down_##name(                  \
            const ExpertSpec* __restrict__ spec, const float* __restrict__ act,                  \
            const u64* __restrict__ blobs, const float* __restrict__ wts, float* __restrict__ h) { \
        pdl_entry();                                                                             \
        const ExpertSpec sp = *spec;                                                             \
        if (INT_DOWN && int_type(T)) {                                                           \
            if (down_int_ok<T>(sp, blobs, blockIdx.y)) {                                         \
                moe_down_int<T>(sp, act, blobs, wts, h);                                         \
            } else {                                                                             \
                const int d_end = min((int)(blockIdx.x + 1) * INT_DOWN_BLOCK, sp.n_embd);         \
                for (int d0 = blockIdx.x * INT_DOWN_BLOCK; d0 < d_end; d0 += DOWN_PER_BLOCK)      \
                    moe_down_body<T>(sp, act, blobs, wts, h, d0);                                \
            }                                                                                    \
        } else {                                                                                 \
            moe_down_body<T>(sp, act, blobs, wts, h, blockIdx.x * DOWN_PER_BLOCK);               \
        }                                                                                        \
    }
FOR_EACH_TYPE(MOE_KERNELS)
