"""Weights kept on the device in their stored blocks (backends/layout.py GPU_NATIVE_QUANTS):
decoded to float32 by the same code the decode kernels read them with (kernels/weights.cuh).
Shared by the general path (cupy_backend.py) and the decode graph (cuda_decode.py)."""
from __future__ import annotations

import cupy as cp
import numpy as np

from ..kernels import function as kernel


def dequantize_rows(raw, ggml_type: int, row_bytes: int, n_rows: int, n_cols: int, rows=None,
                    dtype=cp.float32, out=None):
    """float32 (or, with dtype float16, rounded to f16) [n_rows, n_cols] from rows of `row_bytes`
    stored in a native quant type (all rows, or the row indices `rows`, a device int32 array),
    decoded by the same code the decode kernels read weights with (into `out` when given)."""
    half = np.dtype(dtype) == np.float16
    if out is None:
        out = cp.empty((n_rows, n_cols), dtype=cp.float16 if half else cp.float32)
    chunks = n_rows * (n_cols // 8)                 # one thread per 8 columns
    kernel("decode.cu", "dequant_rows_f16" if half else "dequant_rows")(
        (min((chunks + 255) // 256, 65535),), (256,),
        (raw, np.int32(ggml_type), np.int64(row_bytes), np.int32(n_cols),
         rows if rows is not None else np.uint64(0), np.int32(n_rows),
         out))
    return out


class QuantMatrix:
    """A matrix kept on the device in its stored block type (GPU_NATIVE_QUANTS); decoded
    exactly to float32 where the general path uses it, read as stored by the decode kernels."""

    def __init__(self, raw, shape, ggml_type: int):
        self.raw, self.shape, self.ggml_type = raw, tuple(shape), int(ggml_type)
        self.nbytes = int(raw.nbytes)
        self.row_bytes = self.nbytes // self.shape[0]

    def dequantize(self, dtype=cp.float32, out=None):
        return dequantize_rows(self.raw, self.ggml_type, self.row_bytes, *self.shape, dtype=dtype,
                               out=out)

    def row_slice(self, r0: int, r1: int) -> "QuantMatrix":
        """Rows [r0, r1) as a matrix of their own (a view of the stored bytes: blocks never span
        rows)."""
        return QuantMatrix(self.raw.reshape(-1)[r0 * self.row_bytes:r1 * self.row_bytes],
                           (r1 - r0, self.shape[1]), self.ggml_type)

    def rows(self, idx, out=None):
        """Rows idx (a device int32 array, or host integers) decoded to float32 (into `out`)."""
        if not isinstance(idx, cp.ndarray) or idx.dtype != cp.int32:
            idx = cp.asarray(idx, dtype=cp.int32)
        return dequantize_rows(self.raw, self.ggml_type, self.row_bytes, len(idx), self.shape[1],
                               rows=idx, out=out)
