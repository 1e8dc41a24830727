// The K-quant dense matvecs (Q4_K, Q5_K, Q6_K) in 16-byte pieces (KernelShape matvec_pieces): a
// warp takes PIECE_ROWS weight rows, a block PIECE_THREADS / 32 warps. A lane takes one piece of a
// super-block at a time, the 16 bytes of quants that hold two 16-column runs (Q4_K / Q5_K: 16
// columns of sub-block 2jj in the low nibbles and the same 16 of sub-block 2jj + 1 in the high
// ones; Q6_K: two runs 64 columns apart): 32 weights; it reads the piece's 32 activations of each
// row once for the warp's weight rows. No block reduction: each warp's xor tree gives its rows'
// sums (the one barrier is block (0, 0)'s, before it writes a fused norm's normed rows).
//
// Why: the plain matvec's thread takes a chunk of 8 columns (weights.cuh chunk8_q), 8 bytes
// loaded for the 4 it uses, and its block reduces over 256 threads with two barriers; at one row
// the Q4_K o projection read 10.5% of the card's DRAM throughput under Nsight Compute, and a
// one-row step's Q4_K matvecs streamed at about a seventh of it (docs/BENCHMARKS.md). Q6_K (the
// output matrix and attn_v of a Q4_K_M file) streamed at about 0.9 TB/s in the output matrix and
// far less in attn_v's 512 rows (the same section).
//
// Batch invariance: an output's sum is the lane's pieces in order (each piece's two 16-column
// dots, then its scale and min terms), then the warp's xor tree, for any number of activation
// rows; so a row's bits are the same alone and among others. They are not the plain matvec's
// (another order), so the build decides (matvec_pieces), never the row count.
#pragma once

// the default since 2026-12-07 (one-row decode 1.084x the plain matvecs' on a Q4_K_M file:
// docs/BENCHMARKS.md); 0: the plain matvecs (decode.cu matvec_rows)
#ifndef MATVEC_PIECES
#define MATVEC_PIECES 1
#endif
#ifndef PIECE_STAGE
#define PIECE_STAGE 0        // 1: a block stages each round's activations in shared memory (below)
#endif
#ifndef PIECE_AHEAD
#define PIECE_AHEAD 0        // 1: at one row a lane loads its next pieces before it sums these
#endif
#define PIECE_ROWS 4         // weight rows of a warp (kernels/abi.py PIECE_ROWS)
#define PIECE_THREADS 128    // threads of a block: 4 warps, 16 rows (kernels/abi.py PIECE_THREADS)

// Q4_K; Q5_K (the same layout with a fifth bit per weight: bit j of byte l of its 32 qh bytes for
// column l of sub-block j, so a piece's fifth bits are the 16 qh bytes 16 h .., one more load);
// Q6_K (k_piece's Q6_K branch says how its pieces lie)
HOST_DEVICE constexpr bool piece_type(int T) { return T == T_Q4_K || T == T_Q5_K || T == T_Q6_K; }
// a piece's high run: 32 columns after its low run (Q4_K, Q5_K), 64 (Q6_K)
HOST_DEVICE constexpr int piece_hi(int T) { return T == T_Q6_K ? 64 : 32; }
// whether a piece's weights carry a min term (dmin * m times the run's activation sum)
HOST_DEVICE constexpr bool piece_has_min(int T) { return T != T_Q6_K; }

// One piece of a super-block: its scale and min for each of its two 16-column runs (lo: the low
// nibbles, columns piece_col(p) + 0..15 of the block; hi: piece_hi(T) columns on; Q6_K has no
// min), its 16 bytes of nibbles and (Q5_K, Q6_K) its 16 bytes of high bits, of which bits hshift
// (lo) and hshift + 1 (Q5_K) or hshift + 4 (Q6_K: two bits each) are its own
template <int T>
struct KPiece {
    float scale_lo, min_lo, scale_hi, min_hi;
    u32 q[4];
    u32 h[T == T_Q4_K ? 1 : 4];
    int hshift;
};

// Piece p (0..7) of a Q6_K block (210 bytes: ql[128], qh[64], int8 scales[16], f16 d at 208;
// element e = 128 h + 32 t + l is the low (t < 2) or high nibble of ql[64 h + 32 (t & 1) + l] with
// bits 2t, 2t + 1 of qh[32 h + l] above it, weight d * scales[8 h + 2 t + l / 16] * (v - 32)):
// h = p / 4, c = p / 2 % 2, l from 16 (p % 2): the 16 ql bytes 64 h + 32 c + l .. hold the low
// run (t = c) in their low nibbles and the high run (t = c + 2, 64 columns on) in their high ones,
// and the 16 qh bytes 32 h + l .. their top bits (2c and 2c + 4). The block is 2-byte aligned
// only, so its runs are read as words (experts_int_k.cuh load_words_2aligned).
HOST_DEVICE KPiece<T_Q6_K> q6_k_piece(const u8* __restrict__ blk, int p) {
    const int h = p >> 2, c = (p >> 1) & 1, l = 16 * (p & 1);
    KPiece<T_Q6_K> w;
    load_words_2aligned(blk + 64 * h + 32 * c + l, w.q);
    load_words_2aligned(blk + 128 + 32 * h + l, w.h);
    const float d = h2f((u16)load_u16(blk + 208));
    const int at = 192 + 8 * h + 2 * c + (p & 1);
    w.scale_lo = d * s8_to_float(blk[at]);
    w.scale_hi = d * s8_to_float(blk[at + 4]);
    w.min_lo = w.min_hi = 0.f;
    w.hshift = 2 * c;
    return w;
}

// piece p (0..7: jj = p / 2, h = p % 2) of the Q4_K or Q5_K super-block at `blk`
template <int T>
HOST_DEVICE KPiece<T> q45_k_piece(const u8* __restrict__ blk, int p) {
    const int jj = p >> 1;
    const uint4 head = ldw<true>(reinterpret_cast<const uint4*>(blk));
    const uint4 q = ldw<true>(reinterpret_cast<const uint4*>(blk + (T == T_Q5_K ? 48 : 16) + 16 * p));
    int s0, m0, s1, m1;
    k_scale_min(head.y, head.z, head.w, 2 * jj, s0, m0);
    k_scale_min(head.y, head.z, head.w, 2 * jj + 1, s1, m1);
    const float d = h2f((u16)(head.x & 0xFFFF)), dmin = h2f((u16)(head.x >> 16));
    KPiece<T> w;
    w.scale_lo = d * small_int_to_float<0>(s0);
    w.min_lo = -(dmin * small_int_to_float<0>(m0));
    w.scale_hi = d * small_int_to_float<0>(s1);
    w.min_hi = -(dmin * small_int_to_float<0>(m1));
    w.q[0] = q.x; w.q[1] = q.y; w.q[2] = q.z; w.q[3] = q.w;
    w.hshift = 2 * jj;
    if constexpr (T == T_Q5_K) {
        const uint4 h = ldw<true>(reinterpret_cast<const uint4*>(blk + 16 + 16 * (p & 1)));
        w.h[0] = h.x; w.h[1] = h.y; w.h[2] = h.z; w.h[3] = h.w;
    }
    return w;
}

// piece p (0..7) of the super-block at `blk`
template <int T>
HOST_DEVICE KPiece<T> k_piece(const u8* __restrict__ blk, int p) {
    if constexpr (T == T_Q6_K) return q6_k_piece(blk, p);
    else return q45_k_piece<T>(blk, p);
}

// The first column of piece p's low run within its super-block (its high run: piece_hi(T) on)
template <int T>
HOST_DEVICE int piece_col(int p) {
    return T == T_Q6_K ? 128 * (p >> 2) + 32 * ((p >> 1) & 1) + 16 * (p & 1)
                       : 64 * (p >> 1) + 16 * (p & 1);
}

HOST_DEVICE float sum16(const float* v) {
    float s = v[0];
    #pragma unroll
    for (int k = 1; k < 16; ++k) s += v[k];
    return s;
}

// acc + run `half` of a piece (0: its low run, 1: its high one) . a: the run's scale times the dot
// of its 16 weights (stored integers, the centre taken off) with the run's 16 activations a, then
// (Q4_K, Q5_K) its min times their sum a_sum. Column 4 k + e of the run is byte e of word k (its
// low nibble for the low run, its high one for the high run), with Q5_K's fifth and Q6_K's two
// top bits.
template <int T>
HOST_DEVICE float piece_half_dot(const KPiece<T>& w, int half, const float* a, float a_sum,
                                 float acc) {
    float d = 0.f;
    #pragma unroll
    for (int k = 0; k < 4; ++k) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            u32 q = (w.q[k] >> (8 * e + 4 * half)) & 0xF;
            if constexpr (T == T_Q6_K) {
                const u32 bits = w.h[k] >> (8 * e + w.hshift);
                q |= half ? bits & 0x30 : (bits & 3) << 4;
            } else if constexpr (T == T_Q5_K) {
                const u32 bits = w.h[k] >> (8 * e + w.hshift);
                q |= half ? (bits & 2) << 3 : (bits & 1) << 4;
            }
            constexpr int centre = T == T_Q6_K ? 32 : 0;
            d = fmaf(small_int_to_float<centre>(q), a[4 * k + e], d);
        }
    }
    acc = fmaf(half ? w.scale_hi : w.scale_lo, d, acc);
    if constexpr (piece_has_min(T)) acc = fmaf(half ? w.min_hi : w.min_lo, a_sum, acc);
    return acc;
}

// acc + the piece . (lo, hi): lo / hi the 16 activations of its two runs, slo / shi their sums
// (one row's piece in the kernel's order: its low run, then its high one)
template <int T>
HOST_DEVICE float k_piece_dot(const KPiece<T>& w, const float* lo, const float* hi, float slo,
                              float shi, float acc) {
    return piece_half_dot<T>(w, 1, hi, shi, piece_half_dot<T>(w, 0, lo, slo, acc));
}

__device__ __forceinline__ void load16(const float* __restrict__ p, float* v) {
    load8(p, v);
    load8(p + 8, v + 8);
}

// PIECE_STAGE: a warp's 32 lanes take 32 pieces a round, 4 super-blocks, and the block's warps
// take the same columns in the same round; so the block copies those STAGE_COLS columns of its N
// activation rows (and of the norm weights) into shared memory once, with coalesced 16-byte
// loads, and the lanes read their runs there. Read in place, a lane's four 16-byte loads of a run
// sit 64 bytes from its neighbour's (a run each), so each load of the warp touches 16 lines: at
// 8 rows that is 64 such loads a piece. The values read are the same, so are the bits.
#define STAGE_COLS 1024

// Where column c (0 <= c < STAGE_COLS) of a round lies in shared memory: each 16-column run stays
// whole (a lane reads its four 16-byte chunks at one base plus 16 k bytes) and moves on by
// 4 ((run + 2) / 4) floats, run the run's index in its super-block, plus 16 floats a super-block.
// Then the 8 lanes of a quarter-warp, reading chunk k of 8 runs of one super-block at once, meet 8
// different 4-bank groups in every layout of pieces: runs 0, 1, 4, 5, 8, 9, 12, 13 (Q4_K and
// Q5_K's low runs; +2 their high ones) and 0, 1, 2, 3, 8, 9, 10, 11 (Q6_K's; +4); in place they
// would meet 4 or 2 (a run's group: 4 (run & 1) + its shift + k, mod 8).
#define STAGE_FLOATS (STAGE_COLS + STAGE_COLS / 16)   // a round's row in shared memory
HOST_DEVICE constexpr int stage_at(int c) {
    return c + 4 * ((((c >> 4) & 15) + 2) >> 2) + 16 * (c >> 8);
}

// the 16 activations of a run starting at column c of a staged round
__device__ __forceinline__ void load16_staged(const float* row, int c, float* v) {
    const float4* run = reinterpret_cast<const float4*>(row + stage_at(c));
    #pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 a = run[k];
        v[4 * k] = a.x; v[4 * k + 1] = a.y; v[4 * k + 2] = a.z; v[4 * k + 3] = a.w;
    }
}

// the columns [c0, c0 + cols) of the n rows of x (stride x_stride) into stage[i][..], and of
// norm_w (when given) into nw_stage, by the block's threads
template <int N>
__device__ __forceinline__ void stage_round(float (*stage)[STAGE_FLOATS], float* nw_stage,
                                            const float* __restrict__ x, int x_stride,
                                            const float* __restrict__ norm_w, int c0, int cols) {
    const int quads = cols >> 2;
    for (int j = threadIdx.x; j < N * quads; j += blockDim.x) {
        const int i = j / quads, c = (j - i * quads) << 2;
        *reinterpret_cast<float4*>(&stage[i][stage_at(c)]) =
            __ldg(reinterpret_cast<const float4*>(x + (i64)i * x_stride + c0 + c));
    }
    if (norm_w != nullptr) {
        for (int j = threadIdx.x; j < quads; j += blockDim.x)
            *reinterpret_cast<float4*>(&nw_stage[stage_at(j << 2)]) =
                __ldg(reinterpret_cast<const float4*>(norm_w + c0 + (j << 2)));
    }
}

// piece t (super-block t / 8, piece t % 8) of each of a warp's PIECE_ROWS weight rows
template <int T>
__device__ __forceinline__ void load_pieces(KPiece<T>* w, const u8* const* rows, int t) {
    #pragma unroll
    for (int r = 0; r < PIECE_ROWS; ++r) w[r] = k_piece<T>(rows[r] + (i64)(t >> 3) * block_bytes(T), t & 7);
}

// matvec_rows' contract (decode.cu) for a Q4_K, Q5_K or Q6_K matrix: y[i, o] = add[i, o] + W[o] . xn_i for the
// n <= N rows, xn = rms_norm(x) * norm_w when norm_w is given; block (0, 0) writes xn to `normed`.
// Warp w of block b takes rows (b * warps + w) * PIECE_ROWS ..; lane l the pieces l, l + 32, ...
// of the row, in column order. A fused norm's sum of squares is taken by every warp over the
// whole row in the same pass (the same order everywhere, so every warp's scale is the same).
template <int T, int N>
__device__ __forceinline__ void matvec_pieces_rows(const MatSpec* __restrict__ specs,
                                                   const float* __restrict__ x, int x_stride,
                                                   int n, const float* __restrict__ norm_w,
                                                   float eps, float* __restrict__ normed) {
    __shared__ float inv_shared[MAX_ROWS];
    const MatSpec s = specs[blockIdx.y];
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if ((int)blockIdx.x * warps * PIECE_ROWS >= s.nrows) return;     // the whole block: uniform
    const int o0 = (blockIdx.x * warps + warp) * PIECE_ROWS;
    const int pieces = o0 < s.nrows ? (s.ncols >> 8) * 8 : 0;      // a warp past the rows: none
    const u8* rows[PIECE_ROWS];
    #pragma unroll
    for (int r = 0; r < PIECE_ROWS; ++r)
        rows[r] = s.w + (i64)min(o0 + r, s.nrows - 1) * s.row_bytes;
    float acc[PIECE_ROWS][N], ss[N];
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        ss[i] = 0.f;
        #pragma unroll
        for (int r = 0; r < PIECE_ROWS; ++r) acc[r][i] = 0.f;
    }
#if PIECE_STAGE
    // every warp takes every round (a warp past the rows too: the block's barriers)
    __shared__ __align__(16) float x_stage[N][STAGE_FLOATS];
    __shared__ __align__(16) float nw_stage[STAGE_FLOATS];
    const bool mine = o0 < s.nrows;
    for (int c0 = 0; c0 < s.ncols; c0 += STAGE_COLS) {
        const int t = (c0 >> 5) + lane;        // 32 pieces (of 32 columns) a round
        const bool take = mine && t < pieces;
        const int sb = t >> 3, p = t & 7, col = 256 * sb + piece_col<T>(p) - c0;
        KPiece<T> w[PIECE_ROWS];
        if (take) {                            // in flight while the round is staged
            #pragma unroll
            for (int r = 0; r < PIECE_ROWS; ++r)
                w[r] = k_piece<T>(rows[r] + (i64)sb * block_bytes(T), p);
        }
        __syncthreads();                       // the last round's reads are done
        stage_round<N>(x_stage, nw_stage, x, x_stride, norm_w, c0, min(STAGE_COLS, s.ncols - c0));
        __syncthreads();
        if (take) {
            #pragma unroll
            for (int i = 0; i < N; ++i) {
                #pragma unroll
                for (int half = 0; half < 2; ++half) {     // k_piece_dot's order, a run at a time
                    const int c = col + half * piece_hi(T);
                    float a[16];
                    load16_staged(x_stage[i], c, a);
                    if (norm_w != nullptr) {
                        #pragma unroll
                        for (int k = 0; k < 16; ++k) ss[i] = fmaf(a[k], a[k], ss[i]);
                        float nw[16];
                        load16_staged(nw_stage, c, nw);
                        #pragma unroll
                        for (int k = 0; k < 16; ++k) a[k] *= nw[k];
                    }
                    const float a_sum = piece_has_min(T) ? sum16(a) : 0.f;
                    #pragma unroll
                    for (int r = 0; r < PIECE_ROWS; ++r)
                        acc[r][i] = piece_half_dot<T>(w[r], half, a, a_sum, acc[r][i]);
                }
            }
        }
    }
#else
    // PIECE_AHEAD (one row): a lane's next pieces are in flight while it sums these, so two of its
    // iterations' loads wait on memory at once, not one; the same sums in the same order. (Built
    // without it, the loop's loads wait for memory at every iteration: a lane of the o
    // projection has 4, of q + k 2, and a block of 16 rows leaves an SM one or two blocks.)
    constexpr bool ahead = PIECE_AHEAD && N == 1;   // at 2 rows: 255 registers and a spill
    KPiece<T> w[PIECE_ROWS];
    if (ahead && lane < pieces) load_pieces<T>(w, rows, lane);
    for (int t = lane; t < pieces; t += 32) {
        const int sb = t >> 3, p = t & 7, col = 256 * sb + piece_col<T>(p);
        KPiece<T> next[PIECE_ROWS];
        if constexpr (!ahead) load_pieces<T>(w, rows, t);
        else if (t + 32 < pieces) load_pieces<T>(next, rows, t + 32);
        #pragma unroll
        for (int i = 0; i < N; ++i) {
            float lo[16], hi[16];
            load16(x + (i64)i * x_stride + col, lo);
            load16(x + (i64)i * x_stride + col + piece_hi(T), hi);
            if (norm_w != nullptr) {
                #pragma unroll
                for (int k = 0; k < 16; ++k) ss[i] = fmaf(lo[k], lo[k], ss[i]);
                #pragma unroll
                for (int k = 0; k < 16; ++k) ss[i] = fmaf(hi[k], hi[k], ss[i]);
                // the norm weights read again for each row (from L1) rather than held: 32
                // registers fewer, which an 8-row build needs to stay out of local memory
                float nw[16];
                load16(norm_w + col, nw);
                #pragma unroll
                for (int k = 0; k < 16; ++k) lo[k] *= nw[k];
                load16(norm_w + col + piece_hi(T), nw);
                #pragma unroll
                for (int k = 0; k < 16; ++k) hi[k] *= nw[k];
            }
            const float slo = piece_has_min(T) ? sum16(lo) : 0.f;
            const float shi = piece_has_min(T) ? sum16(hi) : 0.f;
            #pragma unroll
            for (int r = 0; r < PIECE_ROWS; ++r)
                acc[r][i] = k_piece_dot<T>(w[r], lo, hi, slo, shi, acc[r][i]);
        }
        if constexpr (ahead) {
            if (t + 32 < pieces) {
                #pragma unroll
                for (int r = 0; r < PIECE_ROWS; ++r) w[r] = next[r];
            }
        }
    }
#endif
    float inv[N];
    #pragma unroll
    for (int i = 0; i < N; ++i)
        inv[i] = norm_w != nullptr ? rsqrtf(warp_sum(ss[i]) / (float)s.ncols + eps) : 1.f;
    #pragma unroll
    for (int r = 0; r < PIECE_ROWS; ++r) {
        #pragma unroll
        for (int i = 0; i < N; ++i) {
            const float v = warp_sum(acc[r][i]);
            if (lane == 0 && i < n && o0 + r < s.nrows)
                store_output(s, i, o0 + r, norm_w != nullptr ? v * inv[i] : v);
        }
    }
    if (normed != nullptr && norm_w != nullptr && blockIdx.x == 0 && blockIdx.y == 0) {
        if (threadIdx.x == 0) {                    // warp 0 of block 0 always holds rows
            #pragma unroll
            for (int i = 0; i < N; ++i) inv_shared[i] = inv[i];
        }
        __syncthreads();                           // block (0, 0) alone: uniform there
        write_normed(normed, x, x_stride, n, s.ncols, inv_shared, norm_w);
    }
}
