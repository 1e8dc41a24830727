// Grouped decode down projection (included by decode.cu after experts_grouped.cuh; the kernels are
// built only with GROUPED_DOWN=1, which needs GROUPED_EXPERTS=1: kernels/abi.py KernelShape
// grouped_down). moe_down_<type> sums a row's k experts in one accumulator (experts mixed), so no
// expert's share of h is a sum several rows could share. Here each (row, slot) pair's down
// contribution is a sum of its own, written to a per-pair partial buffer: moe_down_grouped_<type>
// takes one block per (down block, work item of moe_group_pairs: up to EXPERT_GROUP_ROWS pairs of
// one expert), so the item's expert's down rows are read once for all its pairs; then
// moe_down_combine adds each row's k partials in slot order (fixed, whatever the grouping) to h,
// the residual, where moe_down adds its sum.
//
// Batch invariance: a pair's partial is the same bits whichever pairs share its block (each pair
// has its own accumulators over the same units or chunks in the same order; the integer path
// quantizes its own act row, the float path scales its own chunks by its own weight), and a row's
// h reads only that row's partials. A lone row's h differs from moe_down's in float rounding (the
// k experts are summed per expert, then across slots): that is why this sits behind its switch,
// and why a build with it takes this path for one-row steps too (ops/moe.py graph_experts), so a
// request's tokens never depend on whether others share its step.
#pragma once

#ifndef GROUPED_DOWN
#define GROUPED_DOWN 0      // the grouped down and its combine are built (KernelShape grouped_down)
#endif
static_assert(!GROUPED_DOWN || GROUPED_EXPERTS,
              "GROUPED_DOWN=1 needs GROUPED_EXPERTS=1 (it reads moe_group_pairs' work items)");

// The partial buffer (float, [MAX_ROWS * k, n_embd]; kernels/abi.py down_partial_floats): pair
// p = row * k + slot's down contribution at row p.
// The integer path quantizes each of an item's pairs' act rows (n_ff columns) into its own shared
// copy: the columns EXPERT_GROUP_ROWS copies hold are moe_down_int's k * n_ff bound
#define GROUP_DOWN_FF_MAX (INT_ACT_MAX / EXPERT_GROUP_ROWS)

// Row i's h increment at output d: its k pairs' partials added in slot order, starting from slot
// 0's (the order never depends on which pairs were grouped)
HOST_DEVICE float down_combine(const float* __restrict__ partial, int n_embd, int k, int i, int d) {
    const float* p = partial + (i64)i * k * n_embd + d;
    float s = p[0];
    for (int r = 1; r < k; ++r) s += p[(i64)r * n_embd];
    return s;
}

// One lane's share of the down row `row` (a 64-column unit at a time: units lane, lane + 32, ...)
// dotted with each of cnt pairs' quantized activations q[j] into acc[j]; Q4_K and Q5_K decode
// each unit once for the cnt pairs (int_unit_dot's own k_pair_dot). acc[j] adds the same units'
// values in the same order whatever cnt is and whatever q[] holds besides q[j].
template <int T, int G>
HOST_DEVICE void down_lane_units(const u8* __restrict__ row, int units, int lane,
                                 const XQ (&q)[G], int cnt, float (&acc)[G]) {
    #pragma unroll
    for (int j = 0; j < G; ++j) acc[j] = 0.f;
    for (int u = lane; u < units; u += 32) {
        if constexpr (T == T_Q4_K || T == T_Q5_K) {
            uint4 head;
            u32 lo[8], hi[8];
            if constexpr (T == T_Q4_K) q4_k_unit(row, u, head, lo, hi);
            else q5_k_unit(row, u, head, lo, hi);
            #pragma unroll
            for (int j = 0; j < G; ++j) {
                if (j > 0 && j >= cnt) break;          // uniform in the block
                XFrag xf;
                load_xfrag(xf, q[j], u);
                acc[j] += k_pair_dot(head, u & 3, lo, hi, xf);
            }
        } else {
            // the other unit dots load and decode per pair: the repeats are the same thread's
            // loads of one unit, served from L1
            #pragma unroll
            for (int j = 0; j < G; ++j) {
                if (j > 0 && j >= cnt) break;
                XFrag xf;
                load_xfrag(xf, q[j], u);
                acc[j] += int_unit_dot<T>(row, u, xf);
            }
        }
    }
}

#if GROUPED_DOWN
// Whether an item of the expert at `blob` takes the integer path: only the expert and the
// layer's geometry decide (never the item's other pairs). The rows are read in place (as the
// direct path reads them) whatever INT_DIRECT says: where a row is read changes no bit.
template <int T>
__device__ __forceinline__ bool down_group_int_ok(const ExpertSpec& sp, const u8* blob) {
    return blob != nullptr &&
           (((u64)blob | (u64)sp.down_at | (u64)sp.down_row_bytes) & (u64)(int_row_align(T) - 1))
               == 0 &&
           sp.n_ff % 64 == 0 && sp.n_ff <= GROUP_DOWN_FF_MAX;
}

// The integer path for the cnt <= EXPERT_GROUP_ROWS pairs order[0 .. cnt) of the expert at `blob`:
// each pair's act row times its routing weight quantized into its own shared copy (as
// moe_down_int folds wts into its quantization: the same 32-column blocks), then warp w takes
// outputs d0 + w, d0 + w + INT_WARPS, ... of the block, its lanes the units, one xor tree a pair.
template <int T>
__device__ __forceinline__ void down_group_int(const ExpertSpec& sp, const float* __restrict__ act,
                                               const float* __restrict__ wts,
                                               const u8* __restrict__ blob,
                                               const int* __restrict__ order, int cnt,
                                               float* __restrict__ partial) {
    constexpr int G = EXPERT_GROUP_ROWS;
    __shared__ __align__(16) u32 xh[G][xq_words(GROUP_DOWN_FF_MAX)],
        xl[G][xq_words(GROUP_DOWN_FF_MAX)];
    __shared__ float xstep[G][GROUP_DOWN_FF_MAX / 32], xsum[G][GROUP_DOWN_FF_MAX / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int pair[G];
    XQ q[G];
    #pragma unroll
    for (int j = 0; j < G; ++j) {
        pair[j] = order[min(j, cnt - 1)];
        q[j] = XQ{xh[j], xl[j], xstep[j], xsum[j]};
    }
    for (int j = 0; j < cnt; ++j) {          // (order, not pair: j is not a constant here)
        const int p = order[j];
        quantize_x(act + (i64)p * sp.n_ff, sp.n_ff, wts + p, sp.n_ff,
                   XQ{xh[j], xl[j], xstep[j], xsum[j]});
    }
    __syncthreads();
    const int units = sp.n_ff >> 6;
    const i64 rb = sp.down_row_bytes;
    for (int d = blockIdx.x * INT_DOWN_BLOCK + warp;
         d < min(sp.n_embd, (int)(blockIdx.x + 1) * INT_DOWN_BLOCK); d += INT_WARPS) {
        float acc[G];
        down_lane_units<T, G>(blob + sp.down_at + (i64)d * rb, units, lane, q, cnt, acc);
        #pragma unroll
        for (int j = 0; j < G; ++j) {
            if (j > 0 && j >= cnt) break;
            const float s = warp_sum(acc[j]);
            if (lane == 0) partial[(i64)pair[j] * sp.n_embd + d] = s;
        }
    }
}

// pairs of one float-path pass: as many of the item's as keep DOWN_PER_BLOCK * rows sums at 16 a
// thread (FLOAT_GROUP_ROWS' bound for the gate/up's 2 * FF_PER_BLOCK)
constexpr int FLOAT_DOWN_GROUP_ROWS =
    EXPERT_GROUP_ROWS * DOWN_PER_BLOCK <= 16 ? EXPERT_GROUP_ROWS
                                             : (16 / DOWN_PER_BLOCK > 0 ? 16 / DOWN_PER_BLOCK : 1);

// The float path (moe_down_body's arithmetic, one pair's chunks alone) for the cnt pairs
// order[0 .. cnt) of the expert at `blob`, outputs d0 .. d0 + DOWN_PER_BLOCK: each thread takes
// chunks c = threadIdx.x, + blockDim.x, ... of each pair's act row, scaled by the pair's weight
// before the dot (where moe_down_body scales them), the down rows' chunks loaded once a pass.
template <int T>
__device__ __forceinline__ void down_group_float(const ExpertSpec& sp,
                                                 const float* __restrict__ act,
                                                 const float* __restrict__ wts,
                                                 const u8* __restrict__ blob,
                                                 const int* __restrict__ order, int cnt,
                                                 float* __restrict__ partial, int d0) {
    constexpr int G = FLOAT_DOWN_GROUP_ROWS, R = DOWN_PER_BLOCK;
    __shared__ float sums[R * G];
    if (blob == nullptr) {      // not resident: NaN, as moe_down_body adds it
        for (int j = 0; j < cnt; ++j)
            if (threadIdx.x < R && d0 + threadIdx.x < sp.n_embd)
                partial[(i64)order[j] * sp.n_embd + d0 + threadIdx.x] = NAN_F32;
        return;
    }
    const u8* rows[R];
    #pragma unroll
    for (int r = 0; r < R; ++r)         // a row past n_embd repeats the last (its sums dropped)
        rows[r] = blob + sp.down_at + (i64)min(d0 + r, sp.n_embd - 1) * sp.down_row_bytes;
    const int nchunks = sp.n_ff >> 3;
    for (int j0 = 0; j0 < cnt; j0 += G) {
        const int m = min(G, cnt - j0);
        const float* xs[G];
        float ws[G];
        #pragma unroll
        for (int j = 0; j < G; ++j) {       // a pass short of G pairs repeats its last (dropped)
            const int p = order[j0 + min(j, m - 1)];
            xs[j] = act + (i64)p * sp.n_ff;
            ws[j] = wts[p];
        }
        float acc[R * G];
        #pragma unroll
        for (int a = 0; a < R * G; ++a) acc[a] = 0.f;
        #pragma unroll 2
        for (int c = threadIdx.x; c < nchunks; c += blockDim.x) {
            float xv[G][8], xsum[G];
            #pragma unroll
            for (int j = 0; j < G; ++j) {
                load8(xs[j] + 8 * c, xv[j]);
                #pragma unroll
                for (int e = 0; e < 8; ++e) xv[j][e] *= ws[j];
                xsum[j] = ChunkDot<T>::needs_xsum ? sum8(xv[j]) : 0.f;
            }
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                ChunkDot<T> w;
                w.load(rows[r], c);
                #pragma unroll
                for (int j = 0; j < G; ++j) acc[r * G + j] = w.dot(xv[j], xsum[j], acc[r * G + j]);
            }
        }
        block_reduce<R * G>(acc, sums);
        if (threadIdx.x < R * G) {
            const int r = threadIdx.x / G, j = threadIdx.x - r * G;
            if (j < m && d0 + r < sp.n_embd)
                partial[(i64)order[j0 + j] * sp.n_embd + d0 + r] = sums[threadIdx.x];
        }
    }
}

// partial[p, d] for the pairs of work item blockIdx.y (groups: moe_group_pairs' layout) and the
// block's outputs d (the grid's x as moe_down_<type>'s: KernelShape down_block); an empty item
// returns at once. The integer types take the integer path where down_group_int_ok, else the
// float path over the block's range, DOWN_PER_BLOCK at a time (as moe_down_<type> falls back).
template <int T>
__device__ __forceinline__ void moe_down_grouped(const ExpertSpec& sp,
                                                 const float* __restrict__ act,
                                                 const u64* __restrict__ blobs,
                                                 const float* __restrict__ wts,
                                                 const int* __restrict__ groups,
                                                 float* __restrict__ partial) {
    const int2 item = reinterpret_cast<const int2*>(groups)[blockIdx.y];
    if (item.y == 0) return;
    const int* order = groups + group_order_at(sp.k) + item.x;
    const int cnt = item.y;
    const u8* blob = reinterpret_cast<const u8*>(blobs[order[0]]);   // the group's one expert
    if constexpr (INT_DOWN && int_type(T)) {
        if (down_group_int_ok<T>(sp, blob)) {
            down_group_int<T>(sp, act, wts, blob, order, cnt, partial);
            return;
        }
        const int d_end = min((int)(blockIdx.x + 1) * INT_DOWN_BLOCK, sp.n_embd);
        for (int d0 = blockIdx.x * INT_DOWN_BLOCK; d0 < d_end; d0 += DOWN_PER_BLOCK)
            down_group_float<T>(sp, act, wts, blob, order, cnt, partial, d0);
    } else {
        down_group_float<T>(sp, act, wts, blob, order, cnt, partial, blockIdx.x * DOWN_PER_BLOCK);
    }
}

#define MOE_DOWN_GROUPED_KERNELS(name, T, ...)                                                   \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_down_grouped_##name(          \
            const ExpertSpec* __restrict__ spec, const float* __restrict__ act,                  \
            const u64* __restrict__ blobs, const float* __restrict__ wts,                        \
            const int* __restrict__ groups, float* __restrict__ partial) {                       \
        pdl_entry();                                                                             \
        moe_down_grouped<T>(*spec, act, blobs, wts, groups, partial);                            \
    }
FOR_EACH_TYPE(MOE_DOWN_GROUPED_KERNELS)

// h[i, d] += down_combine(...) for the step's rows: grid (outputs / BLOCK_THREADS, rows)
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
moe_down_combine(const ExpertSpec* __restrict__ spec, const float* __restrict__ partial,
                 float* __restrict__ h) {
    pdl_entry();
    const int n_embd = spec->n_embd, k = spec->k, i = blockIdx.y;
    for (int d = blockIdx.x * blockDim.x + threadIdx.x; d < n_embd; d += gridDim.x * blockDim.x)
        h[(i64)i * n_embd + d] += down_combine(partial, n_embd, k, i, d);
}
#endif
