"""The decode graph's layer ops: models/qwen3moe.py's `Qwen3MoeOps` as kernel launches on the
static buffers of a backends/cuda_decode.py DecodeGraph. The graph runs the model module's
`layer_step` with them while it captures a step, so the layer sequence is the model's and the
launches (kernels, grids, blocks, arguments) are these. The arrays an op is given are the graph's
own buffers (its argument tables already point at them); each op returns the buffers the next
one reads. NextDecodeGraph takes `route` and `add_experts` (the same router and expert kernels)."""
from __future__ import annotations

import math

import numpy as np

from ..kernels.abi import BLOCK_THREADS


class GraphLayerOps:
    """The launches of one step of n rows (eps: the model's RMSNorm epsilon as float32)."""

    def __init__(self, graph, n: int, eps):
        self.graph, self.n, self.eps = graph, n, eps

    def _spec(self, layer: int) -> tuple[dict, int]:
        """The layer's launch tables and its slot in the stage (the kernels' layer index)."""
        j = layer - self.graph.lb
        return self.graph.layer_specs[j], j

    def _residual(self, h):
        """The residual rows: always the graph's h (the o, expert and down tables write there)."""
        if h is not self.graph.h:
            raise ValueError("a decode graph's layer ops add into its own residual buffer h, "
                             f"not an array of shape {getattr(h, 'shape', None)}")
        return h

    def norm_qkv(self, layer: int, h):
        gr = self.graph
        L, _ = self._spec(layer)
        gr._matvec(L["qkv"], self._residual(h), gr.g.n_embd, self.n, L["w"].attn_norm, self.eps)
        return gr.q, gr.k, gr.v

    def attention(self, layer: int, q, k, v):
        gr, n, eps = self.graph, self.n, self.eps
        g, f, i32 = gr.g, gr._launch, np.int32
        L, j = self._spec(layer)
        w, nl = L["w"], gr.le - gr.lb
        scale = np.float32(1.0 / math.sqrt(g.head_dim))
        f("qk_norm_rope_kv" + gr.kv_suffix + gr.ring.suffix)(
            (g.n_head + g.n_head_kv, n), (32,),
            (q, k, v, w.q_norm, w.k_norm, gr.sess_table, i32(j), i32(nl), gr.desc,
             i32(g.n_head), i32(g.n_head_kv), i32(g.head_dim), i32(g.head_dim), eps))
        f(gr.attn_kernel)(
            (g.n_head // gr.attn_heads, gr.n_split, n), (BLOCK_THREADS,),
            (q, gr.sess_table, i32(j), gr.desc, i32(g.n_head), i32(g.n_head_kv),
             i32(gr.n_split), i32(gr.attn_chunk), scale, gr.part, gr.ml, gr.attn_done, gr.attn,
             i32(nl)))
        return gr.attn

    def add_out_projection(self, layer: int, attn, h):
        gr = self.graph
        L, _ = self._spec(layer)
        gr._matvec(L["o"], attn, gr.g.n_head * gr.g.head_dim, self.n)
        return self._residual(h)

    def route(self, layer: int, h):
        """The router's matvec over rms_norm(h) (the normed rows left in xn for the experts and a
        shared expert), its last block picking the top-k (ids, weights, blob addresses)."""
        gr = self.graph
        L, _ = self._spec(layer)
        gr._matvec(L["router"], self._residual(h), gr.g.n_embd, self.n, L["ffn_norm"], self.eps,
                   normed=gr.xn, route=L["route"])
        return gr.xn

    def add_experts(self, layer: int, routed, h):
        gr, n = self.graph, self.n
        g, f, shape = gr.g, gr._launch, gr.shape
        L, _ = self._spec(layer)
        gate_up, down = L["expert_types"]
        ff, out = shape.gate_up_block(L["expert_codes"][0]), shape.down_block(L["expert_codes"][1])
        f(f"moe_gate_up_{gate_up}")(((g.n_ff_exp + ff - 1) // ff, g.n_expert_used, n),
                                    (BLOCK_THREADS,), (L["experts"], routed, gr.blobs, gr.act))
        f(f"moe_down_{down}")(((g.n_embd + out - 1) // out, n), (BLOCK_THREADS,),
                              (L["experts"], gr.act, gr.blobs, gr.wts, self._residual(h)))
        return h
