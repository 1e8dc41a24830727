"""Random but valid weight rows of every type the synth writes, generated straight as block bytes
(random quants, f16 scales from a table picked by a random byte) rather than by quantizing floats:
that keeps the writer at disk speed whatever the type, and the weights are random anyway.

Every type's values have mean ~0 (a min offset, or scales of random sign) and the requested std.
Two edits serve the routing law (the package docstring): `zero_first_columns` makes the first n
weights of every row exactly zero (whole blocks, then sub-block scales), and `set_channel` gives
coordinate 0 of every row one constant value (`channel_value`) by fixing the first block's scales.

The i-quants (IQUANT_TYPES) are random bytes with a finite f16 d: every other field of those
formats is valid whatever its bits (each grid index is in its grid, each 7-bit sign index names
a sign pattern whose 8th sign is the parity of the 7). Most of them cannot zero part of a block
(no sub-block scale reaches 0, no grid value is 0): `column_granule` says how many columns a
zeroed prefix must be a multiple of.
"""
from __future__ import annotations

import math
from functools import lru_cache

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
_INT8_STD = math.sqrt((256 ** 2 - 1) / 12)   # std of a uniform random byte


def raw_bytes(bits: np.random.SFC64, n: int) -> np.ndarray:
    return bits.random_raw((n + 7) // 8).view(np.uint8)[:n]


def uniform(bits: np.random.SFC64, shape: tuple[int, ...], std: float, dtype: type) -> np.ndarray:
    """Values on 256 levels symmetric about 0 with the given std, one random byte each through a
    lookup table: one pass, several times faster than normals or int8 -> float arithmetic."""
    levels = ((np.arange(256) - 127.5) * (std / _INT8_STD)).astype(dtype)
    raw = raw_bytes(bits, math.prod(shape))
    out = np.empty(raw.size, dtype)
    for i in range(0, raw.size, 1 << 20):               # take() widens indices to int64: slice it
        np.take(levels, raw[i:i + (1 << 20)], out=out[i:i + (1 << 20)])
    return out.reshape(shape)


@lru_cache(maxsize=64)
def _table(mean: float, signed: bool) -> np.ndarray:
    """256 f16 scales spread ±25% around `mean` as uint16 bit patterns, picked by a random byte;
    `signed`: the odd entries negative (a zero mean for types whose quants are not symmetric)."""
    v = mean * np.linspace(0.75, 1.25, 256)
    if signed:
        v[1::2] *= -1
    out = v.astype(np.float16).view(np.uint16)
    out.flags.writeable = False
    return out


def _f16(b: np.ndarray, at: int, bits16: np.ndarray) -> None:
    b[:, at:at + 2] = bits16.view(np.uint8).reshape(len(b), 2)


def _times(bits16: np.ndarray, k: float) -> np.ndarray:
    return (bits16.view(np.float16).astype(np.float32) * k).astype(np.float16).view(np.uint16)


# Per type: rms of the dequantized value in units of the block's d (quants and sub-scales random).
# Q4_0/Q5_0: d*(q-8), d*(q-16); Q4_1/Q5_1: d*(q-7.5), d*(q-15.5) via m = -7.5d, -15.5d; Q8_0: d*q;
# Q2_K: d*sc*(q-1.5) (m = sc, dmin = 1.5d, sc 8..15); Q3_K: d*s*q3 (s = ±16..31, q3 -4..3);
# Q4_K/Q5_K: d*sc*(q-7.5), d*sc*(q-15.5) (m = sc, dmin = 7.5d, 15.5d, sc 32..63); Q6_K: d*s*(q-32)
# (s = ±16..31).
_SC_K = math.sqrt(np.mean(np.arange(32, 64) ** 2.0))     # 6-bit scales 32..63
_SC_16 = math.sqrt(np.mean(np.arange(16, 32) ** 2.0))    # scale magnitudes 16..31
_SC_2K = math.sqrt(np.mean(np.arange(8, 16) ** 2.0))     # Q2_K's 4-bit scales 8..15
UNIT_RMS: dict[T, float] = {
    T.Q8_0: _INT8_STD,
    T.Q4_0: math.sqrt(21.25 + 0.25), T.Q4_1: math.sqrt(21.25),
    T.Q5_0: math.sqrt(85.25 + 0.25), T.Q5_1: math.sqrt(85.25),
    T.Q2_K: _SC_2K * math.sqrt(1.25), T.Q3_K: _SC_16 * math.sqrt(5.5),
    T.Q4_K: _SC_K * math.sqrt(21.25), T.Q5_K: _SC_K * math.sqrt(85.25),
    T.Q6_K: _SC_16 * math.sqrt(341.25 + 0.25),
}
SIGNED_D = {T.Q4_0, T.Q5_0, T.IQ4_NL}       # the d of these types carries the sign

IQUANT_TYPES = (T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL,
                T.IQ4_XS)
# Where each i-quant block keeps its f16 d (IQ1_M: in the top nibbles of its four scale words).
_IQ_D_AT = {t: 0 for t in IQUANT_TYPES if t != T.IQ1_M}


def _iq1m_set_d(b: np.ndarray, d16: np.ndarray) -> None:
    words = b[:, 48:56].copy().view(np.uint16)
    for k in range(4):
        words[:, k] = (words[:, k] & 0x0FFF) | (((d16 >> (4 * k)) & 0xF) << 12)
    b[:, 48:56] = words.view(np.uint8)


def _iq_set_d(t: T, b: np.ndarray, d16: np.ndarray) -> None:
    if t == T.IQ1_M:
        _iq1m_set_d(b, d16)
    else:
        _f16(b, _IQ_D_AT[t], d16)


@lru_cache(maxsize=None)
def _iq_unit_rms(t: T) -> float:
    """rms of the values of random blocks of t with d = 1 (sub-scales, grid entries and signs
    random as random_blocks draws them), measured through gguf-py's decoder."""
    size = gguf.GGML_QUANT_SIZES[t][1]
    b = raw_bytes(np.random.SFC64(12345), 4096 * size).reshape(4096, size).copy()
    _iq_set_d(t, b, np.full(4096, 0x3C00, np.uint16))          # f16 1.0
    return float(np.sqrt(np.mean(gguf.quants.dequantize(b, t).astype(np.float64) ** 2)))


def unit_rms(t: T) -> float:
    return _iq_unit_rms(t) if t in IQUANT_TYPES else UNIT_RMS[t]


def column_granule(t: T) -> int:
    """The multiple of columns `zero_first_columns` can zero: 1 for floats, 32 where a block or
    sub-block scale can be 0, a whole 256-value block for the i-quants that cannot (their
    sub-block scales are d (0.5 + s) / 4, d (1 + 2 s), ... and no grid value is 0)."""
    if t in (T.F32, T.F16, T.BF16):
        return 1
    if t in IQUANT_TYPES and t not in (T.IQ4_XS, T.IQ4_NL):
        return gguf.GGML_QUANT_SIZES[t][0]
    return 32


def _q3k_pack(v: np.ndarray) -> np.ndarray:
    """16 6-bit values per block -> the 12 packed bytes: low nibbles of 0..7 and 8..15 share bytes
    0..7; the top 2 bits of value j sit in byte 8 + j%4 at bit 2*(j//4)."""
    out = np.empty((len(v), 12), np.uint8)
    out[:, :8] = (v[:, :8] & 15) | ((v[:, 8:] & 15) << 4)
    hi = (v >> 4) & 3
    out[:, 8:] = hi[:, 0:4] | (hi[:, 4:8] << 2) | (hi[:, 8:12] << 4) | (hi[:, 12:16] << 6)
    return out


def _q3k_unpack(b: np.ndarray) -> np.ndarray:
    v = np.empty((len(b), 16), np.uint8)
    v[:, :8] = b[:, :8] & 15
    v[:, 8:] = b[:, :8] >> 4
    for j in range(16):
        v[:, j] |= ((b[:, 8 + j % 4] >> (2 * (j // 4))) & 3) << 4
    return v


def _signed_16_31(raw: np.ndarray) -> np.ndarray:
    """Scale magnitudes 16..31 of random sign, from random bytes."""
    mag = 16 + (raw & 15).astype(np.int16)
    return np.where(raw & 0x80, -mag, mag)


def random_blocks(t: T, bits: np.random.SFC64, n_blocks: int, std: float) -> np.ndarray:
    """n_blocks random blocks of type t, values of mean ~0 and std ~`std`: [n_blocks, block bytes]."""
    size = gguf.GGML_QUANT_SIZES[t][1]
    b = raw_bytes(bits, n_blocks * size).reshape(n_blocks, size)
    d = _table(std / unit_rms(t), t in SIGNED_D)
    if t in IQUANT_TYPES:
        # IQ4_XS: the 6-bit sub-block scales (s - 32) carry the sign; the grids' signs are random
        _iq_set_d(t, b, d[b[:, 1] if t == T.IQ1_M else b[:, 0]])
    elif t in (T.Q8_0, T.Q4_0, T.Q5_0):
        _f16(b, 0, d[b[:, 0]])
    elif t in (T.Q4_1, T.Q5_1):
        pick = d[b[:, 0]]
        _f16(b, 0, pick)
        _f16(b, 2, _times(pick, -7.5 if t == T.Q4_1 else -15.5))
    elif t in (T.Q4_K, T.Q5_K):
        pick = d[b[:, 0]]
        _f16(b, 0, pick)
        _f16(b, 2, _times(pick, 7.5 if t == T.Q4_K else 15.5))
        # scales[0:4] low 6 bits = scale j<4, top 2 bits = high bits of scale j+4; 0xA0 puts every
        # scale in 32..63. scales[4:8] the same for the mins; scales[8:12] nibbles = low bits of
        # scale/min j+4. Min = scale: the values are centred.
        b[:, 4:8] |= 0xA0
        b[:, 8:12] = b[:, 4:8]
        b[:, 12:16] = (b[:, 12:16] & 0x0F) * 17
    elif t == T.Q2_K:
        pick = d[b[:, 80]]
        _f16(b, 80, pick)
        _f16(b, 82, _times(pick, 1.5))
        sc = (b[:, 0:16] & 7) | 8
        b[:, 0:16] = sc | (sc << 4)                      # min = scale: the values are centred
    elif t == T.Q3_K:
        _f16(b, 108, d[b[:, 108]])
        signs = raw_bytes(bits, n_blocks * 16).reshape(n_blocks, 16)   # apart from the quants
        b[:, 96:108] = _q3k_pack((32 + _signed_16_31(signs)).astype(np.uint8))
    elif t == T.Q6_K:
        _f16(b, 208, d[b[:, 208]])
        b[:, 192:208] = _signed_16_31(b[:, 192:208]).astype(np.int8).view(np.uint8)
    else:
        raise ValueError(f"no random blocks for {t.name}")
    return b


def random_rows(t: T, bits: np.random.SFC64, n_rows: int, n_cols: int, std: float) -> np.ndarray:
    """n_rows rows of n_cols random weights: float32/float16 values, bf16 bit patterns (uint16), or
    block bytes [n_rows, row bytes]."""
    if t in (T.F32, T.F16):
        return uniform(bits, (n_rows, n_cols), std, np.float32 if t == T.F32 else np.float16)
    if t == T.BF16:
        return (uniform(bits, (n_rows, n_cols), std, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    block = gguf.GGML_QUANT_SIZES[t][0]
    return random_blocks(t, bits, n_rows * n_cols // block, std).reshape(n_rows, -1)


# Zeroing the scales of sub-blocks [0, k) of a K super-block: (sub-block width, how, in place).
def _zero_q4k(sb: np.ndarray, k: int) -> None:          # sb: the super-block's bytes [rows, size]
    sc = sb[:, 4:16]
    for j in range(k):
        if j < 4:
            sc[:, j] &= 0xC0                             # keep the top bits: they belong to j + 4
            sc[:, j + 4] &= 0xC0
        else:
            sc[:, j + 4] = 0
            sc[:, j - 4] &= 0x3F
            sc[:, j] &= 0x3F


def _zero_iq4xs(sb: np.ndarray, k: int) -> None:
    """Sub-blocks [0, k) get the scale code 32 (d (32 - 32) = 0): low nibble 0, high bits 2."""
    high = sb[:, 2:4].copy().view(np.uint16)[:, 0]
    for j in range(k):
        sb[:, 4 + j // 2] &= 0xF0 if j % 2 == 0 else 0x0F
        high = (high & ~np.uint16(3 << (2 * j))) | np.uint16(2 << (2 * j))
    sb[:, 2:4] = high.astype(np.uint16).view(np.uint8).reshape(len(sb), 2)


def _zero_q3k(sb: np.ndarray, k: int) -> None:
    v = _q3k_unpack(sb[:, 96:108])
    v[:, :k] = 32                                        # stored with a +32 bias
    sb[:, 96:108] = _q3k_pack(v)


_SUB_ZERO = {
    T.Q4_K: (32, _zero_q4k), T.Q5_K: (32, _zero_q4k),
    T.Q2_K: (16, lambda sb, k: sb.__setitem__((slice(None), slice(0, k)), 0)),
    T.Q6_K: (16, lambda sb, k: sb.__setitem__((slice(None), slice(192, 192 + k)), 0)),
    T.Q3_K: (16, _zero_q3k),
    T.IQ4_XS: (32, _zero_iq4xs),
}


def zero_first_columns(t: T, rows: np.ndarray, n: int) -> None:
    """Make the first n weights of every row exactly zero (n a multiple of 32 for block types)."""
    if t in (T.F32, T.F16, T.BF16):
        rows[:, :n] = 0
        return
    block, size = gguf.GGML_QUANT_SIZES[t]
    whole = n // block
    rows[:, :whole * size] = 0                           # all-zero blocks dequantize to 0
    if n % block:
        if t not in _SUB_ZERO:
            raise ValueError(f"{t.name} cannot zero {n} columns: only whole blocks of {block} "
                             f"(column_granule)")
        sub, zero = _SUB_ZERO[t]
        zero(rows[:, whole * size:(whole + 1) * size], n % block // sub)


# The first block of every row, fixed so that coordinate 0 holds one constant: (the block's d
# and sub-block 0's scale at their typical value, element 0's quant at its largest positive code).
def _channel_block(t: T, first: np.ndarray, std: float) -> None:
    d = _table(std / unit_rms(t), False)[128:129]        # the table's middle, positive
    n = len(first)
    rep = lambda bits16: np.repeat(bits16, n)            # noqa: E731
    if t == T.Q8_0:
        _f16(first, 0, rep(d))
        first[:, 2] = 127
    elif t == T.Q4_0:
        _f16(first, 0, rep(d))
        first[:, 2] = (first[:, 2] & 0xF0) | 0x0F        # q = 15: 7 d
    elif t == T.Q5_0:
        _f16(first, 0, rep(d))
        first[:, 2] |= 1
        first[:, 6] |= 0x0F                              # q = 31: 15 d
    elif t in (T.Q4_1, T.Q5_1):
        _f16(first, 0, rep(d))
        _f16(first, 2, rep(_times(d, -7.5 if t == T.Q4_1 else -15.5)))
        if t == T.Q4_1:
            first[:, 4] |= 0x0F
        else:
            first[:, 4] |= 1
            first[:, 8] |= 0x0F
    elif t in (T.Q4_K, T.Q5_K):
        _f16(first, 0, rep(d))
        _f16(first, 2, rep(_times(d, 7.5 if t == T.Q4_K else 15.5)))
        first[:, 4] = (first[:, 4] & 0xC0) | 48          # scale 0 = min 0 = 48
        first[:, 8] = (first[:, 8] & 0xC0) | 48
        if t == T.Q4_K:
            first[:, 16] |= 0x0F
        else:
            first[:, 16] |= 1
            first[:, 48] |= 0x0F
    elif t == T.Q2_K:
        _f16(first, 80, rep(d))
        _f16(first, 82, rep(_times(d, 1.5)))
        first[:, 0] = 12 | (12 << 4)
        first[:, 16] |= 3
    elif t == T.Q3_K:
        _f16(first, 108, rep(d))
        v = _q3k_unpack(first[:, 96:108])
        v[:, 0] = 32 + 24
        first[:, 96:108] = _q3k_pack(v)
        first[:, 32] |= 3
        first[:, 0] |= 1                                 # high bit set: q3 = 3
    elif t == T.Q6_K:
        _f16(first, 208, rep(d))
        first[:, 192] = 24
        first[:, 0] |= 0x0F
        first[:, 128] |= 3                               # q = 63: 31 * 24 d
    elif t in IQUANT_TYPES:
        _iq_channel_block(t, first, rep(d))
    else:
        raise ValueError(f"no channel block for {t.name}")


@lru_cache(maxsize=None)
def _top_entry(t: T) -> int:
    """The grid entry whose first value is the largest (first found)."""
    cls = {T.IQ1_M: gguf.quants.IQ1_S}.get(t) or getattr(gguf.quants, t.name)
    cls.init_grid()
    return int(np.argmax(np.asarray(cls.grid).reshape(cls.grid_shape)[:, 0]))


def _iq_channel_block(t: T, first: np.ndarray, d16: np.ndarray) -> None:
    """d, sub-block 0's scale at a middle code, element 0 the top grid entry's first value (or
    the top level), positive."""
    top = _top_entry(t) if t not in (T.IQ4_NL, T.IQ4_XS) else 15
    _iq_set_d(t, first, d16)
    u32 = lambda at: first[:, at:at + 4].copy().view(np.uint32)[:, 0]          # noqa: E731
    put32 = lambda at, v: first.__setitem__((slice(None), slice(at, at + 4)),   # noqa: E731
                                            v.astype(np.uint32).view(np.uint8).reshape(len(first), 4))
    if t in (T.IQ2_XXS, T.IQ3_XXS):
        at = 6 if t == T.IQ2_XXS else 66                  # the word of 4 sign indices and the scale
        put32(at, (u32(at) & np.uint32(0x0FFFFF80)) | np.uint32(8 << 28))   # scale 8, signs 0..6 +
        first[:, 2] = top
    elif t == T.IQ2_XS:
        first[:, 2] = top & 0xFF
        first[:, 3] = (top >> 8) & 1                      # sign index 0: every sign +
        first[:, 66] = (first[:, 66] & 0xF0) | 8
    elif t == T.IQ2_S:
        first[:, 2] = top & 0xFF
        first[:, 66] = (first[:, 66] & 0xFC) | (top >> 8)
        first[:, 34] &= 0xFE
        first[:, 74] = (first[:, 74] & 0xF0) | 8
    elif t == T.IQ3_S:
        first[:, 2] = top & 0xFF
        first[:, 66] = (first[:, 66] & 0xFE) | (top >> 8)
        first[:, 74] &= 0xFE
        first[:, 106] = (first[:, 106] & 0xF0) | 8
    elif t == T.IQ1_S:
        first[:, 2] = top & 0xFF
        qh = first[:, 34:36].copy().view(np.uint16)[:, 0]
        qh = (qh & np.uint16(0x0FF8)) | np.uint16(top >> 8) | np.uint16(4 << 12)   # scale 4, delta +
        first[:, 34:36] = qh.view(np.uint8).reshape(len(first), 2)
    elif t == T.IQ1_M:
        first[:, 0] = top & 0xFF
        first[:, 32] = (first[:, 32] & 0xF0) | (top >> 8)  # delta +
        w0 = first[:, 48:50].copy().view(np.uint16)[:, 0]
        first[:, 48:50] = ((w0 & np.uint16(0xFFF8)) | np.uint16(4)).view(np.uint8).reshape(len(first), 2)
    elif t == T.IQ4_NL:
        first[:, 2] = (first[:, 2] & 0xF0) | top
    elif t == T.IQ4_XS:
        first[:, 4] = (first[:, 4] & 0xF0) | 0               # scale code 48: 16 d
        first[:, 2] = (first[:, 2] & 0xFC) | 3
        first[:, 8] = (first[:, 8] & 0xF0) | top


def channel_value(t: T, std: float, float_value: float) -> float:
    """The constant `set_channel` puts in coordinate 0 (as the file's reader dequantizes it)."""
    if t in (T.F32, T.F16, T.BF16):
        row = np.zeros((1, 1), np.float32 if t == T.F32 else np.float16 if t == T.F16 else np.uint16)
        set_channel(t, row, std, float_value)
        return float(gguf.quants.dequantize(row.view(np.uint8), t).ravel()[0])
    block = gguf.GGML_QUANT_SIZES[t][0]
    row = random_rows(t, np.random.SFC64(0), 1, block, std)
    _channel_block(t, row, std)
    return float(gguf.quants.dequantize(row, t).ravel()[0])


def set_channel(t: T, rows: np.ndarray, std: float, float_value: float) -> None:
    """Coordinate 0 of every row := channel_value(t, std, float_value)."""
    if t in (T.F32, T.F16):
        rows[:, 0] = float_value
    elif t == T.BF16:
        rows[:, 0] = np.array([float_value], np.float32).view(np.uint32)[0] >> 16
    else:
        _channel_block(t, rows[:, :gguf.GGML_QUANT_SIZES[t][1]], std)
