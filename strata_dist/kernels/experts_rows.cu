// strata-dist expert kernels for many rows (prompt chunks, and every expert computation off the
// decode graph): the (row, rank) pairs of a layer are sorted by expert on the host, cut into work
// items of at most TILE_M pairs of one expert, and each block computes one item against a tile of
// TILE_N outputs, reading the expert's blob (cache slot, loaned slot or staged copy: any address)
// in its stored blocks.
//
// Every output is one thread's sum over the columns in column order (fmaf, float32): a pair's
// result does not depend on which other pairs share its item, its launch or its tier, so the bits
// are the same whichever store computed the expert and however the chunk was grouped.
#include "weights.cuh"

#define TILE_M 32     // (row, rank) pairs of one work item
#define TILE_N 64     // outputs of one block
#define TILE_K 32     // columns staged in shared memory per step (four chunks of 8)

// A work item: the blob of its expert (an index into `blobs`), its first pair in the sorted order
// and how many pairs it takes (<= TILE_M).
struct RowsItem {
    int blob, start, count, pad;
};

// Thread t of 256 owns pairs 2 * (t / 16) + {0, 1} and outputs 4 * (t % 16) + {0, 1, 2, 3} of the
// tile: 8 sums, each a sequential fmaf over the columns.
#define OWN_M(t) (2 * ((t) >> 4))
#define OWN_N(t) (4 * ((t) & 15))

// Stage TILE_K columns [k0, k0 + TILE_K) of the item's input rows into xs[k][m] (zeros past
// `count`): thread t loads four consecutive columns of one row.
__device__ __forceinline__ void stage_rows(float (*xs)[TILE_M], const float* __restrict__ x,
                                           int x_cols, const int* __restrict__ rows, int count,
                                           int k0) {
    const int m = threadIdx.x >> 3, c = 4 * (threadIdx.x & 7);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m < count)
        v = __ldg(reinterpret_cast<const float4*>(x + (i64)rows[m] * x_cols + k0 + c));
    xs[c][m] = v.x; xs[c + 1][m] = v.y; xs[c + 2][m] = v.z; xs[c + 3][m] = v.w;
}

// Decode chunk q of TILE_K / 8 of weight row n of the tile into ws[8q .. 8q+7][n] (thread t:
// n = t / 4, q = t % 4). Rows past `nrows` read the last row and are never written out.
template <int T>
__device__ __forceinline__ void stage_weights(float (*ws)[TILE_N], const u8* __restrict__ base,
                                              i64 row_bytes, int n0, int nrows, int k0) {
    const int n = threadIdx.x >> 2, q = threadIdx.x & 3;
    const u8* row = base + (i64)min(n0 + n, nrows - 1) * row_bytes;
    float w[8];
    chunk8<T>(row, (k0 >> 3) + q, w);
    #pragma unroll
    for (int j = 0; j < 8; ++j) ws[8 * q + j][n] = w[j];
}

// act[p, f] = silu(gate_f . x_row(p)) * (up_f . x_row(p)) for the pairs p of each work item.
// Grid (items, ceil(n_ff / TILE_N)), 256 threads. rows[p]: the input row of sorted pair p.
template <int T>
__device__ __forceinline__ void gate_up_rows(const u64* __restrict__ blobs,
                                             const RowsItem* __restrict__ items,
                                             const int* __restrict__ rows,
                                             const float* __restrict__ x, int n_embd, i64 up_at,
                                             i64 gate_row_bytes, i64 up_row_bytes, int n_ff,
                                             float* __restrict__ act) {
    __shared__ __align__(16) float xs[TILE_K][TILE_M];
    __shared__ __align__(16) float gs[TILE_K][TILE_N];
    __shared__ __align__(16) float us[TILE_K][TILE_N];
    const RowsItem it = items[blockIdx.x];
    const u8* blob = reinterpret_cast<const u8*>(blobs[it.blob]);
    const int f0 = blockIdx.y * TILE_N, t = threadIdx.x;
    const int* my_rows = rows + it.start;
    float g[2][4], u[2][4];
    #pragma unroll
    for (int a = 0; a < 2; ++a) {
        #pragma unroll
        for (int b = 0; b < 4; ++b) { g[a][b] = 0.f; u[a][b] = 0.f; }
    }
    for (int k0 = 0; k0 < n_embd; k0 += TILE_K) {
        stage_rows(xs, x, n_embd, my_rows, it.count, k0);
        stage_weights<T>(gs, blob, gate_row_bytes, f0, n_ff, k0);
        stage_weights<T>(us, blob + up_at, up_row_bytes, f0, n_ff, k0);
        __syncthreads();
        #pragma unroll 8
        for (int kk = 0; kk < TILE_K; ++kk) {
            const float2 xv = *reinterpret_cast<const float2*>(&xs[kk][OWN_M(t)]);
            const float4 gv = *reinterpret_cast<const float4*>(&gs[kk][OWN_N(t)]);
            const float4 uv = *reinterpret_cast<const float4*>(&us[kk][OWN_N(t)]);
            const float xa[2] = {xv.x, xv.y}, gw[4] = {gv.x, gv.y, gv.z, gv.w},
                        uw[4] = {uv.x, uv.y, uv.z, uv.w};
            #pragma unroll
            for (int a = 0; a < 2; ++a) {
                #pragma unroll
                for (int b = 0; b < 4; ++b) {
                    g[a][b] = fmaf(gw[b], xa[a], g[a][b]);
                    u[a][b] = fmaf(uw[b], xa[a], u[a][b]);
                }
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int a = 0; a < 2; ++a) {
        const int m = OWN_M(t) + a;
        if (m >= it.count) continue;
        #pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int f = f0 + OWN_N(t) + b;
            if (f < n_ff)
                act[(i64)(it.start + m) * n_ff + f] = g[a][b] / (1.f + expf(-g[a][b])) * u[a][b];
        }
    }
}

// y[dest[p], o] = down_o . act[p] for the pairs p of each work item (dest: row * k + rank of the
// unsorted output). Grid (items, ceil(n_embd / TILE_N)), 256 threads.
template <int T>
__device__ __forceinline__ void down_rows(const u64* __restrict__ blobs,
                                          const RowsItem* __restrict__ items,
                                          const int* __restrict__ dest,
                                          const float* __restrict__ act, int n_ff, i64 down_at,
                                          i64 down_row_bytes, int n_embd, float* __restrict__ y) {
    __shared__ __align__(16) float xs[TILE_K][TILE_M];
    __shared__ __align__(16) float ws[TILE_K][TILE_N];
    __shared__ int own_rows[TILE_M];
    const RowsItem it = items[blockIdx.x];
    const u8* blob = reinterpret_cast<const u8*>(blobs[it.blob]) + down_at;
    const int o0 = blockIdx.y * TILE_N, t = threadIdx.x;
    if (t < TILE_M) own_rows[t] = it.start + t;          // act rows are the sorted pairs
    __syncthreads();
    float acc[2][4];
    #pragma unroll
    for (int a = 0; a < 2; ++a) {
        #pragma unroll
        for (int b = 0; b < 4; ++b) acc[a][b] = 0.f;
    }
    for (int k0 = 0; k0 < n_ff; k0 += TILE_K) {
        stage_rows(xs, act, n_ff, own_rows, it.count, k0);
        stage_weights<T>(ws, blob, down_row_bytes, o0, n_embd, k0);
        __syncthreads();
        #pragma unroll 8
        for (int kk = 0; kk < TILE_K; ++kk) {
            const float2 xv = *reinterpret_cast<const float2*>(&xs[kk][OWN_M(t)]);
            const float4 wv = *reinterpret_cast<const float4*>(&ws[kk][OWN_N(t)]);
            const float xa[2] = {xv.x, xv.y}, w[4] = {wv.x, wv.y, wv.z, wv.w};
            #pragma unroll
            for (int a = 0; a < 2; ++a) {
                #pragma unroll
                for (int b = 0; b < 4; ++b) acc[a][b] = fmaf(w[b], xa[a], acc[a][b]);
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int a = 0; a < 2; ++a) {
        const int m = OWN_M(t) + a;
        if (m >= it.count) continue;
        const i64 at = (i64)dest[it.start + m] * n_embd;
        #pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int o = o0 + OWN_N(t) + b;
            if (o < n_embd) y[at + o] = acc[a][b];
        }
    }
}

#define ROWS_KERNELS(name, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_gate_up_rows_##name(          \
            const u64* __restrict__ blobs, const RowsItem* __restrict__ items,                   \
            const int* __restrict__ rows, const float* __restrict__ x, int n_embd, i64 up_at,    \
            i64 gate_row_bytes, i64 up_row_bytes, int n_ff, float* __restrict__ act) {           \
        gate_up_rows<T>(blobs, items, rows, x, n_embd, up_at, gate_row_bytes, up_row_bytes,      \
                        n_ff, act);                                                              \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_down_rows_##name(             \
            const u64* __restrict__ blobs, const RowsItem* __restrict__ items,                   \
            const int* __restrict__ dest, const float* __restrict__ act, int n_ff, i64 down_at,  \
            i64 down_row_bytes, int n_embd, float* __restrict__ y) {                             \
        down_rows<T>(blobs, items, dest, act, n_ff, down_at, down_row_bytes, n_embd, y);         \
    }
FOR_EACH_TYPE(ROWS_KERNELS)
