"""Backends: an array module (numpy or cupy) plus the few operations whose precision or kernels
differ between them. `get_backend("cpu")` is numpy float32; `get_backend("cuda:N")` is CuPy with
f16 dense weights. CuPy is imported only when a CUDA device is asked for."""
from __future__ import annotations

from .base import Backend, BackendError
from .numpy_backend import NumpyBackend


def get_backend(device: str) -> Backend:
    device = (device or "cpu").strip()
    if device == "cpu":
        return NumpyBackend()
    if device.startswith("cuda"):
        index = 0
        if ":" in device:
            try:
                index = int(device.split(":", 1)[1])
            except ValueError:
                raise BackendError(f"device '{device}' is not of the form cuda:N") from None
        try:
            from .cupy_backend import CupyBackend  # optional dependency
        except ImportError as e:
            raise BackendError(f"device '{device}': {e}") from None
        return CupyBackend(index)
    raise BackendError(f"unknown device '{device}' (expected cpu or cuda:N)")


__all__ = ["Backend", "BackendError", "get_backend"]
