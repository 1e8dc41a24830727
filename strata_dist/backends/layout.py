"""How a backend keeps a dense tensor of the file and its KV cache, in bytes — one rule for the
loader and the planner (model_shape), so priced and loaded sizes cannot disagree.

CPU ranks: float32. GPU ranks: norms and routers float32; F16, Q8_0, Q4_K, Q5_K and Q6_K matrices
as stored (the decode kernels read these blocks directly, and they decode exactly: rounding a
quantized weight to f16 would move it, and a near-tie in routing then flips an expert); anything
else decoded to f16."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from ..gguf_model import TensorInfo

T = GGMLQuantizationType
GPU_NATIVE_QUANTS = frozenset({T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})   # block types the kernels read
GPU_NATIVE_DENSE = GPU_NATIVE_QUANTS | {T.F16}


def dense_nbytes(info: TensorInfo, device_kind: str, keep_f32: bool) -> int:
    n = int(np.prod(info.shape))
    if keep_f32 or device_kind == "cpu":
        return 4 * n
    if info.ggml_type in GPU_NATIVE_DENSE:
        return info.n_bytes
    return 2 * n
