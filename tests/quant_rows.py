"""Random rows of every weight type the decode kernels read, with gguf-py's decoding of them
(the reference nobody here wrote): for the GPU kernel tests and the host build of the decoders."""
import numpy as np
from gguf import GGMLQuantizationType as QT, GGML_QUANT_SIZES
from gguf import quants as gguf_quants

TYPES = [QT.F32, QT.F16, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]
# f16 fields of a block (Q3_K, Q2_K and the i-quants: random_rows only, not in TYPES; the
# i-quants': those the integer expert path reads, experts_int_iq.cuh; every other field of theirs
# is valid whatever its bits)
SCALE_AT = {QT.Q8_0: [0], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208],
            QT.Q3_K: [108], QT.Q2_K: [80, 82],
            QT.IQ4_XS: [0], QT.IQ3_S: [0], QT.IQ2_XXS: [0]}


def random_rows(qtype, n_rows: int, n_cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(stored bytes [n_rows, row_bytes], gguf-py's float32 decoding of them)."""
    rng = np.random.default_rng(seed)
    if qtype == QT.F32:
        w = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        return w.view(np.uint8), w
    if qtype == QT.F16:
        w = rng.standard_normal((n_rows, n_cols)).astype(np.float16)
        return w.view(np.uint8), w.astype(np.float32)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_rows, n_cols // block, size), dtype=np.uint8)
    for at in SCALE_AT[qtype]:      # sane scales (random bytes could be inf or nan)
        scales = (rng.random((n_rows, n_cols // block)) * 0.02 + 0.001).astype(np.float16)
        raw[..., at:at + 2] = scales.view(np.uint8).reshape(n_rows, n_cols // block, 2)
    raw = raw.reshape(n_rows, -1)
    return raw, gguf_quants.dequantize(raw, qtype).astype(np.float32)
