"""The gated delta rule of Gated DeltaNet layers (qwen3next's linear attention), token by token
(the reference, exact on numpy) and in blocks (what a GPU runs for prompt chunks), and the whole
mixer of a linear layer around it (`gdn_mixer`: qwen3next.py imports it as its own)."""
from __future__ import annotations

import numpy as np


def gated_delta_steps(q, k, v, beta, decay, state, xp):
    """The gated delta rule, one token at a time (the reference): for each token t,
    S <- exp(decay_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t.
    q, k [n, H, dk]; v [n, H, dv]; beta, decay [n, H]; state [H, dk, dv] updated in place."""
    n, nv, hv = v.shape
    gexp = xp.exp(decay)
    out = xp.empty((n, nv, hv), dtype=np.float32)
    s = state
    for t in range(n):
        s = s * gexp[t][:, None, None]
        kt = k[t][:, :, None]                                          # [H, dk, 1]
        kv_mem = (s * kt).sum(axis=1)                                  # [H, dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        s = s + kt * delta[:, None, :]
        out[t] = (s * q[t][:, :, None]).sum(axis=1)
    state[...] = s
    return out


DELTA_BLOCK = 64


def gated_delta_chunked(q, k, v, beta, decay, state, xp, block: int = DELTA_BLOCK):
    """The same recurrence as gated_delta_steps, a block of tokens at a time. Within a block with
    cumulative log-decay G and D[t, i] = exp(G_t - G_i) (i <= t), the updates U solve
    (I + beta * strict(D) * K K^T) U = beta * (V - exp(G) * K S0); then
    O = exp(G) * Q S0 + (D * Q K^T) U and S = exp(G_last) S0 + K^T (exp(G_last - G) * U).
    Equal to the token loop up to float rounding; a handful of batched matmuls and one batched
    solve per block instead of a dozen launches per token."""
    n, nv, hv = v.shape
    out = xp.empty((n, nv, hv), dtype=np.float32)
    s = state.astype(np.float32)
    for start in range(0, n, block):
        sl = slice(start, min(n, start + block))
        qb, kb = q[sl].transpose(1, 0, 2), k[sl].transpose(1, 0, 2)    # [H, C, dk]
        vb = v[sl].transpose(1, 0, 2)                                  # [H, C, dv]
        bb, gb = beta[sl].T, decay[sl].T                               # [H, C]
        c = vb.shape[1]
        G = xp.cumsum(gb, axis=1)
        diff = G[:, :, None] - G[:, None, :]                           # G_t - G_i
        tri = xp.tril(xp.ones((c, c), dtype=bool))
        strict = xp.tril(xp.ones((c, c), dtype=bool), -1)
        D = xp.exp(xp.where(tri, diff, np.float32(-np.inf)))           # 0 above the diagonal
        kk = kb @ kb.transpose(0, 2, 1)
        A = bb[:, :, None] * xp.where(strict, D, np.float32(0.0)) * kk
        rhs = bb[:, :, None] * (vb - xp.exp(G)[:, :, None] * (kb @ s))
        U = xp.linalg.solve(A + xp.eye(c, dtype=np.float32), rhs)      # unit lower triangular
        o = xp.exp(G)[:, :, None] * (qb @ s) + (D * (qb @ kb.transpose(0, 2, 1))) @ U
        out[sl] = o.transpose(1, 0, 2)
        g_last = G[:, -1]
        s = (xp.exp(g_last)[:, None, None] * s
             + kb.transpose(0, 2, 1) @ (xp.exp(g_last[:, None] - G)[:, :, None] * U))
    state[...] = s
    return out


L2_EPS = 1e-6       # of the q/k L2 norm (the reference's l2norm, fixed, not the RMS epsilon)


def _softplus(x, xp):
    return xp.logaddexp(np.float32(0.0), x)


def gdn_mixer(be, g, w: dict, qkv, z, ba, conv, state):
    """A linear layer (g: its NextGeometry, models/qwen3next.py) between its input projections
    (qkv [n, conv_dim], z [n, value_dim], ba [n, n_k * 2r]) and ssm_out: the causal conv over
    `conv` [K-1, conv_dim] and the gated delta rule on `state` [n_v, head_k, head_v] (both
    updated in place), then the gated RMSNorm.
    Returns [n, n_v, head_v]. The GPU's gdn_conv_step / gdn_delta_step (kernels/gated_delta.cuh)
    are tested against this; on a GPU they also read prompt chunks (`Backend.linear_attention`),
    row by row in this token loop's arithmetic."""
    fast = be.linear_attention(g, w, qkv, z, ba, conv, state)
    if fast is not None:
        return fast
    xp = be.xp
    n = qkv.shape[0]
    nk, nv, hk, hv = g.n_k_heads, g.n_v_heads, g.head_k_dim, g.head_v_dim
    r = nv // nk
    ba = ba.reshape(n, nk, 2 * r)                                      # per key head: r b, r a
    b, a = ba[..., :r].reshape(n, nv), ba[..., r:].reshape(n, nv)
    beta = be.sigmoid(b)
    decay = w["ssm_a"] * _softplus(a + w["ssm_dt"], xp)                # [n, nv], <= 0

    # causal depthwise conv over [conv state | this chunk], then SiLU
    kern = w["ssm_conv1d"]                                             # [conv_dim, K]
    K = g.ssm_conv_kernel
    xpad = xp.concatenate([conv, qkv], axis=0)                         # [K-1+n, conv_dim]
    acc = xpad[0:n] * kern[:, 0]
    for j in range(1, K):
        acc = acc + xpad[j:j + n] * kern[:, j]
    conv[...] = xpad[n:]                                               # the last K-1 inputs
    mixed = be.silu(acc)

    q = mixed[:, :g.key_dim].reshape(n, nk, hk)
    k = mixed[:, g.key_dim:2 * g.key_dim].reshape(n, nk, hk)
    v = mixed[:, 2 * g.key_dim:].reshape(n, nv, hv)
    q = q / xp.sqrt((q * q).sum(axis=-1, keepdims=True) + np.float32(L2_EPS))
    k = k / xp.sqrt((k * k).sum(axis=-1, keepdims=True) + np.float32(L2_EPS))
    q = q * np.float32(1.0 / np.sqrt(hk))
    if r > 1:  # value head h reads key head h // r
        q, k = xp.repeat(q, r, axis=1), xp.repeat(k, r, axis=1)       # [n, nv, hk]

    # numpy reads token by token (exact); a GPU reads a prompt chunk in blocks (few launches)
    if xp is np or n == 1:
        out = gated_delta_steps(q, k, v, beta, decay, state, xp)
    else:
        out = gated_delta_chunked(q, k, v, beta, decay, state, xp)
    return be.rms_norm(out, w["ssm_norm"], g.rms_eps) * be.silu(z.reshape(n, nv, hv))
