// Grouped decode experts (included by decode.cu; built only with GROUPED_EXPERTS=1, kernels/abi.py
// KernelShape grouped_experts): in a step of n >= 2 rows, the (row, slot) pairs that chose the
// same expert are grouped on the device (moe_group_pairs, one small launch after the router's
// top-k), and moe_gate_up_grouped_<type> takes one block per (ff chunk, work item of at most
// EXPERT_GROUP_ROWS pairs of one expert) instead of one block per (ff chunk, slot, row) each reading
// the expert's rows again: Q4_K and Q5_K decode each 64-column unit once in registers for all the
// item's rows; the other integer types load a unit once per row from the same thread (L1 serves
// the repeats: their unit dots load and decode in one function); the float path loads each chunk
// once per pass of rows (block_dots_rows).
//
// Batch invariance: a pair's act row is computed exactly as moe_gate_up_<type> computes it (the
// same activation quantization, the same lanes over the same units in the same order, the same
// xor tree and SwiGLU; the float path's same chunks per thread and block_reduce), only several
// pairs share the weight loads. Which pairs share a block changes no bit of any of them.
// The down projection is NOT grouped: moe_down sums a row's k experts as one long row (each lane
// or thread takes (rank, chunk) pieces in turn, experts mixed in one accumulator), so an expert's
// contribution to h is never a separate sum that several rows could share without changing the
// order of a row's float additions. It stays per row (moe_down_<type>, unchanged), unless
// GROUPED_DOWN (KernelShape grouped_down) builds experts_grouped_down.cuh: each pair's down a sum of
// its own, grouped by these items, then added per row in slot order (another order than moe_down's).
#pragma once

#ifndef GROUPED_EXPERTS
#define GROUPED_EXPERTS 0     // the grouped gate/up and its grouping kernel are built (KernelShape)
#endif
#ifndef EXPERT_GROUP_ROWS
#define EXPERT_GROUP_ROWS 2   // pairs of one work item: rows whose activations a block holds at once
#endif
#define GROUP_MAX_K 16                          // the most slots a row (the graph's geometry check)
#define GROUP_THREADS (MAX_ROWS * GROUP_MAX_K)  // moe_group_pairs: a thread a pair

static_assert(EXPERT_GROUP_ROWS >= 1 && EXPERT_GROUP_ROWS <= 4, "EXPERT_GROUP_ROWS is 1..4");

// The groups buffer (int32, 3 * MAX_ROWS * k words; kernels/grouped_model.py group_pairs models it):
// items [MAX_ROWS * k] of (first sorted place, pairs), count 0 past the step's items; then the
// sorted pairs p = row * k + slot, by group in the order of each group's first pair, each group's
// pairs in row order.
HOST_DEVICE int group_order_at(int k) { return 2 * MAX_ROWS * k; }

// Phase 1, pair p of `pairs`: its group's first pair (the leader), its rank in the group and the
// group's size. A pair that chose nothing (id -1: NaN logits) is a group of its own.
HOST_DEVICE void group_scan(const int* ids, int pairs, int p, int& leader, int& rank, int& count) {
    const int e = ids[p];
    leader = p;
    rank = 0;
    count = 0;
    for (int q = 0; q < pairs; ++q) {
        if (q != p && (e < 0 || ids[q] != e)) continue;
        ++count;
        if (q < p) {
            ++rank;
            leader = q < leader ? q : leader;
        }
    }
}

// Phase 2, a leader p: its group's first sorted place and first item, from the sizes of the groups
// led before it (lead_count[q]: the size where q leads, else 0)
HOST_DEVICE void group_place(const int* lead_count, int p, int group_rows, int& start, int& item0) {
    start = 0;
    item0 = 0;
    for (int q = 0; q < p; ++q) {
        start += lead_count[q];
        item0 += (lead_count[q] + group_rows - 1) / group_rows;
    }
}

#if GROUPED_EXPERTS
// The step's pairs grouped by expert into `groups` (layout above) from the layer's ids [n, k], in
// one block: no host round trip, buffers of a fixed size.
extern "C" __global__ void __launch_bounds__(MAX_ROWS * GROUP_MAX_K)   // GROUP_THREADS
moe_group_pairs(const ExpertSpec* __restrict__ spec, const int* __restrict__ ids, int n,
                int* __restrict__ groups) {
    pdl_entry();
    __shared__ int sid[GROUP_THREADS], lead_count[GROUP_THREADS], start[GROUP_THREADS];
    const int k = spec->k, pairs = n * k, p = threadIdx.x;
    int2* items = reinterpret_cast<int2*>(groups);
    int* order = groups + group_order_at(k);
    if (p < pairs) {
        sid[p] = ids[p];
        items[p] = make_int2(0, 0);              // no item unless a leader writes one below
    }
    __syncthreads();
    int leader = p, rank = 0, count = 0;
    if (p < pairs) {
        group_scan(sid, pairs, p, leader, rank, count);
        lead_count[p] = rank == 0 ? count : 0;
    }
    __syncthreads();
    if (p < pairs && rank == 0) {
        int item0;
        group_place(lead_count, p, EXPERT_GROUP_ROWS, start[p], item0);
        for (int t = 0; t < count; t += EXPERT_GROUP_ROWS)
            items[item0 + t / EXPERT_GROUP_ROWS] =
                make_int2(start[p] + t, min(EXPERT_GROUP_ROWS, count - t));
    }
    __syncthreads();
    if (p < pairs) order[start[leader] + rank] = p;
}

// sums[r * N + i] = rows[r] . xs[i] (N activation rows at their own addresses): block_dots<T, 1,
// R> of weights.cuh (no norm weight, no sum of squares) with the weight chunk loaded once for the
// N rows; each (r, i) sum takes the same chunks per thread in the same order and the same
// block_reduce, so its bits are block_dots<T, 1, R>'s for row xs[i] alone.
template <int T, int N, int R>
__device__ __forceinline__ void block_dots_rows(const u8* const (&rows)[R], int nchunks,
                                                const float* const (&xs)[N], float* sums) {
    constexpr int M = R * N;
    float acc[M];
    #pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.f;
    #pragma unroll 2
    for (int c = threadIdx.x; c < nchunks; c += blockDim.x) {
        float xv[N][8];
        #pragma unroll
        for (int i = 0; i < N; ++i) load8(xs[i] + 8 * c, xv[i]);
        float xsum[N];
        #pragma unroll
        for (int i = 0; i < N; ++i) xsum[i] = ChunkDot<T>::needs_xsum ? sum8(xv[i]) : 0.f;
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            ChunkDot<T> w;
            w.load(rows[r], c);
            #pragma unroll
            for (int i = 0; i < N; ++i) acc[r * N + i] = w.dot(xv[i], xsum[i], acc[r * N + i]);
        }
    }
    block_reduce<M>(acc, sums);
}

// rows of one float-path pass: as many of the item's pairs as keep 2 * FF_PER_BLOCK * rows sums
// at 32 a thread (the registers of today's FF_PER_BLOCK = 4 kernel times 4)
constexpr int FLOAT_GROUP_ROWS =
    EXPERT_GROUP_ROWS * FF_PER_BLOCK <= 16 ? EXPERT_GROUP_ROWS
                                           : (16 / FF_PER_BLOCK > 0 ? 16 / FF_PER_BLOCK : 1);

// The float path (moe_gate_up_body's) for the cnt pairs order[0 .. cnt) of one expert at `blob`,
// expert rows f0 .. f0 + FF_PER_BLOCK: the rows' gate and up chunks loaded once a pass.
template <int T>
__device__ __forceinline__ void gate_up_group_float(const ExpertSpec& sp,
                                                    const float* __restrict__ x,
                                                    const u8* __restrict__ blob,
                                                    const int* __restrict__ order, int cnt,
                                                    float* __restrict__ act, int f0) {
    constexpr int G = FLOAT_GROUP_ROWS;
    __shared__ float sums[2 * FF_PER_BLOCK * G];
    if (blob == nullptr) {      // not resident: NaN, as moe_gate_up_body writes it
        for (int j = 0; j < cnt; ++j)
            if (threadIdx.x < FF_PER_BLOCK && f0 + threadIdx.x < sp.n_ff)
                act[(i64)order[j] * sp.n_ff + f0 + threadIdx.x] = NAN_F32;
        return;
    }
    const u8* rows[2 * FF_PER_BLOCK];
    gate_up_rows(sp, blob, f0, rows);
    for (int j0 = 0; j0 < cnt; j0 += G) {
        const int m = min(G, cnt - j0);
        const float* xs[G];
        #pragma unroll
        for (int j = 0; j < G; ++j)         // a pass short of G rows repeats its last (dropped)
            xs[j] = x + (i64)(order[j0 + min(j, m - 1)] / sp.k) * sp.n_embd;
        block_dots_rows<T, G, 2 * FF_PER_BLOCK>(rows, sp.n_embd >> 3, xs, sums);
        if (threadIdx.x < FF_PER_BLOCK * G) {
            const int q = threadIdx.x / G, j = threadIdx.x - q * G;
            if (j < m && f0 + q < sp.n_ff) {
                const float g = sums[q * G + j], u = sums[(FF_PER_BLOCK + q) * G + j];
                act[(i64)order[j0 + j] * sp.n_ff + f0 + q] = g / (1.f + __expf(-g)) * u;
            }
        }
    }
}

// The integer path (moe_gate_up_int's, rows read in place) for the cnt <= EXPERT_GROUP_ROWS pairs
// order[0 .. cnt) of one expert at `blob`: each row's activations quantized into its own shared
// copy, then each warp's f as there, every lane's units decoded once and dotted with each row.
template <int T>
__device__ __forceinline__ void gate_up_group_int(const ExpertSpec& sp,
                                                  const float* __restrict__ x,
                                                  const u8* __restrict__ blob,
                                                  const int* __restrict__ order, int cnt,
                                                  float* __restrict__ act) {
    constexpr int G = EXPERT_GROUP_ROWS;
    __shared__ __align__(16) u32 xh[G][xq_words(INT_X_MAX)], xl[G][xq_words(INT_X_MAX)];
    __shared__ float xstep[G][INT_X_MAX / 32], xsum[G][INT_X_MAX / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int pair[G];
    #pragma unroll
    for (int j = 0; j < G; ++j) pair[j] = order[min(j, cnt - 1)];
    for (int j = 0; j < cnt; ++j)            // (order, not pair: j is not a constant here)
        quantize_x(x + (i64)(order[j] / sp.k) * sp.n_embd, sp.n_embd, nullptr, 1,
                   XQ{xh[j], xl[j], xstep[j], xsum[j]});
    __syncthreads();
    const int units = sp.n_embd >> 6;
    const i64 g_bytes = sp.gate_row_bytes, u_bytes = sp.up_row_bytes;
    for (int f = blockIdx.x * INT_FF_BLOCK + warp;
         f < min(sp.n_ff, (int)(blockIdx.x + 1) * INT_FF_BLOCK); f += INT_WARPS) {
        const u8* g_row = blob + (i64)f * g_bytes;
        const u8* u_row = blob + sp.up_at + (i64)f * u_bytes;
        float g[G], up[G];
        #pragma unroll
        for (int j = 0; j < G; ++j) g[j] = up[j] = 0.f;
        for (int u = lane; u < units; u += 32) {
            if constexpr (T == T_Q4_K || T == T_Q5_K) {
                // the unit decoded once, then its pair dot with each row (int_unit_dot's own
                // k_pair_dot, so each row's value is the one-row kernel's)
                uint4 g_head, u_head;
                u32 g_lo[8], g_hi[8], u_lo[8], u_hi[8];
                if constexpr (T == T_Q4_K) {
                    q4_k_unit(g_row, u, g_head, g_lo, g_hi);
                    q4_k_unit(u_row, u, u_head, u_lo, u_hi);
                } else {
                    q5_k_unit(g_row, u, g_head, g_lo, g_hi);
                    q5_k_unit(u_row, u, u_head, u_lo, u_hi);
                }
                #pragma unroll
                for (int j = 0; j < G; ++j) {
                    if (j > 0 && j >= cnt) break;      // uniform in the block
                    XFrag xf;
                    load_xfrag(xf, XQ{xh[j], xl[j], xstep[j], xsum[j]}, u);
                    g[j] += k_pair_dot(g_head, u & 3, g_lo, g_hi, xf);
                    up[j] += k_pair_dot(u_head, u & 3, u_lo, u_hi, xf);
                }
            } else {
                // the other unit dots load and decode per row: the repeated loads of a unit are
                // the same thread's, served from L1
                #pragma unroll
                for (int j = 0; j < G; ++j) {
                    if (j > 0 && j >= cnt) break;      // uniform in the block
                    XFrag xf;
                    load_xfrag(xf, XQ{xh[j], xl[j], xstep[j], xsum[j]}, u);
                    g[j] += int_unit_dot<T>(g_row, u, xf);
                    up[j] += int_unit_dot<T>(u_row, u, xf);
                }
            }
        }
        #pragma unroll
        for (int j = 0; j < G; ++j) {
            if (j > 0 && j >= cnt) break;
            const float gs = warp_sum(g[j]), us = warp_sum(up[j]);
            if (lane == 0) act[(i64)pair[j] * sp.n_ff + f] = gs / (1.f + __expf(-gs)) * us;
        }
    }
}

// act[p, f] for the pairs of work item blockIdx.y (groups: moe_group_pairs' layout) and the
// block's f (the grid's x as moe_gate_up_<type>'s: KernelShape gate_up_block); an empty item
// returns at once. Every path of moe_gate_up_<type> has its grouped form here: the integer path
// (rows read in place: grouped; staged: each pair in turn, the same block), a block it cannot
// take and the float types (block_dots over a pass of rows).
template <int T>
__device__ __forceinline__ void moe_gate_up_grouped(const ExpertSpec& sp,
                                                    const float* __restrict__ x,
                                                    const u64* __restrict__ blobs,
                                                    const int* __restrict__ groups,
                                                    float* __restrict__ act) {
    const int2 item = reinterpret_cast<const int2*>(groups)[blockIdx.y];
    if (item.y == 0) return;
    const int* order = groups + group_order_at(sp.k) + item.x;
    const int cnt = item.y;
    const u8* blob = reinterpret_cast<const u8*>(blobs[order[0]]);   // the group's one expert
    if constexpr (INT_GATE_UP && int_type(T)) {
        if (gate_up_int_ok<T>(sp, blob)) {
            if constexpr (int_direct(T)) {
                gate_up_group_int<T>(sp, x, blob, order, cnt, act);
            } else {
                for (int j = 0; j < cnt; ++j) {
                    if (j > 0) __syncthreads();        // the last pair's activations are read
                    const int p = order[j];
                    moe_gate_up_int<T>(sp, x + (i64)(p / sp.k) * sp.n_embd, blob,
                                       act + (i64)p * sp.n_ff);
                }
            }
            return;
        }
        const int f_end = min((int)(blockIdx.x + 1) * INT_FF_BLOCK, sp.n_ff);
        for (int f0 = blockIdx.x * INT_FF_BLOCK; f0 < f_end; f0 += FF_PER_BLOCK)
            gate_up_group_float<T>(sp, x, blob, order, cnt, act, f0);
    } else {
        gate_up_group_float<T>(sp, x, blob, order, cnt, act, blockIdx.x * FF_PER_BLOCK);
    }
}

#define MOE_GROUPED_KERNELS(name, T, ...)                                                        \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_gate_up_grouped_##name(       \
            const ExpertSpec* __restrict__ spec, const float* __restrict__ x,                    \
            const u64* __restrict__ blobs, const int* __restrict__ groups,                       \
            float* __restrict__ act) {                                                           \
        pdl_entry();                                                                             \
        moe_gate_up_grouped<T>(*spec, x, blobs, groups, act);                                    \
    }
FOR_EACH_TYPE(MOE_GROUPED_KERNELS)
#endif
