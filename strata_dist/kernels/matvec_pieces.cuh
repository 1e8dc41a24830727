// The dense matvecs of the K quants (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K) and Q8_0 in pieces (KernelShape
// matvec_pieces): a warp takes PIECE_ROWS weight rows, a block PIECE_THREADS / 32 warps. A lane
// takes one piece of a row at a time, the 16 bytes of quants that hold two 16-column runs (Q4_K /
// Q5_K: 16 columns of sub-block 2jj in the low nibbles and the same 16 of sub-block 2jj + 1 in the
// high ones; Q6_K: two runs 64 columns apart; Q3_K / Q2_K: two of the four 2-bit fields of 16
// bytes, runs 64 columns apart, the other two another lane's piece; Q8_0: one whole 32-column
// block, 32 bytes, its halves the two runs): 32 weights; it reads the piece's 32 activations of
// each row once for the warp's weight rows. Two warps share a group of rows, each taking every
// other round of 32 pieces (PIECE_SPLIT); each warp's xor tree gives its share of the rows' sums,
// and the first adds the second's, through shared memory.
//
// Why: the plain matvec's thread takes a chunk of 8 columns (weights.cuh chunk8_q), 8 bytes
// loaded for the 4 it uses, and its block reduces over 256 threads with two barriers; at one row
// the Q4_K o projection read 10.5% of the card's DRAM throughput under Nsight Compute, and a
// one-row step's Q4_K matvecs streamed at about a seventh of it (docs/BENCHMARKS.md). Q6_K (the
// output matrix and attn_v of a Q4_K_M file) streamed at about 0.9 TB/s in the output matrix and
// far less in attn_v's 512 rows (the same section).
//
// Batch invariance: an output's sum is each lane's pieces in order (each piece's two 16-column
// dots, then its scale and min terms), then each warp's xor tree, then the two warps' sums in
// warp order, for any number of activation rows; so a row's bits are the same alone and among
// others. They are not the plain matvec's (another order), so the build decides (matvec_pieces),
// never the row count.
#pragma once

// the default since 2026-12-07 (one-row decode 1.084x the plain matvecs' on a Q4_K_M file:
// docs/BENCHMARKS.md); 0: the plain matvecs (decode.cu matvec_rows)
#ifndef MATVEC_PIECES
#define MATVEC_PIECES 1
#endif
#define PIECE_ROWS 4         // weight rows of a warp pair (kernels/abi.py PIECE_ROWS)
#define PIECE_THREADS 128    // threads of a block: 4 warps, 8 rows (kernels/abi.py PIECE_THREADS)
// Warps that share a warp's rows, each taking every PIECE_SPLIT-th round of 32 pieces (kernels/
// abi.py PIECE_SPLIT). Why: at one row the o projection (2,048 rows of 4,096 columns) was 128
// blocks of 4 warps, one block an SM, and Nsight Compute read its warps issuing every ~4 cycles at
// 6% occupancy: each warp's serial instruction stream (4 pieces a lane), not memory. Two warps a
// row group measured 1.077x one-row decode (353.0 against 327.8 tok/s) and 16 streams served
// 1.125x (457.9 against 407.1 tok/s) on a Q4_K_M-recipe file; four, 1.057x and 1.024x
// (docs/BENCHMARKS.md names the records; KernelShape.REMOVED piece_split).
#define PIECE_SPLIT 2

// Q4_K; Q5_K (the same layout with a fifth bit per weight: bit j of byte l of its 32 qh bytes for
// column l of sub-block j, so a piece's fifth bits are the 16 qh bytes 16 h .., one more load);
// Q6_K, Q3_K and Q2_K (their k_piece branches say how their pieces lie); Q8_0 (q8_0_piece). Why
// Q3_K, Q2_K and Q8_0: the q3_k_m, q2_k and q8_0 files keep their attention matrices in them,
// which the plain matvec decodes 8 columns a thread (weights.cuh chunk8_q).
HOST_DEVICE constexpr bool piece_type(int T) {
    return T == T_Q4_K || T == T_Q5_K || T == T_Q6_K || T == T_Q3_K || T == T_Q2_K ||
           T == T_Q8_0;
}
// whether the type's 128-column halves hold 2-bit fields four to a byte (Q3_K, Q2_K)
HOST_DEVICE constexpr bool piece_2bit(int T) { return T == T_Q3_K || T == T_Q2_K; }
// a piece's high run: 32 columns after its low run (Q4_K, Q5_K), 64 (Q6_K, Q3_K, Q2_K), 16 (Q8_0)
HOST_DEVICE constexpr int piece_hi(int T) {
    return T == T_Q8_0 ? 16 : T == T_Q4_K || T == T_Q5_K ? 32 : 64;
}
// whether a piece's weights carry a min term (dmin * m times the run's activation sum)
HOST_DEVICE constexpr bool piece_has_min(int T) { return T == T_Q4_K || T == T_Q5_K || T == T_Q2_K; }
// the stored value that weighs zero: v - centre is the integer a run's scale multiplies
HOST_DEVICE constexpr int piece_centre(int T) { return T == T_Q6_K ? 32 : T == T_Q3_K ? 4 : 0; }

// One piece: its scale and min for each of its two 16-column runs (lo: the low nibbles, columns
// piece_first_col(t) + 0..15 of the row; hi: piece_hi(T) columns on; Q6_K, Q3_K and Q8_0 have no
// min), its 16 bytes of quants (Q8_0: 32) and (Q5_K, Q6_K, Q3_K) its 16 bytes of high bits, of
// which bits hshift (lo) and hshift + 1 (Q5_K) or hshift + 4 (Q6_K: two bits each) are its own
// (Q3_K: bits 0 and 2 of each byte, k2_piece shifts them there)
template <int T>
struct KPiece {
    float scale_lo, min_lo, scale_hi, min_hi;
    u32 q[T == T_Q8_0 ? 8 : 4];
    u32 h[T == T_Q4_K || T == T_Q2_K || T == T_Q8_0 ? 1 : 4];
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

// Piece p (0..7) of a Q3_K block (110 bytes, 2-byte aligned: hmask[32], qs[64], 12 bytes of
// 6-bit scales, f16 d at 108; element e = 128 n + 32 t + l is bits 2t of qs[32 n + l] with bit
// 4n + t of hmask[l] above them, weight d * (scale(8 n + 2 t + l / 16) - 32) * (v - 4)) or of a
// Q2_K block (84 bytes, 4-byte aligned: scales[16], qs[64] at 16, f16 d at 80, dmin at 82; bits
// 2t of qs[32 n + l], weight d * (sc & 15) * v - dmin * (sc >> 4), sc = scales[8 n + 2 t + l / 16]),
// laid out as Q6_K's: n = p / 4, c = p / 2 % 2, l from 16 (p % 2); the low run is field t = c of
// the 16 qs bytes 32 n + l .., the high run field t = c + 2 (64 columns on). The words are
// shifted here so each byte's bits 0-1 hold the low run and bits 4-5 the high one (Q3_K's hmask:
// bits 0 and 2); a shift of at most 5 moves no used bit across a byte.
template <int T>
HOST_DEVICE KPiece<T> k2_piece(const u8* __restrict__ blk, int p) {
    const int n = p >> 2, c = (p >> 1) & 1, l = 16 * (p & 1), sub = 8 * n + 2 * c + (p & 1);
    KPiece<T> w;
    if constexpr (T == T_Q3_K) {
        load_words_2aligned(blk + 32 + 32 * n + l, w.q);
        load_words_2aligned(blk + l, w.h);
        #pragma unroll
        for (int k = 0; k < 4; ++k) w.h[k] >>= 4 * n + c;
        const float d = h2f((u16)load_u16(blk + 108));
        w.scale_lo = d * (float)q3_k_scale(blk, sub);
        w.scale_hi = d * (float)q3_k_scale(blk, sub + 4);
        w.min_lo = w.min_hi = 0.f;
    } else {
        #pragma unroll
        for (int k = 0; k < 4; ++k) w.q[k] = qb_u32<true>(blk + 16 + 32 * n + l + 4 * k);
        const u32 dd = qb_u32<true>(blk + 80);
        const float d = h2f((u16)(dd & 0xFFFF)), dmin = h2f((u16)(dd >> 16));
        const u32 lo = blk[sub], hi = blk[sub + 4];
        w.scale_lo = d * small_int_to_float<0>(lo & 15);
        w.min_lo = -(dmin * small_int_to_float<0>(lo >> 4));
        w.scale_hi = d * small_int_to_float<0>(hi & 15);
        w.min_hi = -(dmin * small_int_to_float<0>(hi >> 4));
    }
    #pragma unroll
    for (int k = 0; k < 4; ++k) w.q[k] >>= 2 * c;
    w.hshift = 0;
    return w;
}

// The Q8_0 block at `blk` (34 bytes, 2-byte aligned: f16 d, then 32 int8 weights d * q) as one
// piece: its first 16 weights the low run, the next 16 the high one, both at scale d. Its quants
// are the 8 aligned words from blk + 2 rounded down, joined with the block's last two bytes where
// that is 2 bytes back: no byte past the block is read (load_words_2aligned reads the word past a
// run, and the last block of a matrix is the last of its data).
HOST_DEVICE KPiece<T_Q8_0> q8_0_piece(const u8* __restrict__ blk) {
    KPiece<T_Q8_0> w;
    const u32* a = reinterpret_cast<const u32*>((u64)(blk + 2) & ~(u64)3);
    const int shift = (int)((u64)(blk + 2) & 3) * 8;               // 0 or 16
    u32 word[9];
    #pragma unroll
    for (int i = 0; i < 8; ++i) word[i] = a[i];
    word[8] = load_u16(blk + (shift != 0 ? 32 : 30));               // unused where shift is 0
    #pragma unroll
    for (int i = 0; i < 8; ++i) w.q[i] = funnel_r(word[i], word[i + 1], shift);
    w.scale_lo = w.scale_hi = h2f((u16)load_u16(blk));
    w.min_lo = w.min_hi = 0.f;
    w.hshift = 0;
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
    else if constexpr (piece_2bit(T)) return k2_piece<T>(blk, p);
    else return q45_k_piece<T>(blk, p);
}

// The first column of piece p's low run within its super-block (its high run: piece_hi(T) on)
template <int T>
HOST_DEVICE int piece_col(int p) {
    return T == T_Q4_K || T == T_Q5_K ? 64 * (p >> 1) + 16 * (p & 1)
                                      : 128 * (p >> 2) + 32 * ((p >> 1) & 1) + 16 * (p & 1);
}

// A row of `ncols` columns in pieces, t = 0 .. piece_count - 1 in column order: the K-quants'
// eight a 256-column super-block, Q8_0's one a 32-column block
template <int T>
HOST_DEVICE int piece_count(int ncols) { return T == T_Q8_0 ? ncols >> 5 : (ncols >> 8) * 8; }
// the first column of piece t's low run in the row (its high run: piece_hi(T) on)
template <int T>
HOST_DEVICE int piece_first_col(int t) {
    return T == T_Q8_0 ? 32 * t : 256 * (t >> 3) + piece_col<T>(t & 7);
}
// piece t of the row at `row`
template <int T>
HOST_DEVICE KPiece<T> row_piece(const u8* __restrict__ row, int t) {
    if constexpr (T == T_Q8_0) return q8_0_piece(row + (i64)t * block_bytes(T));
    else return k_piece<T>(row + (i64)(t >> 3) * block_bytes(T), t & 7);
}

HOST_DEVICE float sum16(const float* v) {
    float s = v[0];
    #pragma unroll
    for (int k = 1; k < 16; ++k) s += v[k];
    return s;
}

// acc + the piece . (lo, hi): lo / hi the 16 activations of its two runs, slo / shi their sums
template <int T>
HOST_DEVICE float k_piece_dot(const KPiece<T>& w, const float* lo, const float* hi, float slo,
                              float shi, float acc) {
    float dlo = 0.f, dhi = 0.f;
    #pragma unroll
    for (int k = 0; k < 4; ++k) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            if constexpr (T == T_Q8_0) {             // int8: low run words 0-3, high 4-7
                dlo = fmaf(s8_to_float(w.q[k] >> (8 * e)), lo[4 * k + e], dlo);
                dhi = fmaf(s8_to_float(w.q[4 + k] >> (8 * e)), hi[4 * k + e], dhi);
                continue;
            }
            constexpr u32 mask = piece_2bit(T) ? 3 : 0xF;
            u32 vlo = (w.q[k] >> (8 * e)) & mask, vhi = (w.q[k] >> (8 * e + 4)) & mask;
            if constexpr (T == T_Q3_K) {              // hmask: bit 0 the low run's, 2 the high's
                const u32 bits = w.h[k] >> (8 * e);
                vlo |= (bits & 1) << 2;
                vhi |= bits & 4;
            } else if constexpr (T == T_Q6_K) {
                const u32 bits = w.h[k] >> (8 * e + w.hshift);
                vlo |= (bits & 3) << 4;
                vhi |= (bits & 0x30);
            } else if constexpr (T == T_Q5_K) {
                const u32 bits = w.h[k] >> (8 * e + w.hshift);
                vlo |= (bits & 1) << 4;
                vhi |= (bits & 2) << 3;
            }
            dlo = fmaf(small_int_to_float<piece_centre(T)>(vlo), lo[4 * k + e], dlo);
            dhi = fmaf(small_int_to_float<piece_centre(T)>(vhi), hi[4 * k + e], dhi);
        }
    }
    acc = fmaf(w.scale_lo, dlo, acc);
    if constexpr (piece_has_min(T)) acc = fmaf(w.min_lo, slo, acc);
    acc = fmaf(w.scale_hi, dhi, acc);
    if constexpr (piece_has_min(T)) acc = fmaf(w.min_hi, shi, acc);
    return acc;
}

__device__ __forceinline__ void load16(const float* __restrict__ p, float* v) {
    load8(p, v);
    load8(p + 8, v + 8);
}

// matvec_rows' contract (decode.cu) for a matrix of a piece_type: y[i, o] = add[i, o] + W[o] . xn_i
// for the n <= N rows, xn = rms_norm(x) * norm_w when norm_w is given; block (0, 0) writes xn to
// `normed`.
// Warp w of block b takes rows (b * warps / PIECE_SPLIT + w / PIECE_SPLIT) * PIECE_ROWS ..; lane
// l the pieces l + 32 (w % PIECE_SPLIT), then every 32 * PIECE_SPLIT, in column order. A fused
// norm's sum of squares is taken in the same pass and the same order (each warp its share, added
// as the rows' sums are), so every warp's scale is the same.
template <int T, int N>
__device__ __forceinline__ void matvec_pieces_rows(const MatSpec* __restrict__ specs,
                                                   const float* __restrict__ x, int x_stride,
                                                   int n, const float* __restrict__ norm_w,
                                                   float eps, float* __restrict__ normed) {
    __shared__ float inv_shared[MAX_ROWS];
    const MatSpec s = specs[blockIdx.y];
    constexpr int S = PIECE_SPLIT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int groups = (blockDim.x >> 5) / S, share = warp % S;    // share: of its rows' pieces
    if ((int)blockIdx.x * groups * PIECE_ROWS >= s.nrows) return;    // the whole block: uniform
    const int o0 = (blockIdx.x * groups + warp / S) * PIECE_ROWS;
    const int pieces = o0 < s.nrows ? piece_count<T>(s.ncols) : 0;  // a warp past the rows: none
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
    for (int t = lane + 32 * share; t < pieces; t += 32 * S) {
        const int col = piece_first_col<T>(t);
        KPiece<T> w[PIECE_ROWS];
        #pragma unroll
        for (int r = 0; r < PIECE_ROWS; ++r) w[r] = row_piece<T>(rows[r], t);
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
    }
    float inv[N];
    // each warp's tree of its rows' sums (and sums of squares) to shared memory; the first
    // warp of a pair adds its S warps' in order, lane m < PIECE_ROWS * N output m
    constexpr int M = PIECE_ROWS * N;
    __shared__ float part[PIECE_THREADS / 32][PIECE_ROWS * MAX_ROWS + MAX_ROWS];
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        const float q = warp_sum(ss[i]);
        if (lane == 0) part[warp][M + i] = q;
        #pragma unroll
        for (int r = 0; r < PIECE_ROWS; ++r) {
            const float v = warp_sum(acc[r][i]);
            if (lane == 0) part[warp][r * N + i] = v;
        }
    }
    __syncthreads();
    const int first = warp - share;
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        float q = part[first][M + i];
        #pragma unroll
        for (int j = 1; j < S; ++j) q += part[first + j][M + i];
        inv[i] = norm_w != nullptr ? rsqrtf(q / (float)s.ncols + eps) : 1.f;
    }
    if (share == 0 && lane < M) {
        const int r = lane / N, i = lane - r * N;
        float v = part[first][lane];
        #pragma unroll
        for (int j = 1; j < S; ++j) v += part[first + j][lane];
        float iv = inv[0];
        #pragma unroll
        for (int j = 1; j < N; ++j)           // inv[i] by static indices (registers)
            if (j == i) iv = inv[j];
        if (i < n && o0 + r < s.nrows)
            store_output(s, i, o0 + r, norm_w != nullptr ? v * iv : v);
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
