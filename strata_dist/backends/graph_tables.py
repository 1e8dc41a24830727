"""The decode graphs' argument tables (backends/cuda_decode.py, next_decode.py): a dense matrix
as the kernels see it, the MatSpec rows of the matvec launches, and the checks that a tensor is
kept in a form the kernels read (else `Unsupported`: the stage takes the general path)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import cupy as cp

from ..kernels.abi import F16, F32, KERNEL_TYPES, MAT_SPEC
from ..ops.expert_addresses import Unsupported  # noqa: F401 (the graphs import it from here)
from ..ops.linear import QuantMatrix
from ..ops.tables import spec_array as _spec_array   # the graphs (and GPU tests) take it here


@dataclass(frozen=True)
class Weight:
    """A dense matrix as the kernels see it: device pointer, GGML type, bytes per row, shape."""
    ptr: int
    type: int
    row_bytes: int
    nrows: int
    ncols: int


def weight_of(w, name: str) -> Weight:
    if isinstance(w, QuantMatrix):
        out = Weight(int(w.raw.data.ptr), w.ggml_type, w.row_bytes, *w.shape)
    elif isinstance(w, cp.ndarray) and w.ndim == 2 and w.flags.c_contiguous and \
            w.dtype in (np.float16, np.float32):
        out = Weight(int(w.data.ptr), F16 if w.dtype == np.float16 else F32,
                     w.shape[1] * w.itemsize, *w.shape)
    else:
        raise Unsupported(f"{name}: kept as {type(w).__name__}, which no decode kernel reads")
    align = KERNEL_TYPES.get(out.type)
    if align is None or out.ncols % 32 or out.ptr % align or out.row_bytes % align:
        raise Unsupported(f"{name}: type {out.type} / {out.ncols} columns is not readable by the "
                          f"decode kernels")
    return out


def norm_vector(v, name: str):
    """A norm weight as the kernels read it (float32, contiguous, 16-byte aligned: read 8 at a
    time)."""
    if not (isinstance(v, cp.ndarray) and v.dtype == np.float32 and v.flags.c_contiguous
            and v.data.ptr % 16 == 0):
        raise Unsupported(f"{name}: kept as {getattr(v, 'dtype', type(v).__name__)}, which the "
                          f"decode kernels do not read")
    return v


def _mat(w: Weight, y, add=None) -> dict:
    """A MatSpec row: W times the input rows into y (one output row per W row), plus `add`."""
    return dict(w=w.ptr, y=int(y.data.ptr), add=0 if add is None else int(add.data.ptr),
                row_bytes=w.row_bytes, nrows=w.nrows, ncols=w.ncols, y_stride=w.nrows, type=w.type)


@dataclass(frozen=True)
class MatLaunch:
    """Matrices of one type that share a matvec launch (blockIdx.y picks the matrix)."""
    type: int
    specs: object           # device MatSpec table
    count: int
    rows: int               # the tallest matrix's rows


def mat_launches(pairs: list[tuple[Weight, dict]]) -> list[MatLaunch]:
    """(weight, MatSpec row) pairs grouped by type, one launch per type (q, k and v are one launch
    unless a file stores them in different types)."""
    by_type: dict[int, list] = {}
    for w, row in pairs:
        by_type.setdefault(w.type, []).append((w, row))
    return [MatLaunch(t, _spec_array(MAT_SPEC, [row for _, row in group]), len(group),
                      max(w.nrows for w, _ in group)) for t, group in by_type.items()]


def repoint_experts(graph, addresses) -> None:
    """The stage's expert-address table built again after blobs moved (the adaptive cache swapped
    them, strata_dist/experts/adapt.py; ops/expert_addresses.py): the entries of a settled
    decode graph's address table that changed are written, and its hit masks and table taken
    from the new one (whose builder refused a pair read nowhere: Unsupported). The entries are
    written on the null stream, which every step waits for (cuda_decode.DecodeGraph._launch_step),
    so no step reads an entry before the blob copies queued there before it."""
    old = graph.addresses
    if (addresses.lb, addresses.le) != (old.lb, old.le) or addresses.blob_of.shape != \
            old.blob_of.shape:
        raise ValueError(f"a table of layers [{addresses.lb}, {addresses.le}) "
                         f"{list(addresses.blob_of.shape)} cannot repoint a graph of layers "
                         f"[{old.lb}, {old.le}) {list(old.blob_of.shape)}")
    changed = zip(*np.nonzero((addresses.blob_of != old.blob_of) | (addresses.tier != old.tier)))
    with cp.cuda.Stream.null:
        for layer, expert in changed:
            at = addresses.blob_of[layer, expert]
            align = graph.blob_align[int(layer)]
            if int(at) % align:
                raise Unsupported(f"pair ({layer}, {expert}) moved to {int(at):#x}, not aligned "
                                  f"on {align} bytes for the expert kernels")
            graph.blob_of[layer, expert] = np.uint64(at)
    graph.addresses = addresses
    graph.in_cache, graph.in_helper = addresses.in_cache(), addresses.in_helper()


def count_tiers(graph, n: int, routes) -> dict[str, int]:
    """A decode graph's step of n rows: its expert computations by where the blob was, from its
    routes [stage layers, >= n, k]: the cache, this card's helper tier ("remote", as the general
    path counts a helper's) or host memory."""
    total = n * graph.g.n_expert_used * (graph.le - graph.lb)
    if not graph.counts_routes:
        return {"hits": total, "remote": 0, "host": 0}
    ids = routes[:, :n]                               # [stage layers, n, k]
    layer = np.arange(graph.le - graph.lb)[:, None, None]
    chosen, asked = np.clip(ids, 0, None), ids >= 0
    hits = int(graph.in_cache[layer, chosen][asked].sum())
    helper = int(graph.in_helper[layer, chosen][asked].sum())
    return {"hits": hits, "remote": helper, "host": int(asked.sum()) - hits - helper}
