"""The argument tables the ops' kernels read (kernels/abi.py's numpy record types: MatSpec,
ExpertSpec, RouteSpec, GdnSpec) as device arrays: the decode graph's, built once, and a prompt
chunk's, through its workspace."""
from __future__ import annotations

import numpy as np

try:
    import cupy as cp
except ImportError:   # the decode graph's launchers need none: backends/graph_ops.py imports
    cp = None         # them where CuPy is not (tests/test_model_interface.py reads its ops)


def spec_array(dtype, rows: list[dict], upload=None, name: str = ""):
    """The rows as a device table of `dtype` (through `upload(name, bytes)` when given)."""
    host = np.zeros(len(rows), dtype=dtype)
    for i, r in enumerate(rows):
        for key, value in r.items():
            host[key][i] = value
    return cp.asarray(host.view(np.uint8)) if upload is None else upload(name, host.view(np.uint8))
