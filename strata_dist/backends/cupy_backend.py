"""CuPy backend: dense weights in f16 on the GPU, activations in float32, experts kept on the device
in the file's stored block format and dequantized by a kernel when computed.

Correctness first: one dequantize + two GEMMs per (layer, expert) call. The fused kernels and CUDA
graphs of DESIGN.md §5 replace this path without changing its interface."""
from __future__ import annotations

import numpy as np

try:
    import cupy as cp
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

    def dense(self, host):
        return cp.asarray(np.asarray(host, dtype=np.float16))

    def f32(self, host):
        return cp.asarray(np.asarray(host, dtype=np.float32))

    def asarray(self, host):
        return cp.asarray(host)

    def to_host(self, x):
        return cp.asnumpy(x)

    def linear(self, x, w):
        if w.dtype == cp.float16:
            return (x.astype(cp.float16) @ w.T).astype(cp.float32)
        return x @ w.T

    def make_expert_store(self, model, layers):
        return DeviceExpertStore(model, layers)

    def synchronize(self):
        cp.cuda.get_current_stream().synchronize()

    def memory_info(self):
        free, total = cp.cuda.runtime.memGetInfo()
        return int(free), int(total)


class DeviceExpertStore:
    """All experts of `layers` resident on the device in their stored format."""

    NATIVE = {GGMLQuantizationType.Q8_0, GGMLQuantizationType.F16, GGMLQuantizationType.F32}

    def __init__(self, model, layers):
        self.gguf = model
        self.raw = {}          # tensor name -> device uint8 array (stored bytes)
        self.host_f32 = {}     # (layer, expert) -> device f32 (types without a kernel yet)
        self.nbytes = 0
        for layer in layers:
            for t in model.expert_parts(layer):
                if t.ggml_type in self.NATIVE:
                    arr = cp.asarray(np.asarray(model.raw(t.name)))
                    self.raw[t.name] = arr
                    self.nbytes += int(arr.nbytes)

    def _matrix(self, info, expert: int):
        rows, cols = info.shape[1], info.shape[2]
        per = info.n_bytes // info.shape[0]
        raw = self.raw[info.name][expert * per:(expert + 1) * per]
        if info.ggml_type == GGMLQuantizationType.F32:
            return raw.view(cp.float32).reshape(rows, cols)
        if info.ggml_type == GGMLQuantizationType.F16:
            return raw.view(cp.float16).astype(cp.float32).reshape(rows, cols)
        out = cp.empty(rows * cols, dtype=cp.float32)
        n = out.size
        _kernels().get_function("dequant_q8_0")(((n + 255) // 256,), (256,), (raw, out, cp.int64(n)))
        return out.reshape(rows, cols)

    def weights(self, layer: int, expert: int):
        parts = self.gguf.expert_parts(layer)
        if all(p.ggml_type in self.NATIVE for p in parts):
            return tuple(self._matrix(p, expert) for p in parts)
        key = (layer, expert)
        if key not in self.host_f32:
            self.host_f32[key] = tuple(cp.asarray(a) for a in self.gguf.dequantize_expert(layer, expert))
        return self.host_f32[key]

    def compute(self, layer: int, expert: int, x):
        gate, up, down = self.weights(layer, expert)
        g = x @ gate.T
        h = g / (1.0 + cp.exp(-g)) * (x @ up.T)
        return h @ down.T
