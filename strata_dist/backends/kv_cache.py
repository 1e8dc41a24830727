"""How a session stores its K/V rows: `--kv-type f32 | f16 | q8_0` (llama.cpp's -ctk/-ctv idea).

f32 and f16 are plain arrays. q8_0 keeps llama.cpp's block layout in two arrays: int8 values and
one f16 scale per 32 values of a head (34 bytes per 32, about half of f16): rows are quantized
when written and decoded to float32 when read. Priced by `kv_cell_bytes` (strata_dist/model_shape.py), the
same rule the sessions allocate by. The decode graph reads f16 and q8_0 (kernels/attention.cuh
quantizes new rows with the same arithmetic as Q8Rows); f32 takes the general path."""
from __future__ import annotations

import numpy as np

KV_TYPES = ("f32", "f16", "q8_0")
Q8_BLOCK = 32


def default_kv_type(device_kind: str) -> str:
    """f16 on GPU ranks (the decode kernels read it), float32 on CPU ranks (the reference)."""
    return "f16" if device_kind == "cuda" else "f32"


def kv_cell_bytes(elems: int, kv_type: str, head_dim: int) -> int:
    """Bytes of `elems` K/V values of one cell (heads of `head_dim`) stored as `kv_type`."""
    if kv_type == "f32":
        return 4 * elems
    if kv_type == "f16":
        return 2 * elems
    if kv_type == "q8_0":
        if head_dim % Q8_BLOCK:
            raise ValueError(f"q8_0 K/V needs a head_dim that is a multiple of {Q8_BLOCK}, "
                             f"got {head_dim}")
        return elems // Q8_BLOCK * (Q8_BLOCK + 2)
    raise ValueError(f"unknown K/V type {kv_type!r} (expected one of {', '.join(KV_TYPES)})")


def new_kv(xp, shape: tuple[int, int, int], kv_type: str):
    """Zeroed K or V rows [cells, heads, head_dim] of `kv_type` on the array module xp."""
    if kv_type == "f32":
        return xp.zeros(shape, dtype=np.float32)
    if kv_type == "f16":
        return xp.zeros(shape, dtype=np.float16)
    if kv_type == "q8_0":
        return Q8Rows(xp, shape)
    raise ValueError(f"unknown K/V type {kv_type!r} (expected one of {', '.join(KV_TYPES)})")


class Q8Rows:
    """K or V rows [cells, heads, head_dim] in q8_0 blocks along head_dim. `rows[a:b] = x`
    quantizes (scale = max |x| / 127 per block, as llama.cpp's q8_0), `rows[a:b]` reads back
    float32. Only slices of cells are indexed (what the sessions do)."""

    dtype = np.dtype(np.float32)      # what reads give

    def __init__(self, xp, shape: tuple[int, int, int]):
        cells, heads, dim = shape
        if dim % Q8_BLOCK:
            raise ValueError(f"q8_0 K/V needs a head_dim that is a multiple of {Q8_BLOCK}, got {dim}")
        self.xp, self.shape = xp, tuple(shape)
        self.q = xp.zeros(shape, dtype=np.int8)
        self.scale = xp.zeros((cells, heads, dim // Q8_BLOCK), dtype=np.float16)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes)

    def __len__(self) -> int:
        return self.shape[0]

    def __setitem__(self, cells: slice, rows) -> None:
        xp = self.xp
        x = xp.asarray(rows, dtype=np.float32)
        n, heads, dim = x.shape
        blocks = x.reshape(n, heads, dim // Q8_BLOCK, Q8_BLOCK)
        scale = (xp.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float16)
        s32 = scale.astype(np.float32)
        inv = xp.where(s32 > 0, np.float32(1) / xp.where(s32 > 0, s32, np.float32(1)), np.float32(0))
        q = xp.clip(xp.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
        self.q[cells] = q.reshape(n, heads, dim)
        self.scale[cells] = scale

    def __getitem__(self, cells: slice):
        q, scale = self.q[cells], self.scale[cells]
        n, heads, dim = q.shape
        blocks = q.reshape(n, heads, dim // Q8_BLOCK, Q8_BLOCK).astype(np.float32)
        return (blocks * scale.astype(np.float32)[..., None]).reshape(n, heads, dim)
