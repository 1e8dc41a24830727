"""What qwen3next's `layer_step` (models/qwen3next.py, where its layer sequence is written once)
calls: the ops protocol `Qwen3NextOps`, one op per fused launch (or few) of the GPU decode graph,
and its eager implementations on the model's backend: `NextEagerOps`, n rows of one session (a
prompt chunk or a decode step; the `out` names are the buffers a prompt chunk writes on a GPU,
`prompt_buffers`), and `NextRowsOps`, a batched decode step (protocol/batch.py: row i is the next
token of sessions[i] at positions[i]). The projections, the shared expert, the router and the
routed experts run over all rows at once; each row's gated attention (q/k norm, RoPE, KV write,
attention) and each row's Gated DeltaNet mixer (its conv and recurrent state) run alone, as its
one-row step runs them, so each row gets the bits it gets alone. The decode graph's
implementation is backends/graph_ops.py `NextGraphOps`."""
from __future__ import annotations

from typing import Any, Protocol


class Qwen3NextOps(Protocol):
    """`layer` is the global ordinal; arrays are [n, width] rows (a graph passes its buffers)."""

    def norm_mix_in(self, layer: int, h: Any) -> tuple[Any, Any, Any]:
        """A linear layer's qkv, z (attn_gate) and ba of RMSNorm(h) * attn_norm (one matvec
        launch a weight type, the norm fused)."""

    def gated_delta(self, layer: int, qkv: Any, z: Any, ba: Any) -> Any:
        """The causal conv, the gated delta rule on the session's state (both updated in place)
        and the gated RMSNorm -> [n, value_dim] (gdn_conv_step, gdn_delta_step)."""

    def add_mix_out(self, layer: int, o: Any, h: Any) -> Any:
        """h + ssm_out . o."""

    def norm_qkv(self, layer: int, h: Any) -> tuple[Any, Any, Any]:
        """An attention layer's q with its output gates, k and v of RMSNorm(h) * attn_norm."""

    def attention(self, layer: int, qg: Any, k: Any, v: Any) -> Any:
        """q and k RMSNormed per head and rotated, k and v written into the session, causal
        attention, times the sigmoid of the gates -> [n, n_head * head_dim]."""

    def add_out_projection(self, layer: int, attn: Any, h: Any) -> Any:
        """h + attn_output . attn."""

    def route(self, layer: int, h: Any) -> Any:
        """RMSNorm(h) * post_attention_norm through the router and its top-k; what `add_moe`
        reads."""

    def add_moe(self, layer: int, routed: Any, h: Any) -> Any:
        """h + the routed experts in rank order + the shared expert times its sigmoid gate."""


class NextEagerOps:
    """Qwen3NextOps on the backend for n rows of one session at positions pos0.."""

    def __init__(self, model, session, pos0: int):
        self.model, self.g, self.be = model, model.g, model.backend
        self.session, self.pos0 = session, pos0

    def norm_mix_in(self, layer, h):
        w, be = self.model.layers[layer], self.be
        x = be.rms_norm(h, w["attn_norm"], self.g.rms_eps, out="lx")
        qkv, z = self.model._qkvz(w, x)
        return qkv, z, be.linear(x, w["ssm_ba"], out="ba")

    def gated_delta(self, layer, qkv, z, ba):
        g, s = self.g, self.session
        o = self.model.arch.gdn_mixer(self.be, g, self.model.layers[layer], qkv, z, ba,
                                      s.conv_state(layer), s.recurrent_state(layer))
        return o.reshape(qkv.shape[0], g.value_dim)

    def add_mix_out(self, layer, o, h):
        be = self.be
        return be.add(h, be.linear(o, self.model.layers[layer]["ssm_out"], out="lo"),
                      out="h_mid")

    def norm_qkv(self, layer, h):
        x = self.be.rms_norm(h, self.model.layers[layer]["attn_norm"], self.g.rms_eps, out="x")
        return self.model._attention_qkv(layer, x)

    def attention(self, layer, qg, k, v):
        return self.model._gated_attention(layer, qg, k, v, self.session, self.pos0)

    def add_out_projection(self, layer, attn, h):
        be = self.be
        return be.add(h, be.linear(attn, self.model.layers[layer]["attn_output"], out="o"),
                      out="h_mid")

    def route(self, layer, h):
        w = self.model.layers[layer]
        x = self.be.rms_norm(h, w["post_attention_norm"], self.g.rms_eps, out="moe_x")
        router = w[self.model.arch.ROUTER_PART]
        return (x, *self.model._route(layer, x, router, self.g.norm_topk_prob))

    def add_moe(self, layer, routed, h):
        return self.be.add(h, self.model._moe_after_route(layer, *routed), out="h")


class NextRowsOps:
    """Qwen3NextOps for a batched decode step: each row's mixer over its own session."""

    def __init__(self, model, sessions: list, positions: list[int]):
        self.model, self.g, self.be = model, model.g, model.backend
        self.sessions, self.positions = sessions, positions

    def norm_mix_in(self, layer, h):
        w, be = self.model.layers[layer], self.be
        x = be.rms_norm(h, w["attn_norm"], self.g.rms_eps)
        qkv, z = self.model._qkvz(w, x)
        return qkv, z, be.linear(x, w["ssm_ba"])

    def gated_delta(self, layer, qkv, z, ba):
        g, be, w = self.g, self.be, self.model.layers[layer]
        gdn_mixer = self.model.arch.gdn_mixer
        return be.xp.concatenate([
            gdn_mixer(be, g, w, qkv[i:i + 1], z[i:i + 1], ba[i:i + 1], s.conv_state(layer),
                      s.recurrent_state(layer)).reshape(1, g.value_dim)
            for i, s in enumerate(self.sessions)])

    def add_mix_out(self, layer, o, h):
        return self.be.add(h, self.be.linear(o, self.model.layers[layer]["ssm_out"]))

    def norm_qkv(self, layer, h):
        g, w, be = self.g, self.model.layers[layer], self.be
        x = be.rms_norm(h, w["attn_norm"], g.rms_eps)
        n, hd = x.shape[0], g.head_dim
        qg = be.linear(x, w["attn_q"]).reshape(n, g.n_head, 2 * hd)
        gate = be.xp.ascontiguousarray(qg[..., hd:])
        k = be.linear(x, w["attn_k"]).reshape(n, g.n_head_kv, hd)
        v = be.linear(x, w["attn_v"]).reshape(n, g.n_head_kv, hd)
        return (qg, gate), k, v

    def attention(self, layer, qg, k, v):
        g, w, be = self.g, self.model.layers[layer], self.be
        qg, gate = qg
        n, hd = qg.shape[0], g.head_dim
        rows = []
        for i, (s, pos) in enumerate(zip(self.sessions, self.positions)):
            # q a view of the row's [q | gate] heads, as the one-row step hands it (a GPU's fused
            # kernel reads it there)
            q = be.qk_norm_rope_kv(qg[i:i + 1, :, :hd], k[i:i + 1], v[i:i + 1],
                                   w["attn_q_norm"], w["attn_k_norm"], g.rms_eps, s, layer, pos)
            rows.append(be.attend(q, s.k(layer)[:pos + 1], s.v(layer)[:pos + 1], pos, s))
        attn = be.xp.concatenate(rows).reshape(n, g.n_head * hd)
        return be.mul(attn, be.sigmoid(gate.reshape(n, g.n_head * hd)))

    def add_out_projection(self, layer, attn, h):
        return self.be.add(h, self.be.linear(attn, self.model.layers[layer]["attn_output"]))

    def route(self, layer, h):
        w = self.model.layers[layer]
        x = self.be.rms_norm(h, w["post_attention_norm"], self.g.rms_eps)
        router = w[self.model.arch.ROUTER_PART]
        return (x, *self.model._route(layer, x, router, self.g.norm_topk_prob))

    def add_moe(self, layer, routed, h):
        return self.be.add(h, self.model._moe_after_route(layer, *routed))
