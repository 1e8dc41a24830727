// Attention of the decode step (included by decode.cu): q/k RMSNorm + RoPE + the KV write, and
// flash-decoding over the session's KV (splits scored by blocks, combined by the last one). The KV
// is f16, or q8_0 blocks (`_q8` kernels; --kv-type q8_0, backends/kv_cache.py): int8 values and an
// f16 scale per 32 values of a head, quantized here exactly as Q8Rows quantizes on the host.
#pragma once

// ---- q/k norm, RoPE and the KV write -----------------------------------------------------------
// sess: k base of stage layer j at [2j], v base at [2j+1] (f16, or q8_0's int8 values, [cells,
// n_kv, D]); the RoPE cos and sin tables (f32 [cells, rot/2]) at [2*n_layers], [2*n_layers+1];
// with q8_0, the scales of k and v (f16 [cells, n_kv, D/32]) at [2*n_layers+2+2j], [+3+2j].
#define K_SCALES(sess, n_layers, slot) (sess[2 * (n_layers) + 2 + 2 * (slot)])
#define V_SCALES(sess, n_layers, slot) (sess[2 * (n_layers) + 3 + 2 * (slot)])

// --kv-resident (backends/kv_cache.py RingKV; the `_ring` builds): [2j] and [2j+1] hold the
// device's S sink cells and ring of R (f16, or q8_0's int8 values), and after the words above
// (the RoPE tables, then with q8_0 the card's scales) come the device addresses of the pinned,
// mapped host copy of every cell: of k and v at [H + 2j], [H + 2j + 1] (H = KV_HOST_BASE: 2 n + 2
// for f16, where q8_0's scales would be; 4 n + 2 for q8_0), with q8_0 the host copy's scales at
// [6n + 2 + 2j], [+3 + 2j], and then one word S | R << 32 (at 4 n + 2 for f16, 8 n + 2 for q8_0;
// n = n_layers). Cell p is written to the host copy and to slot p (p < S) or S + (p - S) % R; a
// step whose newest cell is end - 1 reads cell p from the device when p < S or p >= end - R, else
// from the host copy in place (over PCIe). A layer slot without K/V (qwen3next's linear layers)
// holds 0 in the host words, never read.
#define KV_HOST_BASE(n_layers, Q8) (2 * (n_layers) + 2 + ((Q8) ? 2 * (n_layers) : 0))
#define K_HOST(sess, n_layers, slot, Q8) (sess[KV_HOST_BASE(n_layers, Q8) + 2 * (slot)])
#define V_HOST(sess, n_layers, slot, Q8) (sess[KV_HOST_BASE(n_layers, Q8) + 2 * (slot) + 1])
#define K_HOST_SCALES(sess, n_layers, slot) (sess[6 * (n_layers) + 2 + 2 * (slot)])
#define V_HOST_SCALES(sess, n_layers, slot) (sess[6 * (n_layers) + 3 + 2 * (slot)])
#define RING_GEOMETRY(sess, n_layers, Q8) \
    (sess[KV_HOST_BASE(n_layers, Q8) + ((Q8) ? 4 : 2) * (n_layers)])

// ---- the rows of a step (decode.cu DESC_*) ----------------------------------------------------
// `sess` holds one pointer table per slot (desc[DESC_TABLE_WORDS] words each): a batched step's
// rows belong to different sessions at different positions, each row naming its session's slot.
// A row's arithmetic is the same whatever the other rows are (nothing here sums across rows).
__device__ __forceinline__ int row_position(const int* __restrict__ desc, int i) {
    return desc[DESC_TABLE_WORDS] != 0 ? desc[DESC_ROW_POS + i] : desc[DESC_POS] + i;
}
// (a one-session writer's zeros: the table at `sess`; the slot word is read only where there are
// table words: a prompt chunk's launch runs far more than MAX_ROWS rows over DESC_WORDS words)
__device__ __forceinline__ const u64* row_table(const u64* sess, const int* __restrict__ desc,
                                                int i) {
    const int words = desc[DESC_TABLE_WORDS];
    return words != 0 ? sess + desc[DESC_ROW_TABLE + i] * words : sess;
}
// the newest cell the step writes of row i's session, + 1 (a ring build's `end`)
__device__ __forceinline__ i64 row_step_end(const int* __restrict__ desc, int i) {
    return desc[DESC_TABLE_WORDS] != 0 ? (i64)desc[DESC_ROW_END + i]
                                       : (i64)desc[DESC_POS] + desc[DESC_ROWS];
}

struct KvRing {
    int sinks, ring;
    __device__ __forceinline__ explicit KvRing(u64 geometry)
        : sinks((int)(geometry & 0xffffffffu)), ring((int)(geometry >> 32)) {}
    __device__ __forceinline__ i64 slot(i64 p) const {
        return p < sinks ? p : sinks + (p - sinks) % ring;
    }
    // the start of cell p's row (`cell_elems` of T: [n_kv, D] halves or int8 values, or q8_0's
    // [n_kv, D / 32] scales) for a step whose newest cell is end - 1
    template <typename T>
    __device__ __forceinline__ const T* row(const T* card, const T* host, i64 p, i64 end,
                                            i64 cell_elems) const {
        return p < sinks || p >= end - ring ? card + slot(p) * cell_elems : host + p * cell_elems;
    }
};

// One block of 32 values, one per lane, into q8_0: scale = max |x| / 127 rounded to f16, values
// rint(x / scale) clamped to [-127, 127] (backends/kv_cache.py Q8Rows, the same arithmetic); with
// qv2 set, the same values and scale there too (a ring's card slot and its host copy).
__device__ __forceinline__ void store_q8_block(float x, int lane, signed char* qv, __half* sc,
                                               signed char* qv2 = nullptr,
                                               __half* sc2 = nullptr) {
    const __half s = __float2half(warp_max(fabsf(x)) / 127.f);
    const float sf = __half2float(s);
    const float inv = sf > 0.f ? 1.f / sf : 0.f;
    const signed char q = (signed char)fminf(fmaxf(rintf(x * inv), -127.f), 127.f);
    qv[lane] = q;
    if (lane == 0) *sc = s;
    if (qv2 != nullptr) {
        qv2[lane] = q;
        if (lane == 0) *sc2 = s;
    }
}

// One head of row i (head < n_head: a query head, else key head head - n_head): RMSNorm (q_norm /
// k_norm), NEOX RoPE over the first `rot` dims at the row's position, then q back in place, or k
// (and, when v != null, v) into the row's session's cache at that position (`tables`: every
// slot's pointer table, the row's picked by the descriptor); with q_dst, q goes there
// instead (qwen3next: its q apart from the gate that follows it in attn_q). One warp. Reads
// through L2: the values may have been written by other blocks of the same launch.
// D: the head width; ROT: the dims rotated (pairs d, d + ROT / 2; qwen3next rotates the first
// 64 of 256); QS: the floats between a row's query heads in q (2 D where each head's q is followed
// by its output gate, qwen3next's attn_q). Compile-time widths keep a head's values in registers
// (a runtime one put them on the stack).
template <bool Q8, int D, int ROT = D, int QS = D, bool RING = false>
__device__ void norm_rope_head(float* __restrict__ q, const float* __restrict__ k,
                               const float* __restrict__ v, const float* __restrict__ qn,
                               const float* __restrict__ kn, const u64* __restrict__ tables,
                               int layer_slot, int n_layers, const int* __restrict__ desc,
                               int n_head, int n_kv, float eps, int i, int head, int lane,
                               float* q_dst = nullptr) {
    const int pos = row_position(desc, i);
    const u64* __restrict__ sess = row_table(tables, desc, i);
    const bool is_q = head < n_head;
    const int hh = is_q ? head : head - n_head;
    const float* src = is_q ? q + ((i64)i * n_head + hh) * QS : k + ((i64)i * n_kv + hh) * D;
    const float* nw = is_q ? qn : kn;
    constexpr int per = D >> 5, half = ROT >> 1, hj = half >> 5;
    static_assert(ROT % 64 == 0 && ROT <= D, "rotated dims: whole pairs of warps");
    float vals[per];
    float ss = 0.f;
    #pragma unroll
    for (int j = 0; j < per; ++j) { vals[j] = __ldcg(src + lane + 32 * j); ss += vals[j] * vals[j]; }
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / (float)D + eps);
    #pragma unroll
    for (int j = 0; j < per; ++j) vals[j] = vals[j] * inv * nw[lane + 32 * j];
    const float* cosT = reinterpret_cast<const float*>(sess[2 * n_layers]) + (i64)pos * half;
    const float* sinT = reinterpret_cast<const float*>(sess[2 * n_layers + 1]) + (i64)pos * half;
    #pragma unroll
    for (int j = 0; j < hj; ++j) {
        const int d = lane + 32 * j;
        const float c = cosT[d], s = sinT[d], x1 = vals[j], x2 = vals[j + hj];
        vals[j] = x1 * c - x2 * s;
        vals[j + hj] = x2 * c + x1 * s;
    }
    if (is_q) {
        float* dst = q_dst != nullptr ? q_dst : q + ((i64)i * n_head + hh) * QS;
        #pragma unroll
        for (int j = 0; j < per; ++j) dst[lane + 32 * j] = vals[j];
    } else if constexpr (RING && !Q8) {   // the device's slot and the host copy, the same halves
        const KvRing ring(RING_GEOMETRY(sess, n_layers, false));
        const i64 at = (ring.slot(pos) * n_kv + hh) * D, host_at = ((i64)pos * n_kv + hh) * D;
        __half* kc = reinterpret_cast<__half*>(sess[2 * layer_slot]) + at;
        __half* kh = reinterpret_cast<__half*>(K_HOST(sess, n_layers, layer_slot, false)) + host_at;
        #pragma unroll
        for (int j = 0; j < per; ++j) {
            const __half x = __float2half(vals[j]);
            kc[lane + 32 * j] = x;
            kh[lane + 32 * j] = x;
        }
        if (v != nullptr) {
            __half* vc = reinterpret_cast<__half*>(sess[2 * layer_slot + 1]) + at;
            __half* vh = reinterpret_cast<__half*>(V_HOST(sess, n_layers, layer_slot, false)) +
                         host_at;
            const float* vs = v + ((i64)i * n_kv + hh) * D;
            for (int j = 0; j < per; ++j) {
                const __half x = __float2half(vs[lane + 32 * j]);
                vc[lane + 32 * j] = x;
                vh[lane + 32 * j] = x;
            }
        }
    } else if constexpr (RING) {          // q8_0: the same blocks into the slot and the host copy
        const KvRing ring(RING_GEOMETRY(sess, n_layers, true));
        const i64 at = ring.slot(pos) * n_kv + hh, host_at = (i64)pos * n_kv + hh;
        constexpr int NB = D >> 5;        // blocks (scales) a head
        signed char* kc = reinterpret_cast<signed char*>(sess[2 * layer_slot]) + at * D;
        __half* ks = reinterpret_cast<__half*>(K_SCALES(sess, n_layers, layer_slot)) + at * NB;
        signed char* kh = reinterpret_cast<signed char*>(K_HOST(sess, n_layers, layer_slot, true)) +
                          host_at * D;
        __half* khs = reinterpret_cast<__half*>(K_HOST_SCALES(sess, n_layers, layer_slot)) +
                      host_at * NB;
        #pragma unroll
        for (int j = 0; j < per; ++j)
            store_q8_block(vals[j], lane, kc + 32 * j, ks + j, kh + 32 * j, khs + j);
        if (v != nullptr) {
            signed char* vc = reinterpret_cast<signed char*>(sess[2 * layer_slot + 1]) + at * D;
            __half* vsc = reinterpret_cast<__half*>(V_SCALES(sess, n_layers, layer_slot)) + at * NB;
            signed char* vh =
                reinterpret_cast<signed char*>(V_HOST(sess, n_layers, layer_slot, true)) +
                host_at * D;
            __half* vhs = reinterpret_cast<__half*>(V_HOST_SCALES(sess, n_layers, layer_slot)) +
                          host_at * NB;
            const float* vs = v + ((i64)i * n_kv + hh) * D;
            for (int j = 0; j < per; ++j)
                store_q8_block(vs[lane + 32 * j], lane, vc + 32 * j, vsc + j, vh + 32 * j,
                               vhs + j);
        }
    } else if constexpr (!Q8) {
        __half* kc = reinterpret_cast<__half*>(sess[2 * layer_slot]) + ((i64)pos * n_kv + hh) * D;
        #pragma unroll
        for (int j = 0; j < per; ++j) kc[lane + 32 * j] = __float2half(vals[j]);
        if (v != nullptr) {
            __half* vc = reinterpret_cast<__half*>(sess[2 * layer_slot + 1]) + ((i64)pos * n_kv + hh) * D;
            const float* vs = v + ((i64)i * n_kv + hh) * D;
            for (int j = 0; j < per; ++j) vc[lane + 32 * j] = __float2half(vs[lane + 32 * j]);
        }
    } else {                                  // block j of the head is lane + 32 j: one per lane
        const i64 at = (i64)pos * n_kv + hh;
        signed char* kc = reinterpret_cast<signed char*>(sess[2 * layer_slot]) + at * D;
        __half* ks = reinterpret_cast<__half*>(K_SCALES(sess, n_layers, layer_slot)) + at * (D >> 5);
        #pragma unroll
        for (int j = 0; j < per; ++j) store_q8_block(vals[j], lane, kc + 32 * j, ks + j);
        if (v != nullptr) {
            signed char* vc = reinterpret_cast<signed char*>(sess[2 * layer_slot + 1]) + at * D;
            __half* vsc = reinterpret_cast<__half*>(V_SCALES(sess, n_layers, layer_slot)) + at * (D >> 5);
            const float* vs = v + ((i64)i * n_kv + hh) * D;
            for (int j = 0; j < per; ++j) store_q8_block(vs[lane + 32 * j], lane, vc + 32 * j, vsc + j);
        }
    }
}

// ---- attention --------------------------------------------------------------------------------
// The flash-decoding partials (`part` [rows, n_head, n_split, D], `ml` [rows, n_head, n_split, 2])
// are the step's own scratch.

// Per head of each row: norm_rope_head (q back in place, k and v into the cache). One warp per
// (head, row).
// D and rot stay in the arguments the runner passes; the kernels are built for 128-wide, fully
// rotated heads (backends/cuda_decode.py takes no other geometry).
#define QK_NORM_ROPE_KV(suffix, Q8, RING)                                                         \
    extern "C" __global__ void qk_norm_rope_kv##suffix(                                           \
            float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,      \
            const float* __restrict__ qn, const float* __restrict__ kn,                          \
            const u64* __restrict__ sess, int layer_slot, int n_layers,                          \
            const int* __restrict__ desc, int n_head, int n_kv, int D, int rot, float eps) {      \
        pdl_entry();                                                                             \
        norm_rope_head<Q8, 128, 128, 128, RING>(q, k, v, qn, kn, sess, layer_slot, n_layers,     \
                                                desc, n_head, n_kv, eps, blockIdx.y, blockIdx.x, \
                                                threadIdx.x);                                    \
    }
QK_NORM_ROPE_KV(, false, false)
QK_NORM_ROPE_KV(_q8, true, false)
QK_NORM_ROPE_KV(_ring, false, true)
QK_NORM_ROPE_KV(_q8_ring, true, true)

// Flash-decoding, first half: block (head group, split, row) scores `chunk` (<= ATTN_CHUNK) keys
// for its `hb` query heads (h0 = blockIdx.x * hb on; one kv head serves them all) and writes an
// unnormalised partial (max, sum, weighted V), or, when the split is the row's only one, the
// attention itself (what attn_combine_heads would make of one partial, bit for bit).
// Short chunks and small head groups spread a short context over more blocks; the runner picks
// both (a block's instructions, not memory, bound these launches at short contexts).
template <int D, bool Q8, int MAX_G, bool RING = false>
__device__ __forceinline__ void attn_partial_body(
        const float* __restrict__ q, const u64* __restrict__ tables, int layer_slot,
        int n_layers, const int* __restrict__ desc, int n_head, int n_kv, int hb, int n_split,
        int chunk, float scale, float* __restrict__ part, float* __restrict__ ml,
        float* __restrict__ out) {
    constexpr int PAIRS = D / 2;
    // q and the scores first; the same bytes hold the cross-thread sums of weighted V at the end
    __shared__ __align__(16) float smem[MAX_G * D + MAX_G * ATTN_CHUNK];
    __shared__ float ms[MAX_G], ls[MAX_G];
    float* qs = smem;
    float* ps = smem + MAX_G * D;
    const int h0 = blockIdx.x * hb, split = blockIdx.y, i = blockIdx.z;
    const int G = hb, kvh = h0 / (n_head / n_kv), t = threadIdx.x;
    const int len = row_position(desc, i) + 1;          // keys this row sees (causal)
    const int start = split * chunk;
    if (start >= len) return;
    const int count = min(chunk, len - start);
    const u64* __restrict__ sess = row_table(tables, desc, i);   // the row's session
    const __half* kc = reinterpret_cast<const __half*>(sess[2 * layer_slot]);
    const __half* vc = reinterpret_cast<const __half*>(sess[2 * layer_slot + 1]);
    // q8_0: the same loads read 4 int8 values (a u32) of K and 2 (a u16) of V, plus their scales
    constexpr int NB = D >> 5;               // q8_0 blocks (scales) of a head
    const signed char* kq8 = reinterpret_cast<const signed char*>(sess[2 * layer_slot]);
    const signed char* vq8 = reinterpret_cast<const signed char*>(sess[2 * layer_slot + 1]);
    const __half* ksc = Q8 ? reinterpret_cast<const __half*>(K_SCALES(sess, n_layers, layer_slot))
                           : nullptr;
    const __half* vsc = Q8 ? reinterpret_cast<const __half*>(V_SCALES(sess, n_layers, layer_slot))
                           : nullptr;
    // the ring builds: each key's row (values, and q8_0's scales) from the device or the host
    // copy (KvRing), the step's newest cell being the last row of this row's session
    const u64 k_host = RING ? K_HOST(sess, n_layers, layer_slot, Q8) : 0;
    const u64 v_host = RING ? V_HOST(sess, n_layers, layer_slot, Q8) : 0;
    const __half* khs = RING && Q8 ? reinterpret_cast<const __half*>(
                                         K_HOST_SCALES(sess, n_layers, layer_slot)) : nullptr;
    const __half* vhs = RING && Q8 ? reinterpret_cast<const __half*>(
                                         V_HOST_SCALES(sess, n_layers, layer_slot)) : nullptr;
    const KvRing ring(RING ? RING_GEOMETRY(sess, n_layers, Q8) : (u64)1 << 32);
    const i64 step_end = row_step_end(desc, i), cell_elems = (i64)n_kv * D;
    const i64 cell_scales = (i64)n_kv * NB;
    // Every load that needs nothing computed here goes out first, so the block waits on memory
    // once: the first round's K of this thread, its first V_AHEAD keys of V, and q.
    constexpr int SPLIT = 4;                 // threads per key in the scores
    constexpr int KQ = BLOCK_THREADS / PAIRS, V_AHEAD = 64 / KQ;  // V: KQ threads per dim pair
    constexpr int KW = D / (4 * SPLIT);      // a thread's 4-dim pieces of a key
    const int u = t % SPLIT, dp = t % PAIRS, kq = t / PAIRS;
    // q8_0: a key's NB scales are read as one uint2 (128 wide) or uint4 (256 wide)
    static_assert(!Q8 || D == 128 || D == 256, "q8_0 K rows: 4 or 8 scales of 32");
    constexpr int SW = Q8 ? NB / 2 : 1;      // u32 words of a key's scales (two f16 each)
    uint2 k_ahead[KW];                       // f16: 4 halves per piece; q8_0: .x holds 4 int8
    u32 k_scales[SW];                        // q8_0: the key's block scales (f16 pairs)
    #pragma unroll
    for (int w = 0; w < SW; ++w) k_scales[w] = 0u;
    // a key's scales (q8_0) from `src` into k_scales: ld loads (ring: plain loads of host memory)
    auto take_scales = [&](const __half* src, bool ldg) {
        if constexpr (SW == 2) {
            const uint2* p = reinterpret_cast<const uint2*>(src);
            const uint2 w = ldg ? __ldg(p) : *p;
            k_scales[0] = w.x;
            k_scales[1] = w.y;
        } else if constexpr (SW == 4) {
            const uint4* p = reinterpret_cast<const uint4*>(src);
            const uint4 w = ldg ? __ldg(p) : *p;
            k_scales[0] = w.x;
            k_scales[1] = w.y;
            k_scales[2] = w.z;
            k_scales[3] = w.w;
        }
    };
    auto load_k = [&](int kk) {
        const i64 row = (i64)(start + kk) * n_kv + kvh;
        if constexpr (RING && !Q8) {
            const uint2* krow = reinterpret_cast<const uint2*>(
                ring.row(kc, reinterpret_cast<const __half*>(k_host), start + kk, step_end,
                         cell_elems) + kvh * D);
            #pragma unroll
            for (int j = 0; j < KW; ++j) k_ahead[j] = krow[u + SPLIT * j];
        } else if constexpr (RING) {
            const u32* krow = reinterpret_cast<const u32*>(
                ring.row(kq8, reinterpret_cast<const signed char*>(k_host), start + kk, step_end,
                         cell_elems) + kvh * D);
            #pragma unroll
            for (int j = 0; j < KW; ++j) k_ahead[j].x = krow[u + SPLIT * j];
            take_scales(ring.row(ksc, khs, start + kk, step_end, cell_scales) + kvh * NB, false);
        } else if constexpr (!Q8) {
            const uint2* krow = reinterpret_cast<const uint2*>(kc + row * D);
            #pragma unroll
            for (int j = 0; j < KW; ++j) k_ahead[j] = __ldg(krow + u + SPLIT * j);
        } else {
            const u32* krow = reinterpret_cast<const u32*>(kq8 + row * D);
            #pragma unroll
            for (int j = 0; j < KW; ++j) k_ahead[j].x = __ldg(krow + u + SPLIT * j);
            take_scales(ksc + row * NB, true);
        }
    };
    load_k(min(t / SPLIT, count - 1));
    const __half2* vp = reinterpret_cast<const __half2*>(vc + ((i64)start * n_kv + kvh) * D) + dp;
    const u16* vp8 = reinterpret_cast<const u16*>(vq8 + ((i64)start * n_kv + kvh) * D) + dp;
    const __half* vs8 = Q8 ? vsc + ((i64)start * n_kv + kvh) * NB + (2 * dp) / 32 : nullptr;
    const i64 vstride = (i64)n_kv * PAIRS, sstride = (i64)n_kv * NB;
    // V of key c (relative to the split's start) at dims 2 dp, 2 dp + 1, as 32 bits (f16: the
    // half2; q8_0: the two int8 values, then the block's f16 scale) and as floats
    auto load_v = [&](int c) -> u32 {
        if constexpr (RING && !Q8) {
            const __half2 h = reinterpret_cast<const __half2*>(
                ring.row(vc, reinterpret_cast<const __half*>(v_host), start + c, step_end,
                         cell_elems) + kvh * D)[dp];
            return *reinterpret_cast<const u32*>(&h);
        } else if constexpr (RING) {
            const u16 vals = reinterpret_cast<const u16*>(
                ring.row(vq8, reinterpret_cast<const signed char*>(v_host), start + c, step_end,
                         cell_elems) + kvh * D)[dp];
            const u16 sbits = __half_as_ushort(
                ring.row(vsc, vhs, start + c, step_end, cell_scales)[kvh * NB + (2 * dp) / 32]);
            return (u32)vals | ((u32)sbits << 16);
        } else if constexpr (!Q8) {
            const __half2 h = __ldg(vp + c * vstride);
            return *reinterpret_cast<const u32*>(&h);
        } else {
            const u16 sbits = __half_as_ushort(__ldg(vs8 + c * sstride));
            return (u32)__ldg(vp8 + c * vstride) | ((u32)sbits << 16);
        }
    };
    auto v_floats = [&](u32 raw) -> float2 {
        if constexpr (!Q8) {
            return __half22float2(*reinterpret_cast<const __half2*>(&raw));
        } else {
            const float sc = __half2float(__ushort_as_half((u16)(raw >> 16)));
            return make_float2((float)(signed char)(raw & 0xff) * sc,
                               (float)(signed char)((raw >> 8) & 0xff) * sc);
        }
    };
    u32 v_ahead[V_AHEAD];
    #pragma unroll
    for (int m = 0; m < V_AHEAD; ++m) {
        const int c = kq + KQ * m;
        v_ahead[m] = c < count ? load_v(c) : 0u;
    }
    for (int idx = t; idx < G * D; idx += blockDim.x)
        qs[idx] = q[((i64)i * n_head + h0) * D + idx];
    __syncthreads();
    // scores: SPLIT threads per key, thread u taking dims 4u + 16j: its q reads from shared memory
    // are conflict-free and the G heads' sums are independent chains. Every thread runs every
    // round (the shuffles need whole warps); a round's keys past `count` are computed and dropped.
    for (int base = 0; base < count; base += blockDim.x / SPLIT) {
        const int key = base + t / SPLIT, kk = min(key, count - 1);
        if (base > 0) load_k(kk);
        float acc[MAX_G];
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g) acc[g] = 0.f;
        #pragma unroll
        for (int j = 0; j < KW; ++j) {
            float2 k01, k23;
            if constexpr (!Q8) {
                k01 = __half22float2(*reinterpret_cast<const __half2*>(&k_ahead[j].x));
                k23 = __half22float2(*reinterpret_cast<const __half2*>(&k_ahead[j].y));
            } else {                         // dims 4u + 16j: block j / 2 of the head
                const u32 w = k_ahead[j].x;
                const u32 sw = k_scales[j >> 2];     // scales 2 (j >> 2) and 2 (j >> 2) + 1
                const u16 sbits = (u16)(((j >> 1) & 1) ? (sw >> 16) : (sw & 0xffff));
                const float sc = __half2float(__ushort_as_half(sbits));
                k01 = make_float2((float)(signed char)(w & 0xff) * sc,
                                  (float)(signed char)((w >> 8) & 0xff) * sc);
                k23 = make_float2((float)(signed char)((w >> 16) & 0xff) * sc,
                                  (float)(signed char)(w >> 24) * sc);
            }
            #pragma unroll
            for (int g = 0; g < MAX_G; ++g) {
                if (g < G) {
                    const float4 qv =
                        *reinterpret_cast<const float4*>(qs + g * D + 4 * u + 4 * SPLIT * j);
                    acc[g] = fmaf(qv.x, k01.x, acc[g]);
                    acc[g] = fmaf(qv.y, k01.y, acc[g]);
                    acc[g] = fmaf(qv.z, k23.x, acc[g]);
                    acc[g] = fmaf(qv.w, k23.y, acc[g]);
                }
            }
        }
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
            if (g < G) {
                float v = acc[g];
                #pragma unroll
                for (int o = 1; o < SPLIT; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                if (u == 0 && key < count) ps[g * ATTN_CHUNK + key] = v * scale;
            }
        }
    }
    __syncthreads();
    const int warp = t >> 5, lane = t & 31, nwarps = blockDim.x >> 5;
    for (int g = warp; g < G; g += nwarps) {
        float m = -INF_F32;
        for (int c = lane; c < count; c += 32) m = fmaxf(m, ps[g * ATTN_CHUNK + c]);
        m = warp_max(m);
        float l = 0.f;
        for (int c = lane; c < count; c += 32) {
            float e = __expf(ps[g * ATTN_CHUNK + c] - m);
            ps[g * ATTN_CHUNK + c] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) { ms[g] = m; ls[g] = l; }
    }
    __syncthreads();
    // weighted V: thread (kq, dp) takes keys kq, kq + KQ, ... for the dim pair dp of every head
    // (one half2 load of V serves all G), then the KQ partial sums are added in kq order
    float2 acc[MAX_G];
    #pragma unroll
    for (int g = 0; g < MAX_G; ++g) acc[g] = make_float2(0.f, 0.f);
    auto add_v = [&](int c, float2 v) {      // key c's weight times its V, for every head
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
            if (g < G) {
                const float p = ps[g * ATTN_CHUNK + c];
                acc[g].x += p * v.x;
                acc[g].y += p * v.y;
            }
        }
    };
    #pragma unroll
    for (int m = 0; m < V_AHEAD; ++m) {       // the keys whose V is already in registers
        const int c = kq + KQ * m;
        if (c < count) add_v(c, v_floats(v_ahead[m]));
    }
    #pragma unroll 4
    for (int c = kq + KQ * V_AHEAD; c < count; c += KQ) add_v(c, v_floats(load_v(c)));
    __syncthreads();                                     // qs and ps are read for the last time
    float2* red = reinterpret_cast<float2*>(smem);       // [KQ - 1][MAX_G][PAIRS]
    if (kq > 0) {
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g)
            if (g < G) red[((kq - 1) * MAX_G + g) * PAIRS + dp] = acc[g];
    }
    __syncthreads();
    const bool only_split = count == len;
    if (kq == 0) {
        #pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
            if (g < G) {
                float2 a = acc[g];
                for (int o = 1; o < KQ; ++o) {
                    const float2 b = red[((o - 1) * MAX_G + g) * PAIRS + dp];
                    a.x += b.x;
                    a.y += b.y;
                }
                if (only_split) {             // the combine's weight would be exp(0) = 1
                    reinterpret_cast<float2*>(out + ((i64)i * n_head + h0 + g) * D)[dp] =
                        make_float2(a.x / ls[g], a.y / ls[g]);
                    continue;
                }
                const i64 at = ((i64)i * n_head + h0 + g) * n_split + split;
                reinterpret_cast<float2*>(part + at * D)[dp] = a;
                if (dp == 0) { ml[2 * at] = ms[g]; ml[2 * at + 1] = ls[g]; }
            }
        }
    }
}

// Flash-decoding, second half, run by the last of a (row, head group)'s split blocks to finish
// (counted in done[row * gridDim.x + blockIdx.x], which it resets for the next launch): the splits
// of each of its heads combined in split order. The partials were written by other blocks: read
// via L2. Latency, not bandwidth, bounds this, so the block waits on L2 twice, not three times:
// the first AHEAD splits' values of a thread's outputs load together with the splits' (max, sum)
// pairs, a warp per head keeps the pairs of the first 32 splits in registers from the max to the
// weights, and later values load AHEAD at a time. The sums run in split order with the same
// expressions as one thread per output walking the splits, so the result is that one's, bit for bit.
#define COMBINE_TILE 64     // splits whose weights are in shared memory at a time
template <int D, int MAX_G>
__device__ __forceinline__ void attn_combine_heads(const float* part, const float* ml, int len,
                                                   int n_head, int hb, int n_split, int chunk,
                                                   float* __restrict__ out) {
    constexpr int PER = (MAX_G * D + BLOCK_THREADS - 1) / BLOCK_THREADS;
    constexpr int AHEAD = 32 / PER < 2 ? 2 : 32 / PER > 8 ? 8 : 32 / PER;  // values in flight
    constexpr int NWARPS = BLOCK_THREADS / 32, HEADS_PER_WARP = (MAX_G + NWARPS - 1) / NWARPS;
    __shared__ float w_s[MAX_G][COMBINE_TILE], l_s[MAX_G][COMBINE_TILE];
    const int h0 = blockIdx.x * hb, i = blockIdx.z, G = hb;
    const int used = (len + chunk - 1) / chunk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float2* ml2 = reinterpret_cast<const float2*>(ml);
    auto first_split = [&](int g) -> i64 { return ((i64)i * n_head + h0 + g) * n_split; };
    float ahead[PER][AHEAD];
    #pragma unroll
    for (int r = 0; r < PER; ++r) {
        const int idx = threadIdx.x + r * BLOCK_THREADS, g = idx / D, d = idx % D;
        #pragma unroll
        for (int u = 0; u < AHEAD; ++u)
            ahead[r][u] = idx < G * D && u < used ? __ldcg(part + (first_split(g) + u) * D + d)
                                                  : 0.f;
    }
    float2 pair[HEADS_PER_WARP];          // (max, sum) of split `lane` of head warp + NWARPS j
    float m_head[HEADS_PER_WARP];         // the max over the head's splits
    #pragma unroll
    for (int j = 0; j < HEADS_PER_WARP; ++j) {
        const int g = warp + NWARPS * j;
        pair[j] = g < G && lane < used ? __ldcg(ml2 + first_split(g) + lane)
                                       : make_float2(-INF_F32, 0.f);
    }
    #pragma unroll
    for (int j = 0; j < HEADS_PER_WARP; ++j) {
        const int g = warp + NWARPS * j;
        float m = pair[j].x;
        if (g < G)
            for (int s = lane + 32; s < used; s += 32)
                m = fmaxf(m, __ldcg(ml + 2 * (first_split(g) + s)));
        m_head[j] = warp_max(m);
    }
    float num[PER], den[PER];
    #pragma unroll
    for (int r = 0; r < PER; ++r) { num[r] = 0.f; den[r] = 0.f; }
    for (int s0 = 0; s0 < used; s0 += COMBINE_TILE) {
        const int s1 = min(used, s0 + COMBINE_TILE);
        __syncthreads();                      // the last tile's weights read
        #pragma unroll
        for (int j = 0; j < HEADS_PER_WARP; ++j) {
            const int g = warp + NWARPS * j;
            if (g >= G) continue;
            for (int s = s0 + lane; s < s1; s += 32) {
                const float2 p = s < 32 ? pair[j] : __ldcg(ml2 + first_split(g) + s);
                w_s[g][s - s0] = __expf(p.x - m_head[j]);
                l_s[g][s - s0] = p.y;
            }
        }
        __syncthreads();
        #pragma unroll
        for (int r = 0; r < PER; ++r) {
            const int idx = threadIdx.x + r * BLOCK_THREADS;
            if (idx < G * D) {
                const int g = idx / D, d = idx % D;
                const float* p = part + first_split(g) * D + d;
                for (int s = s0; s < s1; s += AHEAD) {
                    float v[AHEAD];
                    #pragma unroll
                    for (int u = 0; u < AHEAD; ++u)
                        v[u] = s == 0 ? ahead[r][u]
                                      : s + u < s1 ? __ldcg(p + (i64)(s + u) * D) : 0.f;
                    #pragma unroll
                    for (int u = 0; u < AHEAD; ++u) {
                        if (s + u < s1) {
                            const float w = w_s[g][s + u - s0];
                            num[r] += w * v[u];
                            den[r] += w * l_s[g][s + u - s0];
                        }
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < PER; ++r) {
        const int idx = threadIdx.x + r * BLOCK_THREADS;
        if (idx < G * D) {
            const int g = idx / D, d = idx % D;
            out[((i64)i * n_head + h0 + g) * D + d] = num[r] / den[r];
        }
    }
}

// Grid (n_head / hb, n_split, rows), BLOCK_THREADS threads, hb = min(G, MAX_G) query heads per
// block (G, the query heads per kv head, a multiple of hb): out [rows, n_head, D] is the attention
// of each row's query heads over its causal keys.
template <int D, bool Q8, int MAX_G, bool RING = false>
__device__ __forceinline__ void attn_decode_body(const float* q, const u64* sess, int layer_slot,
                                                 const int* desc, int n_head, int n_kv,
                                                 int n_split, int chunk, float scale, float* part,
                                                 float* ml, u32* __restrict__ done,
                                                 float* __restrict__ out, int n_layers) {
    // splits past the row's keys leave at once and are not counted: the grid is sized for the
    // longest context, and at a short one most of its blocks have nothing to do
    const int len = row_position(desc, blockIdx.z) + 1;
    const int used = min((len + chunk - 1) / chunk, (int)gridDim.y);
    if ((int)blockIdx.y >= used) return;
    const int hb = min(n_head / n_kv, MAX_G);
    attn_partial_body<D, Q8, MAX_G, RING>(q, sess, layer_slot, n_layers, desc, n_head, n_kv, hb,
                                    n_split, chunk, scale, part, ml, out);
    if (used == 1) return;                   // the only split wrote the attention itself
    if (!last_block_to_finish(done + blockIdx.z * gridDim.x + blockIdx.x, (u32)used)) return;
    attn_combine_heads<D, MAX_G>(part, ml, len, n_head, hb, n_split, chunk, out);
}

// n_layers: the stage's layers (where a q8_0 session's scales start in `sess`). One build per
// bound on the query heads of a block (2, 4, 8, 16: kernels/abi.py attn_kernel picks it): the
// per-head loops are unrolled to that bound, so a build for 16 heads running 8 would issue twice
// the instructions, and these launches are bound by the instructions of one block. A bound below
// the heads per kv head splits each kv head's queries over several blocks.
#define ATTN_DECODE(suffix, Q8, MAX_G)                                                            \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) attn_decode_128##suffix(         \
            const float* q, const u64* sess, int layer_slot, const int* desc, int n_head,         \
            int n_kv, int n_split, int chunk, float scale, float* part, float* ml,                \
            u32* __restrict__ done, float* __restrict__ out, int n_layers) {                      \
        pdl_entry();                                                                             \
        attn_decode_body<128, Q8, MAX_G>(q, sess, layer_slot, desc, n_head, n_kv, n_split, chunk,\
                                         scale, part, ml, done, out, n_layers);                  \
    }
// The ring builds (--kv-resident; f16, and q8_0 as `_q8_ring`): the plain ones reading each key
// where KvRing says (the separate q/k norm launch, qk_norm_rope_kv_ring / _q8_ring, writes both
// copies of the new cell).
#define ATTN_DECODE_RING(suffix, Q8, MAX_G)                                                       \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) attn_decode_128##suffix##_ring(  \
            const float* q, const u64* sess, int layer_slot, const int* desc, int n_head,         \
            int n_kv, int n_split, int chunk, float scale, float* part, float* ml,                \
            u32* __restrict__ done, float* __restrict__ out, int n_layers) {                      \
        pdl_entry();                                                                             \
        attn_decode_body<128, Q8, MAX_G, true>(q, sess, layer_slot, desc, n_head, n_kv,          \
                                               n_split, chunk, scale, part, ml, done, out,       \
                                               n_layers);                                        \
    }
ATTN_DECODE_RING(_g2, false, 2)
ATTN_DECODE_RING(_g4, false, 4)
ATTN_DECODE_RING(_g8, false, 8)
ATTN_DECODE_RING(_g16, false, 16)
ATTN_DECODE_RING(_g2_q8, true, 2)
ATTN_DECODE_RING(_g4_q8, true, 4)
ATTN_DECODE_RING(_g8_q8, true, 8)
ATTN_DECODE_RING(_g16_q8, true, 16)
ATTN_DECODE(_g2, false, 2)
ATTN_DECODE(_g4, false, 4)
ATTN_DECODE(_g8, false, 8)
ATTN_DECODE(_g16, false, 16)
ATTN_DECODE(_g2_q8, true, 2)
ATTN_DECODE(_g4_q8, true, 4)
ATTN_DECODE(_g8_q8, true, 8)
ATTN_DECODE(_g16_q8, true, 16)
