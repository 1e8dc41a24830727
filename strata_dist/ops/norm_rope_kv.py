"""The q/k norm + RoPE + K/V write op: each head of q and k RMS-normed by its weights, rotated,
and the row's K and V written into the session's cache, a warp a head of a row. Two builds of
decode.cu: qk_norm_rope_kv (qwen3moe: 128-wide heads, every dim rotated, q in place; _q8: into
q8_0 K/V; _ring: --kv-resident's sinks + ring) and next_qk_norm_rope_kv (qwen3next,
next_attention.cuh: 256-wide heads with 64 rotated dims, q read out of attn_q's [q | gate] rows
into its own buffer).

The decode graph launches them over a step's rows (`graph_qk_norm_rope_kv`,
`graph_next_qk_norm_rope_kv`), a prompt chunk over its rows where the cache is f16
(`prompt_qk_norm_rope_kv`: the chooser; None, the reason logged once, where the kernels cannot
take the chunk, and the backend's array path runs)."""
from __future__ import annotations

import numpy as np

try:
    import cupy as cp
except ImportError:   # the decode graph's launchers need none: backends/graph_ops.py imports
    cp = None         # them where CuPy is not (tests/test_model_interface.py reads its ops)

from ..compute_options import fall_back
from .guards import MAX_GRID_Y, decode_defines, f32_rows, first_failed


def prompt_qk_norm_rope_kv(backend, kernel_shape: str, q, k, v, q_norm, k_norm, eps, session,
                           layer, pos0):
    """The decode step's kernels over the chunk's rows, a warp a head of a row, where the
    cache is f16: decode.cu's qk_norm_rope_kv for 128-wide fully rotated heads (q normalised
    and rotated in place), next_attention.cuh's next_qk_norm_rope_kv for qwen3next's
    256-wide heads with 64 rotated dims, q read out of attn_q's [q | gate] rows; None (the array
    path) where they cannot. `kernel_shape`: decode.cu's build, the decode graph's
    (ComputeOptions.kernel_shape)."""
    from ..kernels.abi import DESC_WORDS, NEXT_HEAD_DIM, NEXT_ROT
    n, n_head, d = (int(v) for v in q.shape)
    n_kv = int(k.shape[1])
    kc, vc = session.k(layer), session.v(layer)
    cos, sin = session.rope_cos, session.rope_sin
    rot = 2 * int(cos.shape[-1])
    full = d == 128 and rot == d and f32_rows(q)
    # q the first half of each head of qg [n, n_head, 2 D] (models/qwen3next.py _attention)
    gated = (d == NEXT_HEAD_DIM and rot == NEXT_ROT and isinstance(q, cp.ndarray)
             and q.dtype == cp.float32 and q.strides == (n_head * 8 * d, 8 * d, 4))
    why = first_failed((
        (full or gated, f"heads {d} wide with {rot} rotated dims, q {q.dtype} strides "
                        f"{q.strides} (the kernels take 128-wide fully rotated float32 rows, "
                        f"or {NEXT_HEAD_DIM}-wide with {NEXT_ROT} rotated in gated rows)"),
        (n <= MAX_GRID_Y, f"{n} rows (a launch takes at most {MAX_GRID_Y})"),
        (all(f32_rows(a) for a in (k, v, q_norm, k_norm, cos, sin)),
         "k, v, the norms or the RoPE tables are not contiguous float32 device rows"),
        (tuple(k.shape) == tuple(v.shape) == (n, n_kv, d),
         f"k {tuple(k.shape)} and v {tuple(v.shape)} are not [{n}, {n_kv}, {d}]"),
        (all(isinstance(c, cp.ndarray) and c.dtype == cp.float16 and c.flags.c_contiguous
             for c in (kc, vc)), f"the session's K/V are kept as "
                                 f"{getattr(kc, 'dtype', type(kc).__name__)} (this prompt "
                                 f"kernel writes contiguous f16 arrays; q8_0 blocks and a ring "
                                 f"store take the array path)")))
    if why:
        fall_back("the fused q/k norm + RoPE + K/V write of a prompt chunk (fused_prompt_ops)",
                  why)
        return None
    from ..kernels import function
    table = backend.upload("rope_ptrs", np.array(
        [kc.data.ptr, vc.data.ptr, cos.data.ptr, sin.data.ptr], dtype=np.uint64))
    desc = np.zeros(DESC_WORDS, dtype=np.int32)
    desc[0], desc[1] = pos0, n
    desc = backend.upload("rope_desc", desc)
    defines = decode_defines(kernel_shape)
    kernel = lambda name: function("decode.cu", name, backend.index, defines)  # noqa: E731
    if full:
        kernel("qk_norm_rope_kv")(
            (n_head + n_kv, n), (32,),
            (q, k, v, q_norm, k_norm, table, np.int32(0), np.int32(1), desc,
             np.int32(n_head), np.int32(n_kv), np.int32(d), np.int32(d), np.float32(eps)))
        return q
    out = backend.buffer("q_rot", (n, n_head, d), cp.float32)
    kernel("next_qk_norm_rope_kv")(
        (n_head + n_kv, n), (32,),
        (q, k, v, q_norm, k_norm, table, np.int32(0), np.int32(1), desc, np.int32(n_head),
         np.int32(n_kv), np.float32(eps), out))
    return out


# ---- the decode graph's -------------------------------------------------------------------------
def graph_qk_norm_rope_kv(graph, j: int, q, k, v, q_norm, k_norm, n: int, eps) -> None:
    """qwen3moe's over a step's n rows: q normed and rotated in place, K/V of layer slot j
    written into each row's session (the graph's pointer table and descriptor)."""
    g, i32 = graph.g, np.int32
    graph._launch("qk_norm_rope_kv" + graph.kv_suffix + graph.ring.suffix)(
        (g.n_head + g.n_head_kv, n), (32,),
        (q, k, v, q_norm, k_norm, graph.sess_table, i32(j), i32(graph.le - graph.lb), graph.desc,
         i32(g.n_head), i32(g.n_head_kv), i32(g.head_dim), i32(g.head_dim), eps))


def graph_next_qk_norm_rope_kv(graph, j: int, qg, k, v, q_norm, k_norm, n: int, eps) -> None:
    """qwen3next's over a step's n rows: q out of qg's [q | gate] heads into the graph's q."""
    g, i32 = graph.g, np.int32
    graph._launch("next_qk_norm_rope_kv" + graph.kv_suffix + graph.ring.suffix)(
        (g.n_head + g.n_head_kv, n), (32,),
        (qg, k, v, q_norm, k_norm, graph.sess_table, i32(j), i32(graph.le - graph.lb),
         graph.desc, i32(g.n_head), i32(g.n_head_kv), eps, graph.q))
