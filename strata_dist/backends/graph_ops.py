"""The decode graph's layer ops: models/qwen3moe.py's `Qwen3MoeOps` as kernel launches on the
static buffers of a backends/cuda_decode.py DecodeGraph. The graph runs the model module's
`layer_step` with them while it captures a step, so the layer sequence is the model's and the
launches (kernels, grids, blocks, arguments) are these. The arrays an op is given are the graph's
own buffers (its argument tables already point at them); each op returns the buffers the next
one reads. `NextGraphOps` (models/next_ops.py's Qwen3NextOps, for backends/next_decode.py
NextDecodeGraph) extends them: the same router, routed experts, o-projection and decode
attention. Each op's launches are its module's in strata_dist/ops/ (moe, attention,
norm_rope_kv, route, gdn; the matvecs through the graph's `_matvec`, ops/linear.py); this file
says which op of the model's protocol each is. No CuPy here: the launches go through the graph's
`_launch`."""
from __future__ import annotations

from ..ops.attention import graph_attend, graph_attn_gate
from ..ops.gdn import launch_gdn
from ..ops.moe import graph_experts, graph_shared_expert
from ..ops.norm_rope_kv import graph_next_qk_norm_rope_kv, graph_qk_norm_rope_kv
from ..ops.route import graph_route


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
        L, j = self._spec(layer)
        w = L["w"]
        graph_qk_norm_rope_kv(self.graph, j, q, k, v, w.q_norm, w.k_norm, self.n, self.eps)
        self._attend(j, q)
        return self.graph.attn

    def _attend(self, j: int, q) -> None:
        """The decode attention of the rows' q over layer slot j's K/V into the graph's attn."""
        graph_attend(self.graph, j, q, self.n)

    def add_out_projection(self, layer: int, attn, h):
        gr = self.graph
        L, _ = self._spec(layer)
        gr._matvec(L["o"], attn, gr.g.n_head * gr.g.head_dim, self.n)
        return self._residual(h)

    def route(self, layer: int, h):
        """The router's matvec over rms_norm(h) (the normed rows left in xn for the experts and a
        shared expert), its last block picking the top-k (ids, weights, blob addresses)."""
        L, _ = self._spec(layer)
        graph_route(self.graph, L, self._residual(h), self.n, self.eps)
        return self.graph.xn

    def add_experts(self, layer: int, routed, h):
        L, _ = self._spec(layer)
        graph_experts(self.graph, L, routed, self._residual(h), self.n)
        return h


class NextGraphOps(GraphLayerOps):
    """models/next_ops.py's Qwen3NextOps as the decode graph's launches (the router, the routed
    experts and the o-projection are qwen3moe's, GraphLayerOps')."""

    def norm_mix_in(self, layer: int, h):
        gr = self.graph
        L, _ = self._spec(layer)
        gr._matvec(L["mix_in"], self._residual(h), gr.g.n_embd, self.n, L["attn_norm"], self.eps)
        return gr.qkv, gr.z, gr.ba

    def gated_delta(self, layer: int, qkv, z, ba):
        """gdn_conv_step and gdn_delta_step (their GdnSpec table names qkv, z, ba and the
        output)."""
        gr = self.graph
        L, _ = self._spec(layer)
        launch_gdn(gr._launch, L["gdn"], self.n, gr.gdn)
        return gr.gdn_out

    def add_mix_out(self, layer: int, o, h):
        gr = self.graph
        L, _ = self._spec(layer)
        gr._matvec(L["mix_out"], o, gr.g.value_dim, self.n)
        return self._residual(h)

    def norm_qkv(self, layer: int, h):
        gr = self.graph
        L, _ = self._spec(layer)
        gr._matvec(L["qkv"], self._residual(h), gr.g.n_embd, self.n, L["attn_norm"], self.eps)
        return gr.qg, gr.k, gr.v

    def attention(self, layer: int, qg, k, v):
        """next_qk_norm_rope_kv (q out of qg into the graph's q), the decode attention, then
        next_attn_gate (the rows times the sigmoid of qg's gates)."""
        gr, n = self.graph, self.n
        L, j = self._spec(layer)
        graph_next_qk_norm_rope_kv(gr, j, qg, k, v, L["q_norm"], L["k_norm"], n, self.eps)
        self._attend(j, gr.q)
        graph_attn_gate(gr, qg, n)
        return gr.attn

    def add_moe(self, layer: int, routed, h):
        """The routed experts, then the shared expert over the rows the router's matvec normed
        (`routed`: xn): its gate, up and logit in one matvec launch a type, next_shexp_act, and
        ffn_down_shexp adding into the residual."""
        L, _ = self._spec(layer)
        h = self.add_experts(layer, routed, h)
        graph_shared_expert(self.graph, L, routed, self.n)
        return h
