"""The attention op: a prompt chunk's (one flash-attention launch, kernels/prefill_attention.cu)
and a decode step's (attn_decode_<D>_g<heads>[_q8][_ring], kernels/attention.cuh and
next_attention.cuh: a context's splits over blocks, the last block of a row's head group
combining the partials), and qwen3next's output gate (next_attn_gate).

The choosers: `FlashPrompt.run` takes a chunk where the build reads its heads and K/V (else None,
the reason logged once, and the backend's array attention runs); `decode_launch` picks the
decode kernel, its splits and query heads a block by the geometry and the context (kernels/abi.py
attn_launch), Unsupported where even the longest splits' partials do not fit (the stage's steps
take the general path)."""
from __future__ import annotations

import math

import numpy as np

try:
    import cupy as cp
except ImportError:   # the decode graph's launchers need none: backends/graph_ops.py imports
    cp = None         # them where CuPy is not (tests/test_model_interface.py reads its ops)

from ..compute_options import fall_back
from ..kernels.abi import BLOCK_THREADS, AttnLaunch, AttnScratchError, attn_launch
from .expert_addresses import Unsupported
from .guards import first_failed


class FlashPrompt:
    """A prompt chunk's attention as one flash-attention launch on tensor cores
    (ComputeOptions.flash_prefill; the backend asks only when it is on): f16 K/V of 128-wide
    (qwen3moe) or 256-wide (qwen3next) heads."""

    def __init__(self, device: int):
        self.device = device
        self._kernels = {}    # head width -> the kernel, allowed its shared memory once

    def run(self, backend, q, k, v, pos0, out=None):
        """Attention of q [n, n_head, d] at positions pos0.. over K/V [cells, n_kv, d] into the
        backend's buffer `out`; None (the reason logged once) where the build cannot take it."""
        from ..kernels.abi import PREFILL_ATTENTION_BUILDS, prefill_attention_launch
        why = first_failed((
            (int(q.shape[-1]) in PREFILL_ATTENTION_BUILDS,
             f"heads {int(q.shape[-1])} wide (built for {sorted(PREFILL_ATTENTION_BUILDS)})"),
            (k.dtype == cp.float16 and v.dtype == cp.float16,
             f"K/V arrays of {k.dtype} (the kernel reads f16)"),
            (k.flags.c_contiguous and v.flags.c_contiguous, "K/V not contiguous"),
            (not q.shape[1] % k.shape[1],
             f"{q.shape[1]} query heads over {k.shape[1]} kv heads")))
        if why:
            fall_back("the flash attention of a prompt chunk (flash_prefill)", why)
            return None
        from ..kernels import function
        n, n_head, d = (int(x) for x in q.shape)
        q = cp.ascontiguousarray(q, dtype=cp.float32)
        out = backend.buffer(out, (n, n_head, d), cp.float32)
        rows, threads, shared = prefill_attention_launch(d)
        fn = self._kernels.get(d)
        if fn is None:                                 # past the default 48 KiB of shared memory
            fn = function("prefill_attention.cu", f"prefill_attention_{d}", self.device)
            fn.max_dynamic_shared_size_bytes = shared
            self._kernels[d] = fn
        fn((n_head, (n + rows - 1) // rows), (threads,),
           (q, k, v, np.int32(n), np.int32(pos0), np.int32(n_head), np.int32(k.shape[1]),
            np.float32(1.0 / np.sqrt(d)), out), shared_mem=shared)
        return out


# ---- the decode graph's attention ---------------------------------------------------------------
def decode_launch(g, max_cells: int, kv_type: str, attn_heads: int | None) -> AttnLaunch:
    """The decode attention's kernel, splits and query heads a block for sessions of `max_cells`
    cells (`attn_heads`: None or 0 by the geometry); Unsupported when the partials of a row do
    not fit the scratch budget."""
    try:
        return attn_launch(g.n_head, g.n_head_kv, g.head_dim, max_cells, kv_type, attn_heads)
    except AttnScratchError as e:
        raise Unsupported(str(e)) from None


def graph_attend(graph, j: int, q, n: int) -> None:
    """The decode attention of n rows' q over layer slot j's K/V into the graph's attn (its
    partials in part and ml, attn_done counting each head group's finished splits)."""
    i32 = np.int32
    g = graph.g
    graph._launch(graph.attn_kernel)(
        (g.n_head // graph.attn_heads, graph.n_split, n), (BLOCK_THREADS,),
        (q, graph.sess_table, i32(j), graph.desc, i32(g.n_head), i32(g.n_head_kv),
         i32(graph.n_split), i32(graph.attn_chunk), np.float32(1.0 / math.sqrt(g.head_dim)),
         graph.part, graph.ml, graph.attn_done, graph.attn, i32(graph.le - graph.lb)))


def graph_attn_gate(graph, qg, n: int) -> None:
    """qwen3next's gate: the graph's attn rows times the sigmoid of qg's gate halves, in place."""
    g = graph.g
    q_width = g.n_head * g.head_dim
    graph._launch("next_attn_gate")((-(-q_width // BLOCK_THREADS), n), (BLOCK_THREADS,),
                                    (graph.attn, qg, np.int32(g.n_head)))
