"""Expert computation: SwiGLU experts read from the model file in their stored format.

An expert store answers `compute(layer, expert, x)` for the rows `x` routed to that expert. The
arithmetic of one (token, expert) row never depends on which other rows share the call, so the
output of a token does not depend on how its experts were grouped (the batch-invariance rule of
DESIGN.md §5)."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np


def silu(x, xp=np):
    return x / (1.0 + xp.exp(-x))


class HostExpertStore:
    """numpy: experts dequantized to float32 on first use, kept in a byte-bounded LRU."""

    def __init__(self, model, layers, budget_bytes: int = 2 << 30):
        self.gguf = model
        self.layers = set(layers)
        self.budget = budget_bytes
        self._cache: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._bytes = 0

    def weights(self, layer: int, expert: int):
        key = (layer, expert)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        gate, up, down = self.gguf.dequantize_expert(layer, expert)
        entry = (gate, up, down)
        size = gate.nbytes + up.nbytes + down.nbytes
        while self._cache and self._bytes + size > self.budget:
            _, old = self._cache.popitem(last=False)
            self._bytes -= sum(a.nbytes for a in old)
        self._cache[key] = entry
        self._bytes += size
        return entry

    def compute(self, layer: int, expert: int, x: np.ndarray) -> np.ndarray:
        gate, up, down = self.weights(layer, expert)
        # One row at a time keeps a row's result independent of how many rows share the call
        # (BLAS picks different kernels for different shapes).
        out = np.empty((x.shape[0], down.shape[0]), dtype=np.float32)
        for i in range(x.shape[0]):
            row = x[i]
            h = silu(gate @ row) * (up @ row)
            out[i] = down @ h
        return out
