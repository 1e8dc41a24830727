// qwen3next's gated attention layers and its shared expert in the decode step (included by
// decode.cu after attention.cuh and gated_delta.cuh). Per row of an attention layer: attn_q gives
// each head's q followed by its output gate (2 D floats); q and k are RMSNormed per head and
// NEOX-rotated over their first NEXT_ROT dims; attention over the session's f16 or q8_0 K/V
// reads 256-wide heads; the output is multiplied by sigmoid(gate) before attn_output. The shared
// expert's SwiGLU is gated by sigmoid of a one-row projection (models/qwen3next.py `_attention`, `_moe`, the
// reference these kernels are tested against).
#pragma once

#define NEXT_D 256      // qwen3next's attention head width (Qwen3-Next-80B: 256)
#define NEXT_ROT 64     // the dims it rotates (rope.dimension_count)

// Grid (n_head + n_kv, rows), 32 threads: head h < n_head of row i is q, normed and rotated out of
// qg [rows, n_head, 2 D] into q [rows, n_head, D]; head n_head + j is k head j, normed, rotated and
// written into the session's K at the row's position with v's head j into V: f16, or with the
// `_q8` builds q8_0 blocks (int8 values, an f16 scale per 32, as Q8Rows quantizes; the scales'
// words after the RoPE tables, attention.cuh K_SCALES; a linear layer's slots there hold 0).
// The `_ring` builds (--kv-resident, backends/kv_cache.py RingKV): K and V written into the card's
// slot of the position and into the pinned host copy of every cell, the pointer table laid out as
// attention.cuh's KvRing says (a linear layer's host words hold 0 and are never read).
#define NEXT_QK_NORM_ROPE_KV(suffix, Q8, RING)                                                    \
    extern "C" __global__ void next_qk_norm_rope_kv##suffix(                                      \
            const float* __restrict__ qg, const float* __restrict__ k,                           \
            const float* __restrict__ v, const float* __restrict__ qn,                           \
            const float* __restrict__ kn, const u64* __restrict__ sess, int layer_slot,          \
            int n_layers, const int* __restrict__ desc, int n_head, int n_kv, float eps,         \
            float* __restrict__ q) {                                                             \
        pdl_entry();                                                                             \
        const int head = blockIdx.x, i = blockIdx.y;                                             \
        float* q_dst = head < n_head ? q + ((i64)i * n_head + head) * NEXT_D : nullptr;          \
        norm_rope_head<Q8, NEXT_D, NEXT_ROT, 2 * NEXT_D, RING>(                                  \
            const_cast<float*>(qg), k, v, qn, kn, sess, layer_slot, n_layers, desc, n_head,      \
            n_kv, eps, i, head, threadIdx.x, q_dst);                                             \
    }
NEXT_QK_NORM_ROPE_KV(, false, false)
NEXT_QK_NORM_ROPE_KV(_ring, false, true)
NEXT_QK_NORM_ROPE_KV(_q8, true, false)
NEXT_QK_NORM_ROPE_KV(_q8_ring, true, true)

// The decode attention over 256-wide heads (f16 or, `_q8`, q8_0 K/V), the builds of attention.cuh's
// ATTN_DECODE for that width (q and k normalised beforehand by next_qk_norm_rope_kv). The `_ring`
// builds read each key's row from the card or in place from the host copy (KvRing), with the
// plain builds' arithmetic in the plain builds' order.
#define NEXT_ATTN_DECODE(suffix, Q8, MAX_G, RING)                                                 \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) attn_decode_256##suffix(         \
            const float* q, const u64* sess, int layer_slot, const int* desc, int n_head,         \
            int n_kv, int n_split, int chunk, float scale, float* part, float* ml,                \
            u32* __restrict__ done, float* __restrict__ out, int n_layers) {                      \
        pdl_entry();                                                                             \
        attn_decode_body<NEXT_D, Q8, MAX_G, RING>(q, sess, layer_slot, desc, n_head, n_kv,       \
                                                  n_split, chunk, scale, part, ml, done, out,    \
                                                  n_layers);                                     \
    }
NEXT_ATTN_DECODE(_g2, false, 2, false)
NEXT_ATTN_DECODE(_g4, false, 4, false)
NEXT_ATTN_DECODE(_g8, false, 8, false)
NEXT_ATTN_DECODE(_g16, false, 16, false)
NEXT_ATTN_DECODE(_g2_ring, false, 2, true)
NEXT_ATTN_DECODE(_g4_ring, false, 4, true)
NEXT_ATTN_DECODE(_g8_ring, false, 8, true)
NEXT_ATTN_DECODE(_g16_ring, false, 16, true)
NEXT_ATTN_DECODE(_g2_q8, true, 2, false)
NEXT_ATTN_DECODE(_g4_q8, true, 4, false)
NEXT_ATTN_DECODE(_g8_q8, true, 8, false)
NEXT_ATTN_DECODE(_g16_q8, true, 16, false)
NEXT_ATTN_DECODE(_g2_q8_ring, true, 2, true)
NEXT_ATTN_DECODE(_g4_q8_ring, true, 4, true)
NEXT_ATTN_DECODE(_g8_q8_ring, true, 8, true)
NEXT_ATTN_DECODE(_g16_q8_ring, true, 16, true)

// out[i, h D + d] *= sigmoid(qg[i, h 2 D + D + d]): the attention of each head times its gate.
// Grid (ceil(n_head D / 256), rows), 256 threads.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) next_attn_gate(
        float* __restrict__ out, const float* __restrict__ qg, int n_head) {
    pdl_entry();
    const int j = blockIdx.x * BLOCK_THREADS + threadIdx.x, i = blockIdx.y;
    if (j >= n_head * NEXT_D) return;
    const int h = j / NEXT_D, d = j % NEXT_D;
    const float gate = qg[((i64)i * n_head + h) * 2 * NEXT_D + NEXT_D + d];
    out[(i64)i * n_head * NEXT_D + j] *= gdn_sigmoid(gate);
}

// act[i, f] = silu(g[i, f]) u[i, f] sigmoid(s[i]): the shared expert's SwiGLU, already weighted by
// its gate (so ffn_down_shexp's matvec adds it to the residual as it is: down is linear).
// g and u are the rows of one [rows, 2 n_ff] buffer (gate, then up); grid (ceil(n_ff / 256),
// rows), 256 threads.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) next_shexp_act(
        const float* __restrict__ gu, const float* __restrict__ s, int n_ff,
        float* __restrict__ act) {
    pdl_entry();
    const int f = blockIdx.x * BLOCK_THREADS + threadIdx.x, i = blockIdx.y;
    if (f >= n_ff) return;
    const float g = gu[(i64)i * 2 * n_ff + f], u = gu[(i64)i * 2 * n_ff + n_ff + f];
    act[(i64)i * n_ff + f] = gdn_silu(g) * u * gdn_sigmoid(s[i]);
}
