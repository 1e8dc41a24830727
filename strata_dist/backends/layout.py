"""How a backend keeps a dense tensor of the file and its KV cache, in bytes — one rule for the
loader and the planner (model_shape), so priced and loaded sizes cannot disagree.

CPU ranks: float32. GPU ranks: norms and routers float32; F16 matrices and those of every block
type the kernels read (kernels/weights.cuh's type table, kernels/abi.py KERNEL_TYPES: Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 and the i-quants IQ1_S, IQ1_M, IQ2_XXS,
IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS) as stored: every weight-reading kernel (the
decode matvecs and expert kernels, the prompt's row kernels and dequantize-to-f16 GEMMs, the reads
of host-mapped and helper blobs) reads these blocks directly, and they decode exactly (rounding a
quantized weight to f16 would move it, and a near-tie in routing then flips an expert); anything
else is decoded to f16, and `dense_type_note` / `expert_type_notes` name each such tensor at load
with its cost."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from ..gguf_file.reader import EXPERT_PARTS, TensorInfo
from ..kernels.abi import KERNEL_TYPES

T = GGMLQuantizationType
# block types the kernels read (every kernel that reads weights has a build for each: one table)
GPU_NATIVE_QUANTS = frozenset(T(t) for t in KERNEL_TYPES) - {T.F32, T.F16}
GPU_NATIVE_DENSE = GPU_NATIVE_QUANTS | {T.F16}


def dense_nbytes(info: TensorInfo, device_kind: str, keep_f32: bool) -> int:
    n = int(np.prod(info.shape))
    if keep_f32 or device_kind == "cpu":
        return 4 * n
    if info.ggml_type in GPU_NATIVE_DENSE:
        return info.n_bytes
    return 2 * n


def _ratio(wide_bytes: int, info: TensorInfo) -> str:
    return f"{wide_bytes / max(info.n_bytes, 1):.1f}x the bytes"


def dense_type_note(info: TensorInfo) -> str | None:
    """The line naming a dense matrix a GPU rank keeps decoded to f16 because no kernel reads its
    stored type, with what that costs (None: read as stored, or F32, whose f16 copy is smaller)."""
    if int(info.ggml_type) in KERNEL_TYPES:
        return None
    return (f"{info.name}: {info.ggml_type.name} read as f16, "
            f"{_ratio(2 * int(np.prod(info.shape)), info)}")


def expert_type_notes(gguf, layer: int) -> list[str]:
    """A line for each expert tensor of `layer` whose stored type no GPU kernel reads: each use
    decodes it on the host to float32 and the stage's decode steps take the general path."""
    notes = []
    for part in EXPERT_PARTS:
        info = gguf.tensors.get(f"blk.{layer}.{part}.weight")
        if info is None or int(info.ggml_type) in KERNEL_TYPES:
            continue
        notes.append(f"{info.name}: {info.ggml_type.name} has no GPU kernel: decoded on the host "
                     f"to float32 at each use ({_ratio(4 * int(np.prod(info.shape)), info)} "
                     f"moved), and its stage's decode steps take the general path")
    return notes
