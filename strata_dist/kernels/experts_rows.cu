// strata-dist expert kernels for many rows (prompt chunks, and every expert computation off the
// decode graph): the (row, rank) pairs of a layer are sorted by expert on the host, cut into work
// items of at most TILE_M pairs of one expert, and each block computes one item against a tile of
// TILE_N outputs, reading the expert's blob (cache slot, loaned slot or staged copy: any address)
// in its stored blocks.
//
// Two builds: float32 FMA (`moe_*_rows_<type>`: every output one thread's sum over the columns in
// column order) and tensor cores (`moe_*_rows_mma_<type>`, below). In both a pair's result does
// not depend on which other pairs share its item, its launch or its tier, so the bits are the
// same whichever store computed the expert and however the chunk was grouped.
#include "weights.cuh"
#include "mma.cuh"
#include "routing.cuh"

#define TILE_M 32     // (row, rank) pairs of one work item
#define TILE_N 64     // outputs of one block
#define TILE_K 32     // columns staged in shared memory per step (four chunks of 8)

// A work item: the blob of its expert (an index into `blobs`), its first pair in the sorted order
// and how many pairs it takes (<= TILE_M; 0: an unused item of a launch sized before the count
// was known, which leaves at once).
struct RowsItem {
    int blob, start, count, pad;
};

// Thread t of 256 owns pairs 2 * (t / 16) + {0, 1} and outputs 4 * (t % 16) + {0, 1, 2, 3} of the
// tile: 8 sums, each a sequential fmaf over the columns.
#define OWN_M(t) (2 * ((t) >> 4))
#define OWN_N(t) (4 * ((t) & 15))

// What thread t stages of TILE_K columns [k0, k0 + TILE_K), in both builds: four consecutive
// columns 4 (t % 8) .. of the item's input row m = t / 8 (zeros past `count`) ...
__device__ __forceinline__ float4 tile_row_values(const float* __restrict__ x, int x_cols,
                                                  const int* __restrict__ rows, int count, int k0,
                                                  int m, int c) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m < count)
        v = __ldg(reinterpret_cast<const float4*>(x + (i64)rows[m] * x_cols + k0 + c));
    return v;
}

// ... and chunk q = t % 4 of weight row n0 + n, n = t / 4, decoded (rows past `nrows` read the
// last row and are never written out)
template <int T>
__device__ __forceinline__ void tile_weight_chunk(const u8* __restrict__ base, i64 row_bytes,
                                                  int n0, int nrows, int k0, int n, int q,
                                                  float (&w)[8]) {
    chunk8<T>(base + (i64)min(n0 + n, nrows - 1) * row_bytes, (k0 >> 3) + q, w);
}

// The FMA build's staging: input rows into xs[k][m], weights into ws[k][n].
__device__ __forceinline__ void stage_rows(float (*xs)[TILE_M], const float* __restrict__ x,
                                           int x_cols, const int* __restrict__ rows, int count,
                                           int k0) {
    const int m = threadIdx.x >> 3, c = 4 * (threadIdx.x & 7);
    const float4 v = tile_row_values(x, x_cols, rows, count, k0, m, c);
    xs[c][m] = v.x; xs[c + 1][m] = v.y; xs[c + 2][m] = v.z; xs[c + 3][m] = v.w;
}

template <int T>
__device__ __forceinline__ void stage_weights(float (*ws)[TILE_N], const u8* __restrict__ base,
                                              i64 row_bytes, int n0, int nrows, int k0) {
    const int n = threadIdx.x >> 2, q = threadIdx.x & 3;
    float w[8];
    tile_weight_chunk<T>(base, row_bytes, n0, nrows, k0, n, q, w);
    #pragma unroll
    for (int j = 0; j < 8; ++j) ws[8 * q + j][n] = w[j];
}

// ---- staging and fragments of the tensor-core build -------------------------------------------
// mma.sync m16n8k16 (f16 inputs, f32 accumulation): the input rows and the decoded weights are
// rounded to f16 in shared memory (as cuBLAS's f16 products round them). A row's TILE_K values are
// first multiplied by a power of two that puts their largest near 2^14 (exact, and activations of
// any size stay inside f16's range: SwiGLU outputs overflow 65504 on real weights), the tile's
// product is divided by it in f32; outputs accumulate tile after tile in column order, so a pair's
// bits still do not depend on its neighbours.
// 8 warps: warp w takes the 16 pairs (w & 1) and the 16 outputs 16 * (w >> 1) of the 32 x 64 tile.
#define MMA_PAD 8                   // halves of padding per shared row: conflict-free fragments
#define MMA_LD (TILE_K + MMA_PAD)   // 40 halves = 80 bytes per row

// TILE_K columns of the item's rows as f16, xs[m][k] = x * 2^-unscale[m] (zeros past `count`);
// the 8 threads of row m are 8 neighbouring lanes of one warp
__device__ __forceinline__ void stage_rows_h(__half (*xs)[MMA_LD], float* unscale,
                                             const float* __restrict__ x, int x_cols,
                                             const int* __restrict__ rows, int count, int k0) {
    const int m = threadIdx.x >> 3, c = 4 * (threadIdx.x & 7);
    const float4 v = tile_row_values(x, x_cols, rows, count, k0, m, c);
    float top = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    #pragma unroll
    for (int lane = 1; lane < 8; lane <<= 1)
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, lane));
    int e = 0;
    frexpf(top, &e);                     // top < 2^e (e = 0 for a row of zeros)
    const float up = ldexpf(1.f, 14 - e);
    if ((threadIdx.x & 7) == 0) unscale[m] = ldexpf(1.f, e - 14);
    uint2 packed;
    packed.x = pack_half2(v.x * up, v.y * up);
    packed.y = pack_half2(v.z * up, v.w * up);
    *reinterpret_cast<uint2*>(&xs[m][c]) = packed;
}

// chunk q of weight row n as f16, ws[n][8q .. 8q+7]
template <int T>
__device__ __forceinline__ void stage_weights_h(__half (*ws)[MMA_LD], const u8* __restrict__ base,
                                                i64 row_bytes, int n0, int nrows, int k0) {
    const int n = threadIdx.x >> 2, q = threadIdx.x & 3;
    float w[8];
    tile_weight_chunk<T>(base, row_bytes, n0, nrows, k0, n, q, w);
    uint4 packed;
    packed.x = pack_half2(w[0], w[1]);
    packed.y = pack_half2(w[2], w[3]);
    packed.z = pack_half2(w[4], w[5]);
    packed.w = pack_half2(w[6], w[7]);
    *reinterpret_cast<uint4*>(&ws[n][8 * q]) = packed;
}

// The A fragment of rows m0.. and the B fragments of outputs n0.. for the k16 step at kk.
__device__ __forceinline__ void load_a(u32 (&a)[4], __half (*xs)[MMA_LD], int m0, int kk) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    a[0] = *reinterpret_cast<const u32*>(&xs[m0 + g][kk + 2 * t]);
    a[1] = *reinterpret_cast<const u32*>(&xs[m0 + g + 8][kk + 2 * t]);
    a[2] = *reinterpret_cast<const u32*>(&xs[m0 + g][kk + 8 + 2 * t]);
    a[3] = *reinterpret_cast<const u32*>(&xs[m0 + g + 8][kk + 8 + 2 * t]);
}

__device__ __forceinline__ void load_b(u32& b0, u32& b1, __half (*ws)[MMA_LD], int n0, int kk) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    b0 = *reinterpret_cast<const u32*>(&ws[n0 + g][kk + 2 * t]);
    b1 = *reinterpret_cast<const u32*>(&ws[n0 + g][kk + 8 + 2 * t]);
}

// ---- one tile ----------------------------------------------------------------------------------
// Where this thread's output acc[i][r] lies in the 32 x 64 tile: pair m, output n.
template <bool MMA>
__device__ __forceinline__ void tile_coord(int i, int r, int& m, int& n) {
    const int t = threadIdx.x;
    if constexpr (MMA) {                     // the C fragment of n8 tile i of the warp's 16 x 16
        const int warp = t >> 5, g = (t & 31) >> 2, q = t & 3;
        m = 16 * (warp & 1) + g + 8 * (r >> 1);
        n = 16 * (warp >> 1) + 8 * i + 2 * q + (r & 1);
    } else {
        m = OWN_M(t) + i;
        n = OWN_N(t) + r;
    }
}

// acc[mat][i][r] += the item's input rows (x rows `rows`, `count` of them, K columns) times rows
// out0.. of each of the NMAT weight matrices (bases[mat], row_bytes[mat] a row; rows past `nrows`
// repeat the last). NMAT = 2: gate and up share the staged input rows.
template <int T, int NMAT, bool MMA>
__device__ __forceinline__ void tile_products(float (&acc)[NMAT][2][4], const float* __restrict__ x,
                                              int K, const int* __restrict__ rows, int count,
                                              const u8* const (&bases)[NMAT],
                                              const i64 (&row_bytes)[NMAT], int out0, int nrows) {
    if constexpr (MMA) {
        __shared__ __align__(16) __half xs[TILE_M][MMA_LD];
        __shared__ __align__(16) __half ws[NMAT][TILE_N][MMA_LD];
        __shared__ float unscale[TILE_M];
        const int warp = threadIdx.x >> 5, m0 = 16 * (warp & 1), n0 = 16 * (warp >> 1);
        const int g = (threadIdx.x & 31) >> 2;   // C fragment rows m0 + g (r < 2), m0 + g + 8
        for (int k0 = 0; k0 < K; k0 += TILE_K) {
            stage_rows_h(xs, unscale, x, K, rows, count, k0);
            #pragma unroll
            for (int mat = 0; mat < NMAT; ++mat)
                stage_weights_h<T>(ws[mat], bases[mat], row_bytes[mat], out0, nrows, k0);
            __syncthreads();
            float part[NMAT][2][4] = {};
            #pragma unroll
            for (int kk = 0; kk < TILE_K; kk += 16) {
                u32 a[4];
                load_a(a, xs, m0, kk);
                #pragma unroll
                for (int i = 0; i < 2; ++i) {
                    #pragma unroll
                    for (int mat = 0; mat < NMAT; ++mat) {
                        u32 b0, b1;
                        load_b(b0, b1, ws[mat], n0 + 8 * i, kk);
                        mma_16816(part[mat][i], a, b0, b1);
                    }
                }
            }
            const float lo = unscale[m0 + g], hi = unscale[m0 + g + 8];
            #pragma unroll
            for (int mat = 0; mat < NMAT; ++mat) {
                #pragma unroll
                for (int i = 0; i < 2; ++i) {
                    #pragma unroll
                    for (int r = 0; r < 4; ++r)
                        acc[mat][i][r] = fmaf(part[mat][i][r], r < 2 ? lo : hi, acc[mat][i][r]);
                }
            }
            __syncthreads();
        }
    } else {
        __shared__ __align__(16) float xs[TILE_K][TILE_M];
        __shared__ __align__(16) float ws[NMAT][TILE_K][TILE_N];
        const int t = threadIdx.x;
        for (int k0 = 0; k0 < K; k0 += TILE_K) {
            stage_rows(xs, x, K, rows, count, k0);
            #pragma unroll
            for (int mat = 0; mat < NMAT; ++mat)
                stage_weights<T>(ws[mat], bases[mat], row_bytes[mat], out0, nrows, k0);
            __syncthreads();
            #pragma unroll 8
            for (int kk = 0; kk < TILE_K; ++kk) {
                const float2 xv = *reinterpret_cast<const float2*>(&xs[kk][OWN_M(t)]);
                const float xa[2] = {xv.x, xv.y};
                #pragma unroll
                for (int mat = 0; mat < NMAT; ++mat) {
                    const float4 wv = *reinterpret_cast<const float4*>(&ws[mat][kk][OWN_N(t)]);
                    const float w[4] = {wv.x, wv.y, wv.z, wv.w};
                    #pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        #pragma unroll
                        for (int r = 0; r < 4; ++r)
                            acc[mat][i][r] = fmaf(w[r], xa[i], acc[mat][i][r]);
                    }
                }
            }
            __syncthreads();
        }
    }
}

// ---- the two launches of a layer --------------------------------------------------------------
// act[p, f] = silu(gate_f . x_row(p)) * (up_f . x_row(p)) for the pairs p of each work item.
// Grid (items, ceil(n_ff / TILE_N)), 256 threads. rows[p]: the input row of sorted pair p.
template <int T, bool MMA>
__device__ __forceinline__ void gate_up_rows(const u64* __restrict__ blobs,
                                             const RowsItem* __restrict__ items,
                                             const int* __restrict__ rows,
                                             const float* __restrict__ x, int n_embd, i64 up_at,
                                             i64 gate_row_bytes, i64 up_row_bytes, int n_ff,
                                             float* __restrict__ act) {
    const RowsItem it = items[blockIdx.x];
    if (it.count == 0) return;                          // the whole block: uniform
    const u8* blob = reinterpret_cast<const u8*>(blobs[it.blob]);
    const int f0 = blockIdx.y * TILE_N;
    const u8* const bases[2] = {blob, blob + up_at};
    const i64 row_bytes[2] = {gate_row_bytes, up_row_bytes};
    float acc[2][2][4] = {};                 // [gate | up][i][r]
    tile_products<T, 2, MMA>(acc, x, n_embd, rows + it.start, it.count, bases, row_bytes, f0, n_ff);
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
            int m, n;
            tile_coord<MMA>(i, r, m, n);
            const int f = f0 + n;
            const float g = acc[0][i][r], u = acc[1][i][r];
            if (m < it.count && f < n_ff)
                act[(i64)(it.start + m) * n_ff + f] = g / (1.f + expf(-g)) * u;
        }
    }
}

// y[dest[p], o] = down_o . act[p] for the pairs p of each work item (dest: row * k + rank of the
// unsorted output). Grid (items, ceil(n_embd / TILE_N)), 256 threads.
template <int T, bool MMA>
__device__ __forceinline__ void down_rows(const u64* __restrict__ blobs,
                                          const RowsItem* __restrict__ items,
                                          const int* __restrict__ dest,
                                          const float* __restrict__ act, int n_ff, i64 down_at,
                                          i64 down_row_bytes, int n_embd, float* __restrict__ y) {
    __shared__ int own_rows[TILE_M];
    const RowsItem it = items[blockIdx.x];
    if (it.count == 0) return;                          // the whole block: uniform
    const u8* const bases[1] = {reinterpret_cast<const u8*>(blobs[it.blob]) + down_at};
    const i64 row_bytes[1] = {down_row_bytes};
    const int o0 = blockIdx.y * TILE_N;
    if (threadIdx.x < TILE_M) own_rows[threadIdx.x] = it.start + threadIdx.x;   // sorted pairs
    __syncthreads();
    float acc[1][2][4] = {};
    tile_products<T, 1, MMA>(acc, act, n_ff, own_rows, it.count, bases, row_bytes, o0, n_embd);
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
            int m, n;
            tile_coord<MMA>(i, r, m, n);
            const int o = o0 + n;
            if (m < it.count && o < n_embd) y[(i64)dest[it.start + m] * n_embd + o] = acc[0][i][r];
        }
    }
}

#define ROWS_KERNEL_PAIR(name, T, suffix, MMA)                                                    \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_gate_up_rows##suffix##name(   \
            const u64* __restrict__ blobs, const RowsItem* __restrict__ items,                   \
            const int* __restrict__ rows, const float* __restrict__ x, int n_embd, i64 up_at,    \
            i64 gate_row_bytes, i64 up_row_bytes, int n_ff, float* __restrict__ act) {           \
        gate_up_rows<T, MMA>(blobs, items, rows, x, n_embd, up_at, gate_row_bytes, up_row_bytes, \
                             n_ff, act);                                                         \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_down_rows##suffix##name(      \
            const u64* __restrict__ blobs, const RowsItem* __restrict__ items,                   \
            const int* __restrict__ dest, const float* __restrict__ act, int n_ff, i64 down_at,  \
            i64 down_row_bytes, int n_embd, float* __restrict__ y) {                             \
        down_rows<T, MMA>(blobs, items, dest, act, n_ff, down_at, down_row_bytes, n_embd, y);    \
    }
#define ROWS_KERNELS(name, T) \
    ROWS_KERNEL_PAIR(name, T, _, false) ROWS_KERNEL_PAIR(name, T, _mma_, true)
FOR_EACH_TYPE(ROWS_KERNELS)

// ---- a chunk routed and grouped on the device (STRATA_DEVICE_ROUTING, backends/expert_rows.py) --
// The same sorted layout the host builds (kernels/abi.py group_layout): the pairs p = row * k +
// rank grouped by expert in ascending order, each group in row-major order, cut into items of at
// most TILE_M pairs. No host round trip: the items are sized for the worst case and unused ones
// carry count 0.
#define MAX_GROUP_EXPERTS 512

// ids[i, r], wts[i, r] of n router rows (logits [n, n_expert]): the top-k in rank order, weights
// renormalised over the k when `normalize`; -1 and NaN where a row's logits pick nothing. A warp
// per row: grid ceil(n / 8), 256 threads.
extern "C" __global__ void route_rows(const float* __restrict__ logits, int n, int n_expert, int k,
                                      int normalize, int* __restrict__ ids,
                                      float* __restrict__ wts) {
    const int i = blockIdx.x * (BLOCK_THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (i >= n) return;                                 // the whole warp: uniform
    int mine;
    float mine_p, picked_sum;
    const float* l = logits + (i64)i * n_expert;
    if (n_expert <= 128) topk_softmax_row<4>(l, n_expert, k, lane, mine, mine_p, picked_sum);
    else topk_softmax_row<16>(l, n_expert, k, lane, mine, mine_p, picked_sum);
    if (lane < k) {
        const bool picked = mine >= 0 && mine < n_expert;
        ids[i * k + lane] = picked ? mine : -1;
        wts[i * k + lane] = !picked ? NAN_F32 : normalize ? mine_p / picked_sum : mine_p;
    }
}

// counts[e] = the pairs routed to expert e, and each such pair's place among them in row-major
// order (rank_in_expert[p]). A warp per expert scans every pair: grid n_expert, 32 threads.
extern "C" __global__ void group_count(const int* __restrict__ ids, int pairs,
                                       int* __restrict__ rank_in_expert, int* __restrict__ counts) {
    const int e = blockIdx.x, lane = threadIdx.x;
    int running = 0;
    for (int base = 0; base < pairs; base += 32) {
        const int p = base + lane;
        const bool mine = p < pairs && ids[p] == e;
        const u32 ballot = __ballot_sync(0xffffffffu, mine);
        if (mine) rank_in_expert[p] = running + __popc(ballot & ((1u << lane) - 1u));
        running += __popc(ballot);
    }
    if (lane == 0) counts[e] = running;
}

// starts[e] (expert e's first sorted pair) and the work items, experts in ascending order, each
// expert's pairs in TILE_M pieces; items past the last used one get count 0. One block.
extern "C" __global__ void group_items(const int* __restrict__ counts, int n_expert,
                                       int max_items, int* __restrict__ starts,
                                       RowsItem* __restrict__ items) {
    __shared__ int count_of[MAX_GROUP_EXPERTS], start_of[MAX_GROUP_EXPERTS];
    __shared__ int item_of[MAX_GROUP_EXPERTS + 1];
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) count_of[e] = counts[e];
    __syncthreads();
    if (threadIdx.x == 0) {           // a few hundred additions: one thread, in order
        int pair = 0, item = 0;
        for (int e = 0; e < n_expert; ++e) {
            start_of[e] = pair;
            item_of[e] = item;
            pair += count_of[e];
            item += (count_of[e] + TILE_M - 1) / TILE_M;
        }
        item_of[n_expert] = item;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        starts[e] = start_of[e];
        for (int t = 0; t * TILE_M < count_of[e]; ++t) {
            RowsItem it;
            it.blob = e;
            it.start = start_of[e] + t * TILE_M;
            it.count = min(TILE_M, count_of[e] - t * TILE_M);
            it.pad = 0;
            items[item_of[e] + t] = it;
        }
    }
    for (int j = item_of[n_expert] + threadIdx.x; j < max_items; j += blockDim.x) {
        RowsItem none;
        none.blob = 0; none.start = 0; none.count = 0; none.pad = 0;
        items[j] = none;
    }
}

// Each routed pair to its sorted place: rows[q] = its input row, dest[q] = p (its output row of
// the [n * k, d] result). Pairs that picked no expert are left out. Grid ceil(pairs / 256).
extern "C" __global__ void group_scatter(const int* __restrict__ ids, int pairs, int k,
                                         int n_expert, const int* __restrict__ rank_in_expert,
                                         const int* __restrict__ starts, int* __restrict__ rows,
                                         int* __restrict__ dest) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= pairs) return;
    const int e = ids[p];
    if (e < 0 || e >= n_expert) return;
    const int at = starts[e] + rank_in_expert[p];
    rows[at] = p / k;
    dest[at] = p;
}
