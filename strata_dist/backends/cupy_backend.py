"""CuPy backend: dense weights in f16 on the GPU, activations in float32, experts kept on the device
in the file's stored block format and dequantized by a kernel when computed.

Correctness first: one dequantize + two GEMMs per (layer, expert) call. The fused kernels and CUDA
graphs of DESIGN.md §5 replace this path without changing its interface."""
from __future__ import annotations

import numpy as np

try:
    import cupy as cp
    import cupyx
except ImportError as exc:  # pragma: no cover - exercised only without CuPy
    raise ImportError("the cuda backend needs CuPy: pip install 'strata-dist[cuda13]' "
                      "(or [cuda12])") from exc

from gguf import GGMLQuantizationType

from .base import Backend, BackendError

_KERNELS = r"""
#include <cuda_fp16.h>
extern "C" __global__ void dequant_q8_0(const unsigned char* __restrict__ src,
                                        float* __restrict__ dst, long long n) {
    // Q8_0 block: f16 scale d, then 32 int8 quants; value = d * q.
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned char* blk = src + (i >> 5) * 34;
    float d = __half2float(*reinterpret_cast<const __half*>(blk));
    dst[i] = d * (float)(signed char)blk[2 + (i & 31)];
}
"""
_module = None


def _kernels():
    global _module
    if _module is None:
        _module = cp.RawModule(code=_KERNELS, options=("--std=c++14",))
    return _module


class CupyBackend(Backend):
    name = "cupy"
    xp = cp
    dense_dtype = np.float16

    def __init__(self, index: int = 0):
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except cp.cuda.runtime.CUDARuntimeError as e:
            raise BackendError(f"no CUDA device is usable: {e}") from None
        if not 0 <= index < n:
            raise BackendError(f"cuda:{index} does not exist ({n} visible device(s))")
        self.index = index
        self.device = f"cuda:{index}"
        self._dev = cp.cuda.Device(index)
        self._dev.use()
        self._pinned = None

    def dense(self, host):
        return cp.asarray(np.asarray(host, dtype=np.float16))

    def dense_tensor(self, gguf, info):
        if info.ggml_type == GGMLQuantizationType.Q8_0:
            return Q8Matrix(cp.asarray(np.asarray(gguf.raw(info.name))), info.shape)
        if info.ggml_type == GGMLQuantizationType.F16:
            return cp.asarray(np.asarray(gguf.raw(info.name)).view(np.float16).reshape(info.shape))
        return self.dense(gguf.dequantize(info.name))

    def rows(self, table, ids):
        idx = cp.asarray(np.asarray(ids, dtype=np.int64))
        if isinstance(table, Q8Matrix):
            return table.rows(idx)
        return table[idx].astype(cp.float32)

    def f32(self, host):
        return cp.asarray(np.asarray(host, dtype=np.float32))

    def asarray(self, host):
        return cp.asarray(host)

    def to_host(self, x):
        return cp.asnumpy(x)

    def linear(self, x, w):
        if isinstance(w, Q8Matrix):
            return x @ w.dequantize().T
        if w.dtype == cp.float16:
            return (x.astype(cp.float16) @ w.T).astype(cp.float32)
        return x @ w.T

    def make_expert_store(self, gguf, layers):
        """The single-process store: every expert of `layers` resident, in its stored format."""
        from ..experts import BlobArena
        g_layers = list(layers)
        n_experts = gguf.tensor(f"blk.{g_layers[0]}.ffn_gate_exps.weight").shape[0]
        n_layers = max(g_layers) + 1
        return BlobArena(self, gguf, [(l, e) for l in g_layers for e in range(n_experts)],
                         n_layers, n_experts)

    def stage_blob(self, host_blob, out=None):
        """A host blob on the device (into `out` when given: a loaned cache slot), through a
        pinned staging buffer, so the copy is a DMA at full PCIe speed."""
        n = int(host_blob.nbytes)
        if self._pinned is None or self._pinned.size < n:
            self._pinned = cupyx.empty_pinned(max(n, 1 << 20), dtype=np.uint8)
        self._pinned[:n] = np.asarray(host_blob, dtype=np.uint8)
        if out is None:
            out = cp.empty(n, dtype=cp.uint8)
        out.set(self._pinned[:n])
        return out

    def expert_weights(self, gguf, layer, blob):
        """(gate, up, down) float32 on the device from a device blob in its stored format."""
        out = []
        pos = 0
        for t in gguf.expert_parts(layer):
            per = t.n_bytes // t.shape[0]
            raw, pos = blob[pos:pos + per], pos + per
            rows, cols = t.shape[1], t.shape[2]
            if t.ggml_type == GGMLQuantizationType.Q8_0:
                out.append(_dequant_q8_0(raw, rows * cols).reshape(rows, cols))
            elif t.ggml_type == GGMLQuantizationType.F32:
                out.append(raw.view(cp.float32).reshape(rows, cols))
            elif t.ggml_type == GGMLQuantizationType.F16:
                out.append(raw.view(cp.float16).astype(cp.float32).reshape(rows, cols))
            else:  # no kernel yet for this type: decode on the host (correct, slower)
                from ..gguf_model import dequantize_bytes
                out.append(cp.asarray(dequantize_bytes(cp.asnumpy(raw), t.ggml_type, (rows, cols),
                                                       gguf.path, t.name)))
        return tuple(out)

    def synchronize(self):
        cp.cuda.get_current_stream().synchronize()

    def memory_info(self):
        free, total = cp.cuda.runtime.memGetInfo()
        return int(free), int(total)


def _dequant_q8_0(raw, n: int):
    out = cp.empty(n, dtype=cp.float32)
    _kernels().get_function("dequant_q8_0")(((n + 255) // 256,), (256,), (raw, out, cp.int64(n)))
    return out


class Q8Matrix:
    """A Q8_0 matrix kept as stored on the device; decoded exactly to float32 where it is used."""

    def __init__(self, raw, shape):
        self.raw, self.shape = raw, tuple(shape)
        self.nbytes = int(raw.nbytes)
        self.row_bytes = self.nbytes // self.shape[0]

    def dequantize(self):
        return _dequant_q8_0(self.raw, self.shape[0] * self.shape[1]).reshape(self.shape)

    def rows(self, idx):
        picked = self.raw.reshape(self.shape[0], self.row_bytes)[idx]
        return _dequant_q8_0(picked.reshape(-1), len(idx) * self.shape[1]).reshape(len(idx), -1)


