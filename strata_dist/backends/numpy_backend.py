"""numpy backend: everything in float32 on the host (what CPU ranks and CI run)."""
from __future__ import annotations

import numpy as np

from protocol.batch import MAX_BATCH_ROWS

from . import array_ops
from .base import Backend


class NumpyBackend(Backend):
    name = "numpy"
    device = "cpu"
    xp = np
    dense_dtype = np.float32

    def dense(self, host):
        return np.ascontiguousarray(host, dtype=np.float32)

    def dense_tensor(self, gguf, info):
        return self.dense(gguf.dequantize(info.name))

    def rows(self, table, ids, out=None):
        return table[np.asarray(ids, dtype=np.int64)]

    def f32(self, host):
        return np.ascontiguousarray(host, dtype=np.float32)

    def asarray(self, host):
        return np.asarray(host)

    def to_host(self, x):
        return np.asarray(x)

    def linear(self, x, w, out=None):
        # Up to MAX_BATCH_ROWS rows (a decode step, a verify window's rows, a batched step's),
        # one row at a time: BLAS sums a row's products in another order when more rows share
        # the call, and a row must get the bits it gets alone: greedy tokens with and without
        # speculation agree (strata_dist/sampling/speculative.py), and a batched row's do not depend on
        # its neighbours (protocol/batch.py). A longer prompt chunk: one GEMM.
        if x.ndim != 2 or x.shape[0] > MAX_BATCH_ROWS:
            return x @ w.T
        y = np.empty((x.shape[0], w.shape[0]), dtype=np.result_type(x.dtype, w.dtype))
        for i in range(x.shape[0]):
            y[i] = w @ x[i]
        return y

    def route(self, x, router, k: int, normalize: bool):
        # the router's product through `linear`: each row as its one-row step computes it
        return array_ops.softmax_topk(self.linear(x, router), k, normalize=normalize)

    def swiglu(self, x, gate, up, down):
        # One row at a time: BLAS picks different kernels for different shapes, and a row's
        # result must not depend on how many rows share the call.
        out = np.empty((x.shape[0], down.shape[0]), dtype=np.float32)
        for i in range(x.shape[0]):
            g = gate @ x[i]
            out[i] = down @ (g / (1.0 + np.exp(-g)) * (up @ x[i]))
        return out

    def stage_blob(self, host_blob, out=None):
        if out is None:
            return host_blob
        out[...] = host_blob
        return out

    def expert_weights(self, gguf, layer, blob):
        """(gate, up, down) float32 of one stored blob."""
        from ..gguf_file.reader import dequantize_bytes
        return tuple(dequantize_bytes(b, t.ggml_type, t.shape[1:], gguf.path, t.name)
                     for t, b in gguf.split_blob(layer, blob))
