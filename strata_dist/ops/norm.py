"""The RMSNorm op over a prompt chunk's rows: one launch (prompt_ops.cu rms_norm_rows), a block a
row. The decode graph has no launch of its own for it: its RMSNorms are fused into the matvec
that reads the normed rows (ops/linear.py graph_matvec's norm_w)."""
from __future__ import annotations

import cupy as cp
import numpy as np

from ..compute_options import fall_back
from .guards import OPS_THREADS, f32_rows, first_failed


def prompt_rms_norm(backend, x, w, eps, out=None):
    """rms_norm(x) * w over x's last axis into the backend's buffer `out`; None (the reason
    logged once) where the kernel does not read these arrays (contiguous float32 rows, w of the
    rows' width): the array path's then."""
    d = int(x.shape[-1])
    why = first_failed((
        (f32_rows(x) and f32_rows(w), "rows or weights not contiguous float32 device arrays"),
        (w.shape == (d,), f"weights of shape {tuple(w.shape)} for rows of {d}")))
    if why:
        fall_back("the fused RMSNorm of a prompt chunk (fused_prompt_ops)", why)
        return None
    from ..kernels import function
    out = backend.buffer(out, x.shape, cp.float32)
    rows = int(x.size) // d
    if rows:
        function("prompt_ops.cu", "rms_norm_rows", backend.index)(
            (rows,), (OPS_THREADS,), (x, w, np.int32(d), np.float32(eps), out))
    return out
