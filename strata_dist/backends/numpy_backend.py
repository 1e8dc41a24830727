"""numpy backend: everything in float32 on the host (what CPU ranks and CI run)."""
from __future__ import annotations

import numpy as np

from .base import Backend


class NumpyBackend(Backend):
    name = "numpy"
    device = "cpu"
    xp = np
    dense_dtype = np.float32

    def dense(self, host):
        return np.ascontiguousarray(host, dtype=np.float32)

    def f32(self, host):
        return np.ascontiguousarray(host, dtype=np.float32)

    def asarray(self, host):
        return np.asarray(host)

    def to_host(self, x):
        return np.asarray(x)

    def linear(self, x, w):
        return x @ w.T

    def make_expert_store(self, model, layers):
        from ..experts import HostExpertStore
        return HostExpertStore(model, layers)
