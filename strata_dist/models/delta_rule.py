"""The gated delta rule of Gated DeltaNet layers (qwen3next's linear attention), token by token
(the reference, exact on numpy) and in blocks (what a GPU runs for prompt chunks)."""
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
