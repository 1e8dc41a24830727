"""How a backend keeps a dense tensor of the file, in bytes — one rule for the loader and the
planner (model_shape), so priced and loaded sizes cannot disagree.

CPU ranks: float32. GPU ranks: norms and routers float32; F16 and Q8_0 matrices as stored (both
decode exactly: rounding a Q8_0 weight to f16 would move it, and a near-tie in routing then flips
an expert); anything else decoded to f16."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from ..gguf_model import TensorInfo

GPU_NATIVE_DENSE = frozenset({GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0})


def dense_nbytes(info: TensorInfo, device_kind: str, keep_f32: bool) -> int:
    n = int(np.prod(info.shape))
    if keep_f32 or device_kind == "cpu":
        return 4 * n
    if info.ggml_type in GPU_NATIVE_DENSE:
        return info.n_bytes
    return 2 * n
