"""How a session stores its K/V rows: `--kv-type f32 | f16 | q8_0` (llama.cpp's -ctk/-ctv idea).

f32 and f16 are plain arrays. q8_0 keeps llama.cpp's block layout in two arrays: int8 values and
one f16 scale per 32 values of a head (34 bytes per 32, about half of f16): rows are quantized
when written and decoded to float32 when read. Priced by `kv_cell_bytes` (strata_dist/models/shape.py), the
same rule the sessions allocate by. The decode graph reads f16 and q8_0 (kernels/attention.cuh
quantizes new rows with the same arithmetic as Q8Rows), both with --kv-resident's ring too
(RingKV, DeviceRing); f32 takes the general path."""
from __future__ import annotations

import numpy as np

from ..plan.pricing import KV_SINK_CELLS

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

    def __init__(self, xp, shape: tuple[int, int, int], arrays=None):
        """`arrays`: the (int8 values, f16 scales) to keep the rows in, zeroed, of the shapes
        these rows take (a ring's host copy in mapped pinned memory); default new ones."""
        cells, heads, dim = shape
        if dim % Q8_BLOCK:
            raise ValueError(f"q8_0 K/V needs a head_dim that is a multiple of {Q8_BLOCK}, got {dim}")
        self.xp, self.shape = xp, tuple(shape)
        scale_shape = (cells, heads, dim // Q8_BLOCK)
        if arrays is None:
            arrays = xp.zeros(shape, dtype=np.int8), xp.zeros(scale_shape, dtype=np.float16)
        self.q, self.scale = arrays
        for a, want, dtype in ((self.q, tuple(shape), np.int8),
                               (self.scale, scale_shape, np.float16)):
            if tuple(a.shape) != want or a.dtype != dtype:
                raise ValueError(f"q8_0 rows of {tuple(shape)} keep {np.dtype(dtype).name} "
                                 f"{want}, given {a.dtype} {tuple(a.shape)}")

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
        return q8_decode(self.xp, self.q[cells], self.scale[cells])


def q8_decode(xp, q, scale):
    """float32 rows [n, heads, dim] of q8_0's int8 values q [n, heads, dim] and f16 scales
    [n, heads, dim / 32], on the array module xp (each product exact in float32: the same
    values on every backend)."""
    n, heads, dim = q.shape
    blocks = q.reshape(n, heads, dim // Q8_BLOCK, Q8_BLOCK).astype(np.float32)
    return (blocks * scale.astype(np.float32)[..., None]).reshape(n, heads, dim)


# ---- --kv-resident N: the newest cells on the card, every cell in host memory --------------------

def kv_split(cells: int, resident: int) -> tuple[int, int] | None:
    """(sinks S, ring R) of a session of `cells` cells keeping `resident` = S + R of them on the
    card, or None when every cell is resident (resident 0, or at least `cells`)."""
    if resident <= 0 or resident >= cells:
        return None
    if resident <= KV_SINK_CELLS:
        raise ValueError(f"{resident} resident cells leave no ring beside the "
                         f"{KV_SINK_CELLS} attention sinks")
    return KV_SINK_CELLS, resident - KV_SINK_CELLS


# the K/V types whose ring a GPU decode graph reads (kernels/attention.cuh KvRing: f16, and q8_0's
# values and scales); a RingKV of another type on a device keeps its host copy in pageable memory
DEVICE_RING_TYPES = ("f16", "q8_0")


def new_session_kv(xp, shape: tuple[int, int, int], kv_type: str, resident: int = 0):
    """A session's K or V rows of one layer: a plain store of every cell, or with `resident`
    below the cells a RingKV (on a device with f16 or q8_0 K/V, its host copy pinned and mapped,
    which the decode graph's kernels read in place)."""
    split = kv_split(shape[0], resident)
    if split is None:
        return new_kv(xp, shape, kv_type)
    host = (mapped_host_kv(shape, kv_type) if xp is not np and kv_type in DEVICE_RING_TYPES
            else None)
    return RingKV(xp, shape, kv_type, *split, host=host)


def mapped_host_kv(shape: tuple[int, int, int], kv_type: str):
    """Zeroed K or V rows of `kv_type` (f16 or q8_0) in pinned host memory mapped into the
    device's address space (the kernels read and write them in place over PCIe): (the rows, the
    device addresses of their arrays: the f16 rows', or q8_0's values' then scales')."""
    if kv_type == "f16":
        rows, ptr = mapped_host_rows(shape, np.float16)
        return rows, (ptr,)
    if kv_type == "q8_0":
        cells, heads, dim = shape
        if dim % Q8_BLOCK:
            raise ValueError(f"q8_0 K/V needs a head_dim that is a multiple of {Q8_BLOCK}, "
                             f"got {dim}")
        q, q_ptr = mapped_host_rows(shape, np.int8)
        scale, scale_ptr = mapped_host_rows((cells, heads, dim // Q8_BLOCK), np.float16)
        return Q8Rows(np, shape, arrays=(q, scale)), (q_ptr, scale_ptr)
    raise ValueError(f"no mapped host copy of {kv_type!r} K/V (the GPU ring keeps "
                     f"{' or '.join(DEVICE_RING_TYPES)})")


def mapped_host_rows(shape: tuple[int, ...], dtype=np.float16):
    """A zeroed array of `dtype` in pinned host memory mapped into the device's address space:
    (the numpy array, its device address); the memory is freed with the array."""
    import ctypes
    import weakref

    import cupy as cp
    from .host_mapped import HOST_ALLOC_MAPPED, HOST_ALLOC_PORTABLE
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    ptr = int(cp.cuda.runtime.hostAlloc(nbytes, HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED))
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    rows = np.frombuffer(buf, dtype=dtype).reshape(shape)
    rows[...] = 0
    weakref.finalize(buf, cp.cuda.runtime.freeHost, ptr)    # once no view of it is left
    return rows, int(cp.cuda.runtime.pointerGetAttributes(ptr).devicePointer)


def kv_host_nbytes(stores) -> int:
    """Bytes of host copies among a session's K/V stores (its `kv_rows()`; 0: every cell resident):
    what --kv-resident keeps beyond the device, priced by plan.pricing.session_parts' kv_host."""
    return sum(int(getattr(a, "host_nbytes", 0)) for a in stores)


def _copy_cells(xp, dst, dst_idx, src, src_idx) -> None:
    """dst[dst_idx] = src[src_idx], cell by stored cell, dst on the array module xp (a q8_0
    store's quants and scales as they are, never decoded and quantized again)."""
    if isinstance(dst, Q8Rows):
        dst.q[dst_idx] = xp.asarray(src.q[src_idx])
        dst.scale[dst_idx] = xp.asarray(src.scale[src_idx])
    else:
        dst[dst_idx] = xp.asarray(src[src_idx])


class RingKV:
    """K or V rows [cells, heads, head_dim] of one layer of a session that keeps only S + R cells
    on the card (`--kv-resident`): a write-through host copy of every cell, and on the card the
    first S cells (the sinks) and a ring of the newest R.

    Writing cell p writes the host copy and the card: p < S to slot p, else to ring slot
    S + (p - S) % R. Reading cells [a, b) takes cell p from the card when p < S or
    p >= end - R, `end` the end of the latest write (the session's newest cell), else from the
    host copy; a step's attention reads [0, end) right after writing its rows, so its own rows and
    the R - n before them come from the ring. A write that does not continue the last one (a
    session rewound to a shorter prefix, a rolled back window, a restored conversation) first
    refills the ring with the R cells before it from the host copy: the slots may hold cells of
    the abandoned continuation. Only slices of cells are indexed (what the sessions do).

    The host copy is numpy: on a device, `host` = (rows, device addresses) from mapped_host_kv
    (f16 rows, or q8_0's values and scales), which a GPU decode graph's kernels write and read in
    place by the same rule (kernels/attention.cuh KvRing); `before_step` / `after_step` keep
    `end` and the ring right around such a step. A prompt chunk goes through __setitem__ /
    __getitem__ (the general path): q8_0 rows are quantized once (on the device, Q8Rows: the
    kernels' arithmetic) into the host copy, and its values and scales copied to the card and
    back as they are."""

    def __init__(self, xp, shape: tuple[int, int, int], kv_type: str, sinks: int, ring: int,
                 host=None):
        cells, heads, dim = shape
        if ring < 1 or sinks < 0 or sinks + ring >= cells:
            raise ValueError(f"a ring of {ring} cells beside {sinks} sinks for {cells} cells")
        self.xp, self.shape, self.sinks, self.ring = xp, tuple(shape), sinks, ring
        self.host, ptrs = host if host is not None else (new_kv(np, shape, kv_type), ())
        # the host copy's device addresses (0: not mapped): its rows, or q8_0's values, then
        # q8_0's scales
        self.host_device_ptr, self.host_scale_device_ptr = (tuple(ptrs) + (0, 0))[:2]
        self.card = new_kv(xp, (sinks + ring, heads, dim), kv_type)
        self.dtype = self.card.dtype
        self.end = 0            # the end of the latest write: the ring holds [end - R, end)

    @property
    def nbytes(self) -> int:
        """What the store takes on the card (the host copy: host_nbytes)."""
        return int(self.card.nbytes)

    @property
    def host_nbytes(self) -> int:
        return int(self.host.nbytes)

    @property
    def data(self):
        """The device part's memory (the pointer table's k / v entry of a decode graph)."""
        return self.card.data

    @property
    def q(self):
        """q8_0: the device part's int8 values (the pointer table's k / v entry)."""
        return self.card.q

    @property
    def scale(self):
        """q8_0: the device part's scales (the pointer table's K_SCALES / V_SCALES entry)."""
        return self.card.scale

    def __len__(self) -> int:
        return self.shape[0]

    def slots(self, positions: np.ndarray) -> np.ndarray:
        """The card slot of each cell position."""
        s = self.sinks
        return np.where(positions < s, positions, s + (positions - s) % self.ring)

    def on_card(self, positions: np.ndarray) -> np.ndarray:
        """Which of these cells a read takes from the card (the index rule above)."""
        return (positions < self.sinks) | ((positions >= self.end - self.ring)
                                           & (positions < self.end))

    def _cells(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"RingKV is indexed by slices of cells, got {key!r}")
        return np.arange(*key.indices(self.shape[0]))

    def _to_card(self, positions: np.ndarray) -> None:
        if positions.size:
            _copy_cells(self.xp, self.card, self.xp.asarray(self.slots(positions)), self.host,
                        positions)

    def before_step(self, pos: int) -> None:
        """A device step writes cells from `pos` on: the ring first holds the R before it."""
        if pos != self.end:
            self._to_card(np.arange(max(self.sinks, pos - self.ring), pos))
            self.end = pos

    def after_step(self, end: int) -> None:
        """The device step wrote cells up to `end` into both copies."""
        self.end = end

    def __setitem__(self, key: slice, rows) -> None:
        pos = self._cells(key)
        if not pos.size:
            return
        a, b = int(pos[0]), int(pos[-1]) + 1
        if a != self.end:     # not the next cells: the ring's history before a is the host's
            self._to_card(np.arange(max(self.sinks, a - self.ring), a))
        if self.xp is np:
            self.host[a:b] = rows
        elif isinstance(self.host, Q8Rows):
            # quantized on the device, as a store of every cell on the card is (the same
            # blocks), and only the values and scales come over
            blocks = Q8Rows(self.xp, (b - a, *self.shape[1:]))
            blocks[0:b - a] = rows
            self.host.q[a:b] = self.xp.asnumpy(blocks.q)
            self.host.scale[a:b] = self.xp.asnumpy(blocks.scale)
        else:
            self.host[a:b] = self.xp.asnumpy(rows)
        keep = pos[(pos < self.sinks) | (pos >= b - self.ring)]   # the newest R survive
        self._to_card(keep)
        self.end = b

    def __getitem__(self, key: slice):
        pos = self._cells(key)
        xp = self.xp
        if isinstance(self.host, Q8Rows) and xp is not np:
            # q8_0's values and scales go to the device as they are (about half of f16's bytes)
            # and are decoded there, not into float32 on the host first
            out = q8_decode(xp, xp.asarray(self.host.q[key]), xp.asarray(self.host.scale[key]))
        else:
            out = xp.array(self.host[key])          # a copy: the card's cells go over it
        card = self.on_card(pos)
        if card.any():
            at = pos[card]
            out[self.xp.asarray(np.nonzero(card)[0])] = self.card[self.xp.asarray(self.slots(at))]
        return out


class DeviceRing:
    """A GPU decode graph's side of --kv-resident (backends/cuda_decode.py, next_decode.py) for
    `model`: whether its sessions keep RingKV stores of (S sinks, R ring cells) for `max_cells`
    cells, the suffix of the kernel builds that write and read them (kernels/attention.cuh KvRing,
    next_attention.cuh; f16, or q8_0 with the `_q8` builds' suffix before it), the pointer
    table's words after the RoPE tables, and the stores' `end` around each step. Falsy when every
    cell is resident: then it changes nothing."""

    ARCHS = ("qwen3moe", "qwen3next")      # the architectures with `_ring` builds
    KV_TYPES = DEVICE_RING_TYPES           # the K/V types they read

    def __init__(self, model, max_cells: int):
        backend = model.backend
        self.split = kv_split(max_cells, backend.kv_resident)
        self.q8 = backend.kv_type == "q8_0"
        why = ("" if not self.split else
               f"K/V kept as {backend.kv_type}" if backend.kv_type not in self.KV_TYPES else
               f"{model.g.arch}'s attention kernels" if model.g.arch not in self.ARCHS else "")
        if why:         # the general path then reads the stores by their own rule
            from .graph_tables import Unsupported
            raise Unsupported(f"{why} with --kv-resident (the ring builds are "
                              f"{' and '.join(self.ARCHS)}'s, "
                              f"{' or '.join(self.KV_TYPES)})")
        self.suffix = "_ring" if self.split else ""
        is_linear = getattr(model.g, "is_linear", None)     # qwen3next's layers without K/V
        self.kv_layers = [l for l in range(model.lb, model.le)
                          if is_linear is None or not is_linear(l)]

    def __bool__(self) -> bool:
        return self.split is not None

    def words(self, n_layers: int, q8: str) -> int:
        """The pointer table's words after k, v and the RoPE tables (kernels/attention.cuh):
        q8_0's scales (`q8` set), then with a ring the host copies of k and v (with q8_0, of their
        values and then of their scales) and the geometry word."""
        scales = 2 * n_layers if q8 else 0
        if not self.split:
            return scales
        return scales + (4 if q8 else 2) * n_layers + 1

    def table_tail(self, kv: list) -> list[int]:
        """The ring's words for a session's stores `kv` (two a layer slot in the table's order;
        None for the slots of a layer without K/V, a qwen3next linear layer's: 0): the host
        copies' device addresses (q8_0: the values', then the scales'), then S | R << 32. They
        follow q8_0's scales, which the caller puts after the RoPE tables."""
        if not self.split:
            return []
        sinks, ring = self.split
        words = [a.host_device_ptr if a is not None else 0 for a in kv]
        if self.q8:
            words += [a.host_scale_device_ptr if a is not None else 0 for a in kv]
        for a in kv:        # the kernels would read and write address 0
            if a is not None and not (a.host_device_ptr and (a.host_scale_device_ptr
                                                             or not self.q8)):
                raise ValueError(f"a ring store of {a.shape} has no mapped host copy for the "
                                 f"decode graph's kernels (host addresses {a.host_device_ptr:#x}"
                                 f", scales {a.host_scale_device_ptr:#x})")
        return words + [sinks | ring << 32]

    def step(self, session, lb: int, le: int, pos: int, n: int) -> None:
        """Before a step writes cells [pos, pos + n) of `session` on the device: a store of the
        layers [lb, le) with K/V rewound refills its ring from the host copy first (on the default
        stream, which the step waits for), and every such store then ends at pos + n."""
        if self.split:
            for layer in self.kv_layers:
                if lb <= layer < le:
                    for a in (session.k(layer), session.v(layer)):
                        a.before_step(pos)
                        a.after_step(pos + n)
