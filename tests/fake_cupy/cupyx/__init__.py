"""cupyx's pinned arrays for tests/fake_cupy/cupy: plain numpy arrays."""
import numpy as _np


def empty_pinned(shape, dtype=_np.float32):
    return _np.zeros(shape, dtype=dtype)


def zeros_pinned(shape, dtype=_np.float32):
    return _np.zeros(shape, dtype=dtype)
