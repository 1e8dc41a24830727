"""Random rows of every stored type the kernels read (kernels/weights.cuh FOR_EACH_TYPE), with
gguf-py's decoding of them (the reference nobody here wrote): for the host build of the block
decoders (test_quant_blocks_host.py) and the GPU tests of every kernel x every type
(test_gpu_quant_types.py).

Two kinds of rows: `synth` rows are the blocks the synth writes (strata_dist/synth/blocks.py:
random quants, scales from a table); otherwise every byte is random but the f16 scale fields,
which are set to small finite values (a random byte there could be Inf or NaN), so every bit of
every packed scale, min, high-bit mask and quant is exercised (an i-quant's every index is in its
grid: random bytes are valid blocks)."""
import numpy as np
from gguf import GGMLQuantizationType as QT, GGML_QUANT_SIZES
from gguf import quants as gguf_quants

from strata_dist.synth import blocks as synth_blocks

IQUANTS = [QT.IQ1_S, QT.IQ1_M, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S,
           QT.IQ4_NL, QT.IQ4_XS]
ALL_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
             QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, *IQUANTS]
NEW_TYPES = [QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K]
# byte offsets of each block's f16 fields (d, and dmin / m where the type has one); IQ1_M keeps
# its d in the top nibbles of its four scale words (_set_iq1m_d)
F16_FIELDS = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q8_0: [0],
              QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2],
              QT.Q6_K: [208], **{t: [0] for t in IQUANTS if t != QT.IQ1_M}, QT.IQ1_M: []}


def _set_iq1m_d(raw: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M blocks [..., 56]: f16 d (uint16 bits) into the top nibble of each scale word at
    bytes 48..55 (nibble k of d in word k), the other bits kept."""
    words = np.ascontiguousarray(raw[..., 48:56]).view(np.uint16)
    for k in range(4):
        words[..., k] = (words[..., k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
    raw[..., 48:56] = words.view(np.uint8)


def stored_rows(qtype, n_rows: int, n_cols: int, seed: int, synth: bool = False) -> np.ndarray:
    """Stored bytes [n_rows, row_bytes] of random rows."""
    if synth:
        bits = np.random.SFC64(seed)
        rows = synth_blocks.random_rows(qtype, bits, n_rows, n_cols, 0.05)
        return np.ascontiguousarray(rows).view(np.uint8).reshape(n_rows, -1)
    rng = np.random.default_rng(seed)
    if qtype == QT.F32:
        return rng.standard_normal((n_rows, n_cols)).astype(np.float32).view(np.uint8)
    if qtype == QT.F16:
        return rng.standard_normal((n_rows, n_cols)).astype(np.float16).view(np.uint8)
    if qtype == QT.BF16:
        # every bit pattern but the exponent-all-ones ones (Inf, NaN: a NaN's payload is not a
        # weight), subnormals and both zeros included
        bits = rng.integers(0, 1 << 16, (n_rows, n_cols), dtype=np.uint16)
        bits[(bits & 0x7F80) == 0x7F80] &= 0xBFFF
        return bits.view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_rows, n_cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype] + ([None] if qtype == QT.IQ1_M else []):
        scales = (rng.random((n_rows, n_cols // block)) * 0.02 + 0.001)
        scales *= rng.choice([-1.0, 1.0], scales.shape)         # scales of either sign
        if at is None:
            _set_iq1m_d(raw, scales.astype(np.float16).view(np.uint16))
        else:
            raw[..., at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(
                n_rows, n_cols // block, 2)
    return raw.reshape(n_rows, -1)


def reference(qtype, raw: np.ndarray) -> np.ndarray:
    """gguf-py's float32 decoding of stored rows [n_rows, row_bytes]."""
    return gguf_quants.dequantize(raw, qtype).astype(np.float32).reshape(raw.shape[0], -1)


def random_rows(qtype, n_rows: int, n_cols: int, seed: int, synth: bool = False):
    """(stored bytes [n_rows, row_bytes], gguf-py's float32 decoding [n_rows, n_cols])."""
    raw = stored_rows(qtype, n_rows, n_cols, seed, synth)
    return raw, reference(qtype, raw)
