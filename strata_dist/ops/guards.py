"""What the ops' choosers share: the launch limits their guards check, the check that names the
first condition that failed (the reason `compute_options.fall_back` logs), and decode.cu's build
as the decode graph makes it (the prompt path launches some of its kernels too)."""
from __future__ import annotations

from functools import lru_cache

try:
    import cupy as cp
except ImportError:   # the decode graph's launchers need none: backends/graph_ops.py imports
    cp = None         # them where CuPy is not (tests/test_model_interface.py reads its ops)

OPS_THREADS = 256     # prompt_ops.cu's block
MAX_GRID_Y = 65535    # a launch's rows are its grid's y (a chunk is far shorter)


def first_failed(conditions) -> str:
    """The reason of the first (holds, reason) pair that does not hold; "" when all hold."""
    return next((reason for holds, reason in conditions if not holds), "")


def f32_rows(a) -> bool:
    """A contiguous float32 device array (what the fused prompt kernels read)."""
    return isinstance(a, cp.ndarray) and a.dtype == cp.float32 and a.flags.c_contiguous


def decode_defines(kernel_shape: str) -> tuple[str, ...]:
    """decode.cu's build as the decode graph makes it (ComputeOptions.kernel_shape): one module
    for the graph and the prompt path's use of its kernels."""
    return _shape_defines(kernel_shape)


@lru_cache(maxsize=None)
def _shape_defines(text: str) -> tuple[str, ...]:
    """The -D defines of a kernel shape's text (parsed once: the prompt path asks every layer)."""
    from ..kernels.abi import KernelShape
    return tuple(KernelShape.parse(text).defines())
