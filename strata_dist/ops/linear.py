"""The dense linear op (a matrix times rows): a prompt chunk's GEMM and the decode graph's matvecs.

Weights kept on the device in their stored blocks (backends/layout.py GPU_NATIVE_QUANTS):
decoded to float32 by the same code the decode kernels read them with (kernels/weights.cuh).
Shared by the general path (cupy_backend.py) and the decode graph (cuda_decode.py).

The chooser of a prompt chunk's product (`prompt_linear`): a quantized matrix decoded to f16 and
multiplied on tensor cores (ComputeOptions.f16_prompt_gemm; a slice of rows at a time past the
f16 scratch), or decoded to float32 (SGEMM); an F16 matrix on tensor cores; float32 by CuPy's
matmul. The decode graph's (`graph_matvec`): decode.cu's matvec_<type>_<rows> a launch per type
of a layer's matrices, 8 rows a block for tall matrices, the RMSNorm of the input (and the
router's top-k) fused where asked; its argument tables: a dense matrix as the kernels see it
(`weight_of`, Unsupported where no decode kernel reads it), the MatSpec rows (`_mat`) grouped a
launch per type (`mat_launches`), and the norm weights the kernels read (`norm_vector`)."""
from __future__ import annotations

from dataclasses import dataclass

import cupy as cp
import numpy as np

from ..kernels import function as kernel
from ..kernels.abi import (F16, F32, KERNEL_TYPES, MAT_SPEC, matvec_block_threads, matvec_kernel,
                           rows_per_block)
from .expert_addresses import Unsupported
from .tables import spec_array


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


# ---- a prompt chunk's product -------------------------------------------------------------------
# a quantized matrix larger than this (and than the prompt layout's dense16) is decoded to f16 a
# slice of rows at a time: well inside a stage's work reserve (plan/pricing.py)
F16_SCRATCH_BYTES = 32 << 20


def prompt_linear(backend, f16_gemm: bool, x, w, out=None):
    """x [n, cols] times w.T into the backend's buffer `out` (float32): `f16_gemm`, a quantized
    matrix's product on tensor cores as an F16 file's (ComputeOptions.f16_prompt_gemm)."""
    if isinstance(w, QuantMatrix):
        if f16_gemm:     # as an F16 file's matrices: tensor cores, f32 accumulation
            rows, cols = w.shape
            fits = 2 * rows * cols <= max(F16_SCRATCH_BYTES, _scratch(backend, "dense16"))
            if not fits:       # the head of a Q4_K_M file: 600 MB as f16, unpriced
                return gemm_f16_slices(backend, x, w, out)
            dense = backend.buffer("dense16", w.shape, cp.float16)
            return gemm_f16(backend, x, w.dequantize(cp.float16, out=dense), out)
        return x @ w.dequantize().T
    if w.dtype == cp.float16:
        return gemm_f16(backend, x, w, out)
    return cp.matmul(x, w.T, out=backend.buffer(out, (int(x.shape[0]), int(w.shape[0])),
                                                cp.float32))


def _scratch(backend, name: str) -> int:
    return 0 if backend.workspace is None else backend.workspace.capacity(name)


def gemm_f16_slices(backend, x, w: QuantMatrix, out):
    """`gemm_f16` of a quantized matrix decoded to f16 F16_SCRATCH_BYTES at a time (its rows
    in slices), so a large one (an output head) never takes its whole f16 copy at once."""
    n, (rows, cols) = int(x.shape[0]), w.shape
    per = max(1, F16_SCRATCH_BYTES // (2 * cols))
    y = backend.buffer(out, (n, rows), cp.float32)
    x16 = x.astype(cp.float16)
    for r0 in range(0, rows, per):
        r1 = min(rows, r0 + per)
        cp.copyto(y[:, r0:r1], x16 @ w.row_slice(r0, r1).dequantize(cp.float16).T)
    return y


def gemm_f16(backend, x, w16, out):
    """x rounded to f16 times f16 weights on tensor cores (an f16 product, as CuPy's f16
    matmul writes it), widened to float32 into the buffer `out`."""
    n, rows = int(x.shape[0]), int(w16.shape[0])
    x16 = backend.buffer("in16", x.shape, cp.float16)
    cp.copyto(x16, x, casting="same_kind")
    y16 = cp.matmul(x16, w16.T, out=backend.buffer("out16", (n, rows), cp.float16))
    y = backend.buffer(out, (n, rows), cp.float32)
    cp.copyto(y, y16)
    return y


# ---- the decode graph's matvecs ----------------------------------------------------------------
@dataclass(frozen=True)
class Weight:
    """A dense matrix as the kernels see it: device pointer, GGML type, bytes per row, shape."""
    ptr: int
    type: int
    row_bytes: int
    nrows: int
    ncols: int


def weight_of(w, name: str) -> Weight:
    if isinstance(w, QuantMatrix):
        out = Weight(int(w.raw.data.ptr), w.ggml_type, w.row_bytes, *w.shape)
    elif isinstance(w, cp.ndarray) and w.ndim == 2 and w.flags.c_contiguous and \
            w.dtype in (np.float16, np.float32):
        out = Weight(int(w.data.ptr), F16 if w.dtype == np.float16 else F32,
                     w.shape[1] * w.itemsize, *w.shape)
    else:
        raise Unsupported(f"{name}: kept as {type(w).__name__}, which no decode kernel reads")
    align = KERNEL_TYPES.get(out.type)
    if align is None or out.ncols % 32 or out.ptr % align or out.row_bytes % align:
        raise Unsupported(f"{name}: type {out.type} / {out.ncols} columns is not readable by the "
                          f"decode kernels")
    return out


def norm_vector(v, name: str):
    """A norm weight as the kernels read it (float32, contiguous, 16-byte aligned: read 8 at a
    time)."""
    if not (isinstance(v, cp.ndarray) and v.dtype == np.float32 and v.flags.c_contiguous
            and v.data.ptr % 16 == 0):
        raise Unsupported(f"{name}: kept as {getattr(v, 'dtype', type(v).__name__)}, which the "
                          f"decode kernels do not read")
    return v


def _mat(w: Weight, y, add=None) -> dict:
    """A MatSpec row: W times the input rows into y (one output row per W row), plus `add`."""
    return dict(w=w.ptr, y=int(y.data.ptr), add=0 if add is None else int(add.data.ptr),
                row_bytes=w.row_bytes, nrows=w.nrows, ncols=w.ncols, y_stride=w.nrows, type=w.type)


@dataclass(frozen=True)
class MatLaunch:
    """Matrices of one type that share a matvec launch (blockIdx.y picks the matrix)."""
    type: int
    specs: object           # device MatSpec table
    count: int
    rows: int               # the tallest matrix's rows


def mat_launches(pairs: list[tuple[Weight, dict]]) -> list[MatLaunch]:
    """(weight, MatSpec row) pairs grouped by type, one launch per type (q, k and v are one launch
    unless a file stores them in different types)."""
    by_type: dict[int, list] = {}
    for w, row in pairs:
        by_type.setdefault(w.type, []).append((w, row))
    return [MatLaunch(t, spec_array(MAT_SPEC, [row for _, row in group]), len(group),
                      max(w.nrows for w, _ in group)) for t, group in by_type.items()]


WIDE_MIN_ROWS = 1024              # matrices this tall take 8 rows per block (one x row)
NULL = np.uint64(0)


def graph_matvec(graph, launches, x, x_stride: int, n: int, norm_w=None, eps=np.float32(0),
                 normed=None, route=None) -> None:
    """y = W . (rms_norm(x) * norm_w | x) [+ add] for each matrix of `launches` (MatLaunch, the
    layer's or the output's) over n rows; `normed`: where the first launch leaves the normed
    rows; `route`: the router's RouteSpec (one matrix)."""
    for m in launches:
        wide = m.rows >= WIDE_MIN_ROWS
        per_block = rows_per_block(n, wide, graph.shape, m.type)
        graph._launch(matvec_kernel(m.type, n))(
            ((m.rows + per_block - 1) // per_block, m.count),
            (matvec_block_threads(graph.shape, m.type),),
            (m.specs, x, np.int32(x_stride), np.int32(n), np.int32(wide),
             NULL if norm_w is None else norm_w, eps, NULL if normed is None else normed,
             NULL if route is None else route))
        normed = None            # written once
