"""The operations a layer is written in, as one typed interface.

`NumpyBackend` (the float32 reference) and `CupyBackend` implement them (`Backend` holds the
shared array arithmetic of backends/array_ops.py; a backend overrides what it does its own way:
numpy's per-row SwiGLU, CuPy's prompt attention kernel and row kernels). The architectures in
strata_dist/models/ call these for everything two architectures share; what only one of them
does (qwen3next's short convolution and gated delta rule) stays in its module, on `backend.xp`.

`out` names the buffer of a prompt chunk's fixed layout the result goes to on a GPU
(plan/workspace.py, the architecture's `prompt_buffers`); a backend without a workspace, and the
numpy reference always, makes a new array instead."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class LayerOps(Protocol):
    def rows(self, table, ids, out=None):
        """float32 rows `ids` of an embedding table (the first stage's embedding)."""

    def linear(self, x, w, out=None):
        """x [n, in] float32 @ w[out, in].T -> [n, out] float32."""

    def rms_norm(self, x, w, eps: float, out=None):
        """RMSNorm over the last axis, times w."""

    def add(self, a, b, out=None):
        """a + b (the residual stream)."""

    def mul(self, a, b, out=None):
        """a * b, broadcast."""

    def rope(self, x, cos, sin):
        """NEOX RoPE on x [n, H, D] over the first 2 * cos.shape[-1] dims (partial rotary)."""

    def qk_norm_rope_kv(self, q, k, v, q_norm, k_norm, eps: float, session, layer: int,
                        pos0: int):
        """q and k RMSNormed per head and rotated at positions pos0.., k and v written into the
        session's cache of `layer`; returns q."""

    def attend(self, q, k, v, pos0: int, session, out=None):
        """Causal grouped-query attention of q [n, H, D] at positions pos0.. over k, v
        [pos0 + n, KVH, D] -> [n, H, D] float32."""

    def route(self, x, router, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
        """The top-k experts of each row in rank order and their weights (host arrays)."""

    def combine_ranked(self, y, wts):
        """sum over r of wts[:, r] * y[:, r] (y [n, k, d], wts [n, k]) in rank order."""

    def swiglu(self, x, gate, up, down):
        """down @ (silu(gate @ x) * (up @ x)) for each row of x (dense weights)."""

    def sigmoid(self, x, out=None):
        ...

    def silu(self, x, out=None):
        ...


__all__ = ["LayerOps"]
