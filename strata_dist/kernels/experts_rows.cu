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
#include "weights_half.cuh"
#include "mma.cuh"
#include "async_copy.cuh"
#include "routing.cuh"

#define TILE_M 128    // (row, rank) pairs of one work item (kernels/abi.py ROWS_TILE_M)
#define FMA_M 32      // pairs of one tile of the FMA build: it takes an item in slices of FMA_M
#define TILE_N 64     // outputs of one block
#define TILE_K 32     // columns staged in shared memory per step (four chunks of 8)

// A work item: the blob of its expert (an index into `blobs`), its first pair in the sorted order
// and how many pairs it takes (<= TILE_M; 0: an unused item of a launch sized before the count
// was known, which leaves at once).
struct RowsItem {
    int blob, start, count, pad;
};

// FMA build: thread t of 256 owns pairs 2 * (t / 16) + {0, 1} of the slice and outputs
// 4 * (t % 16) + {0, 1, 2, 3} of the tile: 8 sums, each a sequential fmaf over the columns.
#define OWN_M(t) (2 * ((t) >> 4))
#define OWN_N(t) (4 * ((t) & 15))

// Four consecutive columns k0 + c .. of input row m of a tile (zeros past `count`).
__device__ __forceinline__ float4 tile_row_values(const float* __restrict__ x, int x_cols,
                                                  const int* __restrict__ rows, int count, int k0,
                                                  int m, int c) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m < count)
        v = __ldg(reinterpret_cast<const float4*>(x + (i64)rows[m] * x_cols + k0 + c));
    return v;
}

// Chunk q of weight row n0 + n (8 columns from k0 + 8q), decoded; rows past `nrows` read the last
// row and are never written out. Thread t stages chunk t % 4 of row t / 4 in both builds.
template <int T>
__device__ __forceinline__ void tile_weight_chunk(const u8* __restrict__ base, i64 row_bytes,
                                                  int n0, int nrows, int k0, int n, int q,
                                                  float (&w)[8]) {
    chunk8<T>(base + (i64)min(n0 + n, nrows - 1) * row_bytes, (k0 >> 3) + q, w);
}

// The FMA build's staging: input rows into xs[k][m], weights into ws[k][n].
__device__ __forceinline__ void stage_rows(float (*xs)[FMA_M], const float* __restrict__ x,
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

// acc[mat][i][r] += slice rows (x rows `rows`, `count` <= FMA_M of them, K columns) times rows
// out0.. of each of the NMAT weight matrices (bases[mat], row_bytes[mat] a row; rows past `nrows`
// repeat the last). NMAT = 2: gate and up share the staged input rows.
template <int T, int NMAT>
__device__ __forceinline__ void tile_products_fma(float (&acc)[NMAT][2][4],
                                                  const float* __restrict__ x, int K,
                                                  const int* __restrict__ rows, int count,
                                                  const u8* const (&bases)[NMAT],
                                                  const i64 (&row_bytes)[NMAT], int out0,
                                                  int nrows) {
    __shared__ __align__(16) float xs[TILE_K][FMA_M];
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

// ---- the tensor-core build ---------------------------------------------------------------------
// mma.sync m16n8k16 (f16 inputs, f32 accumulation). The input rows are rounded to f16 once per
// layer by `rows_to_half`: each row multiplied by a power of two that puts its largest value near
// 2^14 (exact; activations of any size stay inside f16's range: SwiGLU outputs overflow 65504 on
// real weights), the product divided by it in f32 at the end. The decoded weights are rounded to
// f16 in shared memory (as cuBLAS's f16 products round them). Every output accumulates over the
// columns in one order, whatever other pairs share its item, so a pair's bits do not depend on its
// neighbours.
// A block takes TILE_M pairs: 8 warps, warp w the 32 pairs 32 (w % 4) and the 32 outputs
// 32 (w / 4) of the TILE_M x TILE_N tile, TILE_K columns a step.
//
// What keeps the tensor cores fed when an item holds few pairs (a 512-token prompt gives an
// expert ~32) is how many weight bytes are in flight, not arithmetic: a block that fetched only
// the next step's 32 columns waited a memory latency every step (docs/BENCHMARKS.md, issue 15).
// So the stored blocks of the weight tile's rows are copied, a stage of stage_cols(T) columns at
// a time (eight steps of a K-quant), by the copy engine (cp.async.bulk, completion counted on an
// mbarrier) into shared memory two stages deep: stage r + 1 is in flight while the steps of stage
// r run. Each step decodes the next step's weights from that copy into f16 (the same decoder as
// the global reads, so the same values) and multiplies the current one; the input rows arrive by
// cp.async two steps ahead. Shared memory is dynamic: rows_mma_shared_bytes (kernels/abi.py
// rows_mma_shared_bytes mirrors it).
#define MMA_PAD 8                   // halves of padding per shared row: conflict-free ldmatrix
#define MMA_LD (TILE_K + MMA_PAD)   // 40 halves = 80 bytes per row
#define X_BUFS 3                    // input-row steps in shared memory (two in flight)

// columns of one copied stage: about 128-288 bytes of a row for most types (Q2_K's 84 and
// Q3_K's 110: one super-block, as for the other K-quants; kernels/abi.py rows_stage_cols)
HOST_DEVICE constexpr int stage_cols(int T) {
    return T == T_F32 ? 32 : T == T_F16 || T == T_BF16 ? 64 : T == T_Q8_0 ? 128 : 256;
}
// the stored bytes of `cols` columns (cols a whole number of the type's blocks; weights.cuh's
// type table)
HOST_DEVICE constexpr i64 stored_bytes(int T, i64 cols) {
    return cols / block_cols(T) * block_bytes(T);
}
// shared bytes a row's stage copy takes: its stored bytes from the 16-byte boundary below it to
// the one above (the bulk copy moves whole 16-byte pieces, and the copy keeps the address mod 16
// the decoders' aligned loads rely on)
HOST_DEVICE constexpr int stage_row_bytes(int T) {
    return (int)((stored_bytes(T, stage_cols(T)) + 15 + 15) / 16 * 16);
}
HOST_DEVICE constexpr int rows_mma_shared_bytes(int T, int nmat) {
    return X_BUFS * TILE_M * MMA_LD * 2 + 2 * nmat * TILE_N * MMA_LD * 2
         + 2 * nmat * TILE_N * stage_row_bytes(T) + 2 * 8;
}

// xh[r] = x[r] * 2^(14 - e) as f16 and unscale[r] = 2^(e - 14), e the exponent of the row's
// largest |value| (0 for a row of zeros; NaN stays NaN). Grid: rows, 256 threads; K % 4 == 0.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) rows_to_half(
        const float* __restrict__ x, int K, __half* __restrict__ xh, float* __restrict__ unscale) {
    __shared__ float warp_top[BLOCK_THREADS / 32];
    const float* row = x + (i64)blockIdx.x * K;
    float top = 0.f;
    for (int c = 4 * threadIdx.x; c < K; c += 4 * BLOCK_THREADS) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(row + c));
        top = fmaxf(top, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    #pragma unroll
    for (int lane = 16; lane > 0; lane >>= 1)
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, lane));
    if ((threadIdx.x & 31) == 0) warp_top[threadIdx.x >> 5] = top;
    __syncthreads();
    top = 0.f;
    #pragma unroll
    for (int w = 0; w < BLOCK_THREADS / 32; ++w) top = fmaxf(top, warp_top[w]);
    int e = 0;
    frexpf(top, &e);                     // top < 2^e
    const float up = ldexpf(1.f, 14 - e);
    if (threadIdx.x == 0) unscale[blockIdx.x] = ldexpf(1.f, e - 14);
    __half* out = xh + (i64)blockIdx.x * K;
    for (int c = 4 * threadIdx.x; c < K; c += 4 * BLOCK_THREADS) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(row + c));
        uint2 packed;
        packed.x = pack_half2(v.x * up, v.y * up);
        packed.y = pack_half2(v.z * up, v.w * up);
        *reinterpret_cast<uint2*>(out + c) = packed;
    }
}

// The block's shared memory of the tensor-core build, carved from the dynamic allocation.
template <int T, int NMAT>
struct MmaShared {
    static_assert(NMAT == 1 || NMAT == 2, "gate and up, or down");
    __half (*xs)[TILE_M][MMA_LD];               // [X_BUFS]: input rows of a step
    __half (*ws)[NMAT][TILE_N][MMA_LD];         // [2]: decoded weights of a step
    u8* stage;                                  // [2][NMAT][TILE_N][stage_row_bytes]: stored blocks
    u64* bars;                                  // [2]: one barrier per stage buffer

    __device__ __forceinline__ explicit MmaShared(u8* base) {
        xs = reinterpret_cast<__half (*)[TILE_M][MMA_LD]>(base);
        base += X_BUFS * TILE_M * MMA_LD * 2;
        ws = reinterpret_cast<__half (*)[NMAT][TILE_N][MMA_LD]>(base);
        base += 2 * NMAT * TILE_N * MMA_LD * 2;
        stage = base;
        base += 2 * NMAT * TILE_N * stage_row_bytes(T);
        bars = reinterpret_cast<u64*>(base);
    }
    __device__ __forceinline__ u8* stage_row(int buf, int mat, int n) const {
        return stage + ((buf * NMAT + mat) * TILE_N + n) * stage_row_bytes(T);
    }
};

// Where row out0 + n of matrix mat starts (rows past `nrows` read the last). A select, not
// bases[mat]: an array indexed at run time would live on the stack.
template <int NMAT>
__device__ __forceinline__ const u8* weight_row(const u8* const (&bases)[NMAT],
                                                const i64 (&row_bytes)[NMAT], int mat, int n,
                                                int out0, int nrows) {
    const u8* base = mat == 0 ? bases[0] : bases[NMAT - 1];
    const i64 row_step = mat == 0 ? row_bytes[0] : row_bytes[NMAT - 1];
    return base + (i64)min(out0 + n, nrows - 1) * row_step;
}

// Stage r (columns r * stage_cols(T) ..) of the tile's weight rows into buffer r % 2: thread
// mat * TILE_N + n copies row n of matrix mat. Returns nothing to wait on: the stage's barrier
// completes when every row has landed.
template <int T, int NMAT>
__device__ __forceinline__ void stage_issue(const MmaShared<T, NMAT>& sh, int r, int K,
                                            const u8* const (&bases)[NMAT],
                                            const i64 (&row_bytes)[NMAT], int out0, int nrows) {
    const int t = threadIdx.x;
    if (t >= NMAT * TILE_N) return;
    const int mat = t / TILE_N, n = t % TILE_N;
    const int k0 = r * stage_cols(T), cols = min(stage_cols(T), K - k0);
    const u8* from = weight_row<NMAT>(bases, row_bytes, mat, n, out0, nrows) + stored_bytes(T, k0);
    const u8* lo = reinterpret_cast<const u8*>(reinterpret_cast<u64>(from) & ~15ull);
    const u64 hi = (reinterpret_cast<u64>(from) + stored_bytes(T, cols) + 15) & ~15ull;
    bulk_copy_counted(sh.stage_row(r & 1, mat, n), lo,
                      static_cast<unsigned>(hi - reinterpret_cast<u64>(lo)), &sh.bars[r & 1]);
}

// The weights of the step at column k1 (in stage r1, already landed), decoded from the stage copy
// and stored as f16. One matrix (down): thread t decodes chunk t % 4 of row t / 4. Two (gate and
// up): chunks 2 (t % 2) and 2 (t % 2) + 1 of row (t / 2) % TILE_N of matrix t / (2 TILE_N), so a
// thread's two chunks share one Q4_K scale and min (chunk16_half) instead of each unpacking its
// own. row_mod: this thread's row's address mod 16 (the stage copy keeps it).
template <int NMAT>
__device__ __forceinline__ void step_decoder(int& mat, int& n, int& q) {
    const int t = threadIdx.x;
    if constexpr (NMAT == 1) { mat = 0; n = t >> 2; q = t & 3; }
    else { mat = t / (2 * TILE_N); n = (t >> 1) % TILE_N; q = 2 * (t & 1); }
}

template <int T, int NMAT>
__device__ __forceinline__ void step_weights(const MmaShared<T, NMAT>& sh, int r1, int k1,
                                             int row_mod, __half (*ws)[TILE_N][MMA_LD]) {
    int mat, n, q;
    step_decoder<NMAT>(mat, n, q);
    const int k0 = r1 * stage_cols(T);
    const int at = (row_mod + (int)stored_bytes(T, k0)) & 15;
    const u8* from = sh.stage_row(r1 & 1, mat, n) + at;
    const int c = ((k1 - k0) >> 3) + q;
    if constexpr (NMAT == 1) {
        uint4 packed;
        chunk8_half<T>(from, c, packed);
        *reinterpret_cast<uint4*>(&ws[0][n][8 * q]) = packed;
    } else {
        uint4 lo, hi;
        chunk16_half<T>(from, c, lo, hi);
        *reinterpret_cast<uint4*>(&ws[mat][n][8 * q]) = lo;
        *reinterpret_cast<uint4*>(&ws[mat][n][8 * q + 8]) = hi;
    }
}

// Step s's input rows into xs[s % X_BUFS] (two 16-byte pieces a thread, zeros past the
// item's pairs), as one cp.async group: empty past the last step, so the counting stays uniform.
template <int T, int NMAT>
__device__ __forceinline__ void rows_issue(const MmaShared<T, NMAT>& sh, int s, int K,
                                           const __half* const (&src)[2], const bool (&valid)[2],
                                           const int (&dst_row)[2], const int (&dst_col)[2]) {
    if (s * TILE_K < K) {
        #pragma unroll
        for (int j = 0; j < 2; ++j)
            cp_async16(&sh.xs[s % X_BUFS][dst_row[j]][dst_col[j]], src[j] + s * TILE_K, valid[j]);
    }
    cp_async_commit();
}

// acc[mat][mi][i][r] = the item's f16 rows (xh rows `rows`, `count` <= TILE_M of them, K columns)
// times rows out0.. of each of the NMAT weight matrices (bases[mat], row_bytes[mat] a row; rows
// past `nrows` repeat the last), before the rows' unscale. Needs rows_mma_shared_bytes(T, NMAT)
// of dynamic shared memory.
template <int T, int NMAT>
__device__ __forceinline__ void tile_products_mma(float (&acc)[NMAT][2][4][4],
                                                  const __half* __restrict__ xh, int K,
                                                  const int* __restrict__ rows, int count,
                                                  const u8* const (&bases)[NMAT],
                                                  const i64 (&row_bytes)[NMAT], int out0,
                                                  int nrows) {
    extern __shared__ __align__(16) u8 dynamic_shared[];
    const MmaShared<T, NMAT> sh(dynamic_shared);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m0 = 32 * (warp & 3), n0 = 32 * (warp >> 2);
    const int lm = lane >> 3, lr = lane & 7;    // ldmatrix: matrix lane / 8, its row lane % 8
    // whether this warp's 32 rows hold a pair (warp-uniform): an item of 32 pairs keeps two warps
    // of eight on the tensor cores, the rest only decode weights. A warp's sums do not depend on
    // another's, so skipping one leaves the bits as they were.
    const bool live = m0 < count;
    // this thread's two 16-byte pieces of each step's rows: piece p = t + 256 j is the 8 columns
    // 8 (p % 4) .. of tile row p / 4
    const __half* src[2];
    bool valid[2];
    int dst_row[2], dst_col[2];
    #pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int piece = threadIdx.x + BLOCK_THREADS * j, m = piece >> 2;
        valid[j] = m < count;
        dst_row[j] = m;
        dst_col[j] = 8 * (piece & 3);
        src[j] = xh + (valid[j] ? (i64)rows[m] * K : 0) + dst_col[j];
    }
    int row_mod;           // the decoding thread's weight row's address mod 16
    {
        int mat, n, q;
        step_decoder<NMAT>(mat, n, q);
        row_mod = (int)(reinterpret_cast<u64>(weight_row<NMAT>(bases, row_bytes, mat, n, out0,
                                                               nrows)) & 15);
    }
    if (threadIdx.x == 0) {
        mbar_init(&sh.bars[0], NMAT * TILE_N);
        mbar_init(&sh.bars[1], NMAT * TILE_N);
        mbar_init_fence();
    }
    __syncthreads();
    constexpr int STEPS_PER_STAGE = stage_cols(T) / TILE_K;
    const int steps = K / TILE_K, n_stages = (K + stage_cols(T) - 1) / stage_cols(T);
    stage_issue<T, NMAT>(sh, 0, K, bases, row_bytes, out0, nrows);
    rows_issue<T, NMAT>(sh, 0, K, src, valid, dst_row, dst_col);
    rows_issue<T, NMAT>(sh, 1, K, src, valid, dst_row, dst_col);
    mbar_wait(&sh.bars[0], 0);
    step_weights<T, NMAT>(sh, 0, 0, row_mod, sh.ws[0]);
    cp_async_wait_newest_pending();
    __syncthreads();
    for (int s = 0; s < steps; ++s) {
        const int r = s / STEPS_PER_STAGE;
        // the next stage's copy starts with this stage's first step: its buffer's last reader
        // (the decode of stage r - 1's last step) finished before the previous barrier
        if (s % STEPS_PER_STAGE == 0 && r + 1 < n_stages)
            stage_issue<T, NMAT>(sh, r + 1, K, bases, row_bytes, out0, nrows);
        rows_issue<T, NMAT>(sh, s + 2, K, src, valid, dst_row, dst_col);
        const __half (*xs)[MMA_LD] = sh.xs[s % X_BUFS];
        const __half (*ws)[TILE_N][MMA_LD] = sh.ws[s & 1];
        #pragma unroll
        for (int kk = 0; kk < TILE_K && live; kk += 16) {
            u32 a[2][4];
            #pragma unroll
            for (int mi = 0; mi < 2; ++mi)
                ldmatrix_x4(a[mi], &xs[m0 + 16 * mi + lr + 8 * (lm & 1)][kk + 8 * (lm >> 1)]);
            #pragma unroll
            for (int mat = 0; mat < NMAT; ++mat) {
                #pragma unroll
                for (int p = 0; p < 2; ++p) {        // n8 tiles 2p and 2p + 1
                    u32 b[4];
                    ldmatrix_x4(b, &ws[mat][n0 + 16 * p + lr + 8 * (lm >> 1)][kk + 8 * (lm & 1)]);
                    #pragma unroll
                    for (int mi = 0; mi < 2; ++mi) {
                        mma_16816(acc[mat][mi][2 * p], a[mi], b[0], b[1]);
                        mma_16816(acc[mat][mi][2 * p + 1], a[mi], b[2], b[3]);
                    }
                }
            }
        }
        if (s + 1 < steps) {                                    // uniform
            const int r1 = (s + 1) / STEPS_PER_STAGE;
            if (r1 != r) mbar_wait(&sh.bars[r1 & 1], (r1 >> 1) & 1);
            step_weights<T, NMAT>(sh, r1, (s + 1) * TILE_K, row_mod, sh.ws[(s + 1) & 1]);
        }
        cp_async_wait_newest_pending();
        __syncthreads();
    }
}

// Where acc[mat][mi][i][r] of the tensor-core build lies in its tile: pair m, output n (the C
// fragment of n8 tile i of m16 tile mi of the warp's 32 x 32).
__device__ __forceinline__ void mma_coord(int mi, int i, int r, int& m, int& n) {
    const int t = threadIdx.x, warp = t >> 5, g = (t & 31) >> 2, q = t & 3;
    m = 32 * (warp & 3) + 16 * mi + g + 8 * (r >> 1);
    n = 32 * (warp >> 2) + 8 * i + 2 * q + (r & 1);
}

// The FMA build over an item's pairs [0, count), FMA_M at a time: `write(m, n, acc of the first
// matrix, acc of the last)` for every output inside the tile.
template <int T, int NMAT, class Write>
__device__ __forceinline__ void item_products_fma(const float* __restrict__ x, int K,
                                                  const int* __restrict__ rows, int count,
                                                  const u8* const (&bases)[NMAT],
                                                  const i64 (&row_bytes)[NMAT], int out0,
                                                  int nrows, Write write) {
    for (int s = 0; s < count; s += FMA_M) {               // uniform
        float acc[NMAT][2][4] = {};
        const int c = min(FMA_M, count - s);
        tile_products_fma<T, NMAT>(acc, x, K, rows + s, c, bases, row_bytes, out0, nrows);
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int m = OWN_M(threadIdx.x) + i, n = OWN_N(threadIdx.x) + r;
                if (m < c) write(s + m, out0 + n, acc[0][i][r], acc[NMAT - 1][i][r]);
            }
        }
    }
}

// The same for the tensor-core build, its f16 rows xh and their unscale by input row (`rows`).
template <int T, int NMAT, class Write>
__device__ __forceinline__ void item_products_mma(const __half* __restrict__ xh,
                                                  const float* __restrict__ unscale, int K,
                                                  const int* __restrict__ rows, int count,
                                                  const u8* const (&bases)[NMAT],
                                                  const i64 (&row_bytes)[NMAT], int out0,
                                                  int nrows, Write write) {
    float acc[NMAT][2][4][4] = {};
    tile_products_mma<T, NMAT>(acc, xh, K, rows, count, bases, row_bytes, out0, nrows);
    #pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
        #pragma unroll
        for (int r = 0; r < 4; r += 2) {                 // r and r + 1: the same pair
            int m, n;
            mma_coord(mi, 0, r, m, n);
            if (m >= count) continue;
            const float us = unscale[rows[m]];
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    mma_coord(mi, i, r + h, m, n);
                    write(m, out0 + n, acc[0][mi][i][r + h] * us, acc[NMAT - 1][mi][i][r + h] * us);
                }
            }
        }
    }
}

// ---- the two launches of a layer --------------------------------------------------------------
// act[p, f] = silu(gate_f . x_row(p)) * (up_f . x_row(p)) for the pairs p of each work item.
// Grid (items, ceil(n_ff / TILE_N)), 256 threads. rows[p]: the input row of sorted pair p. The
// tensor-core build reads x as rows_to_half left it (xh, unscale).
template <int T, bool MMA>
__device__ __forceinline__ void gate_up_rows(const u64* __restrict__ blobs,
                                             const RowsItem* __restrict__ items,
                                             const int* __restrict__ rows, const float* __restrict__ x,
                                             const __half* __restrict__ xh,
                                             const float* __restrict__ unscale, int n_embd,
                                             i64 up_at, i64 gate_row_bytes, i64 up_row_bytes,
                                             int n_ff, float* __restrict__ act) {
    const RowsItem it = items[blockIdx.x];
    // an unused item, or an expert whose blob this launch does not hold (address 0: a partial
    // cache's misses are computed by later launches, a batch at a time); the whole block: uniform
    if (it.count == 0 || blobs[it.blob] == 0) return;
    const u8* blob = reinterpret_cast<const u8*>(blobs[it.blob]);
    const u8* const bases[2] = {blob, blob + up_at};
    const i64 row_bytes[2] = {gate_row_bytes, up_row_bytes};
    float* own_act = act + (i64)it.start * n_ff;
    const auto write = [=](int m, int f, float g, float u) {
        if (f < n_ff) own_act[(i64)m * n_ff + f] = g / (1.f + expf(-g)) * u;
    };
    if constexpr (!MMA)
        item_products_fma<T, 2>(x, n_embd, rows + it.start, it.count, bases, row_bytes,
                                blockIdx.y * TILE_N, n_ff, write);
    else
        item_products_mma<T, 2>(xh, unscale, n_embd, rows + it.start, it.count, bases, row_bytes,
                                blockIdx.y * TILE_N, n_ff, write);
}

// y[dest[p], o] = down_o . act[p] for the pairs p of each work item (dest: row * k + rank of the
// unsorted output). Grid (items, ceil(n_embd / TILE_N)), 256 threads; the tensor-core build reads
// act as rows_to_half left it.
template <int T, bool MMA>
__device__ __forceinline__ void down_rows(const u64* __restrict__ blobs,
                                          const RowsItem* __restrict__ items,
                                          const int* __restrict__ dest, const float* __restrict__ act,
                                          const __half* __restrict__ act_h,
                                          const float* __restrict__ unscale, int n_ff, i64 down_at,
                                          i64 down_row_bytes, int n_embd, float* __restrict__ y) {
    __shared__ int own_rows[TILE_M];
    const RowsItem it = items[blockIdx.x];
    if (it.count == 0 || blobs[it.blob] == 0) return;   // as in gate_up_rows
    const u8* const bases[1] = {reinterpret_cast<const u8*>(blobs[it.blob]) + down_at};
    const i64 row_bytes[1] = {down_row_bytes};
    for (int m = threadIdx.x; m < TILE_M; m += BLOCK_THREADS)
        own_rows[m] = it.start + m;                     // sorted pairs
    __syncthreads();
    const int* own_dest = dest + it.start;
    const auto write = [=](int m, int o, float v, float) {
        if (o < n_embd) y[(i64)own_dest[m] * n_embd + o] = v;
    };
    if constexpr (!MMA)
        item_products_fma<T, 1>(act, n_ff, own_rows, it.count, bases, row_bytes,
                                blockIdx.y * TILE_N, n_embd, write);
    else
        item_products_mma<T, 1>(act_h, unscale, n_ff, own_rows, it.count, bases, row_bytes,
                                blockIdx.y * TILE_N, n_embd, write);
}

// The FMA build reads x (act) in float32; the tensor-core build, `_mma_`, the f16 rows and
// unscale rows_to_half made of them.
#define ROWS_KERNELS(name, T, ...)                                                                 \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_gate_up_rows_##name(           \
            const u64* __restrict__ blobs, const RowsItem* __restrict__ items,                     \
            const int* __restrict__ rows, const float* __restrict__ x, int n_embd, i64 up_at,      \
            i64 gate_row_bytes, i64 up_row_bytes, int n_ff, float* __restrict__ act) {             \
        gate_up_rows<T, false>(blobs, items, rows, x, nullptr, nullptr, n_embd, up_at,             \
                gate_row_bytes, up_row_bytes, n_ff, act);                                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_down_rows_##name(              \
            const u64* __restrict__ blobs, const RowsItem* __restrict__ items,                     \
            const int* __restrict__ dest, const float* __restrict__ act, int n_ff, i64 down_at,    \
            i64 down_row_bytes, int n_embd, float* __restrict__ y) {                               \
        down_rows<T, false>(blobs, items, dest, act, nullptr, nullptr, n_ff, down_at,              \
                down_row_bytes, n_embd, y);                                                        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_gate_up_rows_mma_##name(       \
            const u64* __restrict__ blobs, const RowsItem* __restrict__ items,                     \
            const int* __restrict__ rows, const __half* __restrict__ xh,                           \
            const float* __restrict__ unscale, int n_embd, i64 up_at, i64 gate_row_bytes,          \
            i64 up_row_bytes, int n_ff, float* __restrict__ act) {                                 \
        gate_up_rows<T, true>(blobs, items, rows, nullptr, xh, unscale, n_embd, up_at,             \
                gate_row_bytes, up_row_bytes, n_ff, act);                                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) moe_down_rows_mma_##name(          \
            const u64* __restrict__ blobs, const RowsItem* __restrict__ items,                     \
            const int* __restrict__ dest, const __half* __restrict__ act_h,                        \
            const float* __restrict__ unscale, int n_ff, i64 down_at, i64 down_row_bytes,          \
            int n_embd, float* __restrict__ y) {                                                   \
        down_rows<T, true>(blobs, items, dest, nullptr, act_h, unscale, n_ff, down_at,             \
                down_row_bytes, n_embd, y);                                                        \
    }
FOR_EACH_TYPE(ROWS_KERNELS)

// ---- a chunk routed and grouped on the device (STRATA_DEVICE_ROUTING, ops/moe.py) --
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
