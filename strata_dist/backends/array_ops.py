"""The array arithmetic of the layer operations (backends/ops.py), written once for numpy and
CuPy (`xp`): RMSNorm, NEOX RoPE (full or partial), causal grouped-query attention with the
session's decode score scratch, softmax top-k routing and the rank-ordered MoE combine (the
experts' outputs come from the model's expert store: models/common.py `_combine_routed`).
`Backend` exposes them as methods; the models call those."""
from __future__ import annotations

import numpy as np

from ..plan.pricing import ATTN_TILE_BYTES, DECODE_ROWS


def rms_norm(x, w, eps, xp):
    var = (x * x).mean(axis=-1, keepdims=True)
    return x / xp.sqrt(var + eps) * w


def apply_rope(x, cos, sin, xp):
    """NEOX RoPE on x [n, H, D]: the first 2*cos.shape[-1] dims are rotated as two halves, the rest
    pass through (partial rotary)."""
    half = cos.shape[-1]
    rot = 2 * half
    x1, x2 = x[..., :half], x[..., half:rot]
    c, s = cos[:, None, :], sin[:, None, :]
    parts = [x1 * c - x2 * s, x2 * c + x1 * s]
    if rot < x.shape[-1]:
        parts.append(x[..., rot:])
    return xp.concatenate(parts, axis=-1)


def causal_attention(q, k, v, pos0, xp, session):
    """q [n, H, D]; k/v [t, KVH, D] with t = pos0 + n; causal; returns [n, H, D].

    Decode-sized batches (n <= DECODE_ROWS) write their scores into the session's scratch. A
    prompt chunk is read in tiles of query rows whose scores take at most ATTN_TILE_BYTES (the
    planner's work reserve, not a buffer per token of context), each against only the keys its
    rows can see."""
    n, n_head, d = q.shape
    if xp is np and 1 < n <= DECODE_ROWS:
        # A verify window (strata_dist/sampling/speculative.py) on the host: each row exactly as the
        # decode step at its position computes it, over only the keys it sees (a longer row of
        # masked scores sums in another order), so speculation never changes a greedy token.
        return xp.concatenate([causal_attention(q[i:i + 1], k[:pos0 + i + 1], v[:pos0 + i + 1],
                                                pos0 + i, xp, session) for i in range(n)])
    t, n_kv, _ = k.shape
    group = n_head // n_kv
    qg = q.reshape(n, n_kv, group, d).transpose(1, 2, 0, 3)          # [KVH, G, n, D]
    kt = k.transpose(1, 2, 0)[:, None]                                 # [KVH, 1, D, t]
    vt = v.transpose(1, 0, 2)[:, None]                                 # [KVH, 1, t, D]
    if n <= DECODE_ROWS:
        out = _attend(qg, kt, vt, pos0, xp, session.score_buffer((n_kv, group, n, t)))
    else:
        rows = max(1, ATTN_TILE_BYTES // (n_head * t * 4))
        out = xp.empty((n_kv, group, n, d), dtype=np.float32)
        for i in range(0, n, rows):
            j = min(n, i + rows)
            seen = pos0 + j                      # keys after the tile's last row are masked anyway
            out[:, :, i:j] = _attend(qg[:, :, i:j], kt[..., :seen], vt[:, :, :seen], pos0 + i, xp)
    return out.transpose(2, 0, 1, 3).reshape(n, n_head, d)


def _attend(qg, kt, vt, q0, xp, out_buf=None):
    """Softmax attention of query rows at positions q0.. over keys 0..t-1 (causal mask)."""
    nq, t = qg.shape[2], kt.shape[-1]
    scores = xp.matmul(qg, kt, out=out_buf) if out_buf is not None else qg @ kt
    scores *= np.float32(1.0 / np.sqrt(qg.shape[-1]))                 # [KVH, G, nq, t]
    qpos = xp.arange(q0, q0 + nq)[:, None]
    kpos = xp.arange(t)[None, :]
    scores += xp.where(kpos <= qpos, np.float32(0), np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    xp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores @ vt                                                 # [KVH, G, nq, D]


def _topk_stable(probs: np.ndarray, k: int) -> np.ndarray:
    """np.argsort(-probs, kind="stable")[:, :k] without sorting whole rows (a prompt chunk routes
    thousands of rows a layer, and the full sort was most of a prompt's host time,
    docs/BENCHMARKS.md): k rounds of a row-wise argmax, each taking the largest value left (the
    lowest index among equals, as the stable sort does) and striking it out."""
    n = probs.shape[0]
    if k >= probs.shape[1] or n == 0 or np.isnan(probs).any():   # NaN sorts last: the full sort
        return np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    left = probs.copy()
    idx = np.empty((n, k), dtype=np.int64)
    rows = np.arange(n)
    for r in range(k):
        idx[:, r] = left.argmax(axis=-1)
        left[rows, idx[:, r]] = -np.inf              # probabilities are >= 0
    return idx


def softmax_topk(logits: np.ndarray, k: int, normalize: bool = True):
    """Top-k experts per row in rank order (stable on ties) and their softmax weights, renormalised
    over the k when `normalize` (host arrays: [n, k] int64, [n, k] float32)."""
    logits = np.asarray(logits, dtype=np.float32)
    logits = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    idx = _topk_stable(probs, k)
    wts = np.take_along_axis(probs, idx, axis=-1)
    if normalize:
        wts = wts / wts.sum(axis=-1, keepdims=True)
    return idx, wts.astype(np.float32)


def combine_ranked(y, wts, xp):
    """sum over r of wts[:, r] * y[:, r] for y [n, k, d], wts [n, k], added in rank order r."""
    out = xp.zeros((y.shape[0], y.shape[2]), dtype=np.float32)
    for r in range(y.shape[1]):
        out += wts[:, r:r + 1] * y[:, r]
    return out
