"""NaN and Inf in stored weights, found before they reach a forward pass (where they turn every
logit into NaN: greedy decoding then answers token 0 forever).

Float tensors are checked value by value on their bit patterns (an all-ones exponent); in a
quantized block the quants are small integers and only the float scales can hold NaN or Inf, so
those fields are checked. A dense tensor is checked whole when a process first reads it (it reads
all of it anyway, to load it), a chunk at a time so the temporaries stay small; only one past
FULL_SCAN_BYTES (more than any dense tensor of the models this product runs: the F16 embedding of
Qwen3-235B is 1.2 GB) is checked in SAMPLE_WINDOWS windows spread evenly over it, its first and
last block included. Experts are checked whole, one expert at a time as a process reads them
(gguf_file/reader.py): a process that reads experts as they are used never reads the others.

Measured on a Qwen3-30B-A3B-shaped synth (Q4_K experts, F16 dense tensors: 18.5 GB) on this
machine's 2 shared CPU cores with the file in the page cache: the 435 dense tensors (2.9 GiB, the
two 593 MiB F16 embedding and head at 0.15 s each) checked in 1.0-1.1 s; the 6,144 experts read
in 2.0-2.3 s unchecked and 3.6-4.6 s checked (0.14 ms of a blob's 2.6 MB measured alone). Read
cold from this machine's disk (465 MiB/s) the experts take 33 s, to which the check adds no read;
sampling the 144 expert stacks from the file instead cost 15.5 s of random reads cold, which is
why experts are checked from the copy a process makes of them anyway.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

QT = GGMLQuantizationType

FULL_SCAN_BYTES = 2 << 30
SAMPLE_WINDOWS = 256
WINDOW_BYTES = 4 << 10
CHUNK_BYTES = 16 << 20          # scanned a chunk at a time: the temporaries stay small

# float element types: (unsigned view, exponent mask, mantissa mask)
_FLOAT_BITS = {
    QT.F32: (np.dtype("<u4"), 0x7F800000, 0x007FFFFF),
    QT.F16: (np.dtype("<u2"), 0x7C00, 0x03FF),
    QT.BF16: (np.dtype("<u2"), 0x7F80, 0x007F),
    QT.F64: (np.dtype("<u8"), 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
}
_F16 = _FLOAT_BITS[QT.F16]
_F32 = _FLOAT_BITS[QT.F32]
# byte offsets of the float scale fields inside one block (the block layouts of the quant types):
# f16 unless the type is listed in _F32_SCALES
_SCALE_FIELDS = {
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
    QT.Q8_1: (0, 2), QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2),
    QT.Q6_K: (208,), QT.Q8_K: (0,), QT.TQ1_0: (52,), QT.TQ2_0: (64,),
    QT.IQ2_XXS: (0,), QT.IQ2_XS: (0,), QT.IQ2_S: (0,), QT.IQ3_XXS: (0,), QT.IQ3_S: (0,),
    QT.IQ1_S: (0,), QT.IQ4_NL: (0,), QT.IQ4_XS: (0,),
}
_F32_SCALES = {QT.Q8_K}
_INTEGER_TYPES = {QT.I8, QT.I16, QT.I32, QT.I64}


def _chunks(n_units: int, unit_bytes: int):
    """Index ranges (or index arrays) of the units to check, a chunk at a time: all of them when
    the tensor is small, else SAMPLE_WINDOWS windows of WINDOW_BYTES spread evenly over it
    (gathered at once: one read per window, then one vectorised check)."""
    if n_units * unit_bytes <= FULL_SCAN_BYTES:
        per = max(1, CHUNK_BYTES // unit_bytes)
        for start in range(0, n_units, per):
            yield slice(start, min(n_units, start + per))
        return
    per = max(1, WINDOW_BYTES // unit_bytes)
    starts = np.linspace(0, n_units - per, SAMPLE_WINDOWS).astype(np.int64)
    yield (starts[:, None] + np.arange(per, dtype=np.int64)[None, :]).ravel()


def _first_bad(bits: np.ndarray, exp_mask: int, mant_mask: int) -> tuple[int, str] | None:
    bad = (bits & bits.dtype.type(exp_mask)) == bits.dtype.type(exp_mask)
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad.ravel())[0])
    return i, "NaN" if int(bits.ravel()[i]) & mant_mask else "Inf"


def find_non_finite(raw: np.ndarray, ggml_type: GGMLQuantizationType,
                    row_elems: int) -> str | None:
    """None if the stored bytes of a tensor (or the part of it checked) hold no NaN or Inf; else
    where the first one is, in words ("NaN at element 70 (row 1)")."""
    raw = np.asarray(raw, dtype=np.uint8).ravel()
    if ggml_type in _INTEGER_TYPES or raw.size == 0:
        return None
    if ggml_type in _FLOAT_BITS:
        view, exp_mask, mant_mask = _FLOAT_BITS[ggml_type]
        values = raw[: raw.size // view.itemsize * view.itemsize].view(view)
        for which in _chunks(values.size, view.itemsize):
            found = _first_bad(values[which], exp_mask, mant_mask)
            if found:
                at = _position(which, found[0])
                return f"{found[1]} at element {at} (row {at // row_elems})"
        return None
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = raw[: raw.size // type_size * type_size].reshape(-1, type_size)
    per_row = max(1, row_elems // block)
    for which in _chunks(blocks.shape[0], type_size):
        found = _bad_block(blocks[which], ggml_type)
        if found:
            at = _position(which, found[0])
            return f"{found[1]} in the scale of block {at} (row {at // per_row})"
    return None


def _position(which, i: int) -> int:
    return which.start + i if isinstance(which, slice) else int(which[i])


def _bad_block(blocks: np.ndarray, ggml_type: GGMLQuantizationType) -> tuple[int, str] | None:
    """(first block whose scales hold NaN/Inf, which) among `blocks` [n, type_size]."""
    fields = _SCALE_FIELDS.get(ggml_type)
    if fields is None:
        # a type whose scale is not one plain float field: decode the blocks and look
        try:
            values = gguf_quants.dequantize(blocks, ggml_type)
        except NotImplementedError:
            return None    # a type no decoder reads is refused where it is read
        values = np.asarray(values).reshape(blocks.shape[0], -1)
        bad = ~np.isfinite(values).all(axis=1)
        if not bad.any():
            return None
        i = int(np.flatnonzero(bad)[0])
        return i, "NaN" if np.isnan(values[i]).any() else "Inf"
    view, exp_mask, mant_mask = _F32 if ggml_type in _F32_SCALES else _F16
    # a strided view of the scale fields of every block (no copy): where a type has two (d and
    # dmin) they are adjacent (tests/test_gguf_reader.py checks each against gguf-py's decoder)
    k = len(fields)
    blocks = np.ascontiguousarray(blocks)
    bits = np.ndarray((blocks.shape[0], k), dtype=view, buffer=blocks, offset=fields[0],
                      strides=(blocks.shape[1], view.itemsize))
    found = _first_bad(bits, exp_mask, mant_mask)
    return None if found is None else (found[0] // k, found[1])
