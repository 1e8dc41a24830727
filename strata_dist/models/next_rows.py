"""qwen3next's batched decode step (protocol/batch.py): row i of h is the next token of sessions[i]
at positions[i]. The projections, the shared expert, the router and the routed experts run over
all rows at once; each row's gated attention (q/k norm, RoPE, KV write, attention) and each row's
Gated DeltaNet mixer (its conv and recurrent state) run alone, as its one-row step runs them
(`Qwen3Next.forward_layers`), so each row gets the bits it gets alone."""
from __future__ import annotations


def forward_rows(model, h, sessions: list, positions: list[int]):
    be, g = model.backend, model.g
    gdn_mixer = model.arch.gdn_mixer      # the architecture's module (models/qwen3next.py)
    for s, pos in zip(sessions, positions):
        if pos + 1 > s.max_cells:
            raise ValueError(f"context full: {pos} + 1 tokens > {s.max_cells} cells")
    for layer in range(model.lb, model.le):
        w = model.layers[layer]
        x = be.rms_norm(h, w["attn_norm"], g.rms_eps)
        if g.is_linear(layer):
            qkv, z = model._qkvz(w, x)
            ba = be.linear(x, w["ssm_ba"])
            o = be.xp.concatenate([
                gdn_mixer(be, g, w, qkv[i:i + 1], z[i:i + 1], ba[i:i + 1], s.conv_state(layer),
                          s.recurrent_state(layer)).reshape(1, g.value_dim)
                for i, s in enumerate(sessions)])
            mixed = be.linear(o, w["ssm_out"])
        else:
            mixed = _attention_rows(model, layer, x, sessions, positions)
        h = be.add(h, mixed)
        x = be.rms_norm(h, w["post_attention_norm"], g.rms_eps)
        h = be.add(h, model._moe(layer, x))
    return h


def _attention_rows(model, layer, x, sessions, positions):
    """`Qwen3Next._attention` with each row's own session and position."""
    g, w, be = model.g, model.layers[layer], model.backend
    n, hd = x.shape[0], g.head_dim
    qg = be.linear(x, w["attn_q"]).reshape(n, g.n_head, 2 * hd)
    gate = be.xp.ascontiguousarray(qg[..., hd:])
    k = be.linear(x, w["attn_k"]).reshape(n, g.n_head_kv, hd)
    v = be.linear(x, w["attn_v"]).reshape(n, g.n_head_kv, hd)
    rows = []
    for i, (s, pos) in enumerate(zip(sessions, positions)):
        # q a view of the row's [q | gate] heads, as the one-row step hands it (a GPU's fused
        # kernel reads it there)
        q = be.qk_norm_rope_kv(qg[i:i + 1, :, :hd], k[i:i + 1], v[i:i + 1], w["attn_q_norm"], w["attn_k_norm"],
                               g.rms_eps, s, layer, pos)
        rows.append(be.attend(q, s.k(layer)[:pos + 1], s.v(layer)[:pos + 1], pos, s))
    attn = be.xp.concatenate(rows).reshape(n, g.n_head * hd)
    out = be.mul(attn, be.sigmoid(gate.reshape(n, g.n_head * hd)))
    return be.linear(out, w["attn_output"])
