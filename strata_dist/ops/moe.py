"""The MoE op: a layer's routed experts, on the GPU, in one place: the prompt path's row kernels,
the decode graph's two expert launches (`graph_experts`, their table `expert_spec`; qwen3next's
shared expert, `graph_shared_expert`) and the weighted combine of a chunk's ranked outputs
(`combine_ranked`). Which path a call takes: the row kernels where their layout reads the
layer's blobs (`RowsKernels.run` and the routed calls answer False / None otherwise, the reason
logged once, and the backend takes the general path: a dequantize and GEMMs an expert); the
decode graph's kernels where the graph runs (backends/cuda_decode.py).

Experts over many rows on the GPU: every (row, rank) pair of a layer sorted by expert and cut
into work items, then two expert launches for the whole layer (kernels/experts_rows.cu; the
tensor-core build rounds each launch's input rows to f16 first, `rows_to_half`) instead of a
dequantize and three GEMMs per expert. Each output is summed in one fixed order over the
columns, whatever else shares its work item, so a pair's bits do not depend on how the pairs were
grouped, which tier held the blob, or the chunk.

Two builds of the same kernels: on tensor cores (mma.sync, rows and weights rounded to f16 in
shared memory as cuBLAS's f16 products round them; the default) and in float32 FMA
(STRATA_ROWS_MMA=0). The GPU default (CupyBackend; STRATA_GROUPED_EXPERTS=0: the general path).
Unless STRATA_DEVICE_ROUTING=0, a chunk is routed (`route`) and, where a layer's experts are all
resident, grouped (`run_routed`) on the device: no host round trip a layer."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

try:
    import cupy as cp
except ImportError:   # the decode graph's launchers need none: backends/graph_ops.py imports
    cp = None         # them where CuPy is not (tests/test_model_interface.py reads its ops)

from ..compute_options import compute_options, fall_back
from ..kernels import function
from ..kernels.abi import (BLOCK_THREADS, MAX_GROUP_EXPERTS, ROWS_TILE_K, ROWS_TILE_M,
                           ROWS_TILE_N, TYPE_NAMES, ExpertLayout, expert_layout,
                           rows_mma_shared_bytes)
from .expert_addresses import Unsupported
from .guards import MAX_GRID_Y, OPS_THREADS, f32_rows, first_failed
from .route import route_rows

KERNELS = "experts_rows.cu"
TILE_M, TILE_N, TILE_K = ROWS_TILE_M, ROWS_TILE_N, ROWS_TILE_K


# what a chunk's experts fall back from (to the general path: a dequantize and GEMMs an expert)
ROWS_PATH = "the row kernels of a prompt chunk's experts (grouped_experts)"


def layer_experts(gguf, layer: int) -> ExpertLayout | None:
    """The layout of `layer`'s blobs, or None when the row kernels cannot read them."""
    try:
        lay = expert_layout(gguf, layer)
    except ValueError:
        return None
    return None if lay.n_ff % TILE_K or lay.n_embd % TILE_K else lay


def layout_refusal(gguf, layer: int) -> str:
    """Why the row kernels cannot read `layer`'s blobs ("" when they can)."""
    try:
        lay = expert_layout(gguf, layer)
    except ValueError as e:
        return str(e)
    return first_failed(((not (lay.n_ff % TILE_K or lay.n_embd % TILE_K),
                          f"experts of {lay.n_embd} -> {lay.n_ff} columns (the row kernels "
                          f"take multiples of {TILE_K})"),))


@dataclass
class RoutedPairs:
    """One layer's pairs as `RowsKernels.group_routed` left them on the device: sorted pairs'
    input and output rows, the work items, the input rows as the launches read them, and each
    expert's pair count (group_counts)."""
    spec: ExpertLayout
    rows: object
    dest: object
    items: object
    n_pairs: int
    rows_in: tuple
    counts: object
    y: object = None      # the outputs [n, k, n_embd] the backend gives them (cupy_backend.py)


class RowsKernels:
    def __init__(self, device: int, mma: bool | None = None, backend=None):
        """`backend`: the CupyBackend whose prompt workspace the launches' buffers come from
        while a chunk runs (None: new arrays, as for the benchmarks and kernel tests). `mma`: the
        tensor-core build (default: the record in force, ComputeOptions.rows_mma)."""
        self.device = device
        self.backend = backend
        self.mma = compute_options().rows_mma if mma is None else mma
        self._layers: dict[tuple[str, int], ExpertLayout | None] = {}
        self._kernels: dict[tuple[str, int, int], tuple[object, int]] = {}

    def _buf(self, name: str, shape, dtype):
        if self.backend is None:
            return cp.empty(shape, dtype=dtype)
        return self.backend.buffer(name, shape, dtype)

    def _upload(self, name: str, host: np.ndarray):
        return cp.asarray(host) if self.backend is None else self.backend.upload(name, host)

    def _layout(self, gguf, layer: int) -> ExpertLayout | None:
        key = (gguf.path, layer)
        if key not in self._layers:
            self._layers[key] = layer_experts(gguf, layer)
            if self._layers[key] is None:
                fall_back(ROWS_PATH, layout_refusal(gguf, layer))
        return self._layers[key]

    def layout(self, gguf, layer: int) -> ExpertLayout | None:
        """How the row kernels read `layer`'s expert blobs (kernels/abi.py ExpertLayout), or None
        when they do not."""
        return self._layout(gguf, layer)

    def swiglu(self, gguf, layer: int, blob, x):
        """SwiGLU of the expert `blob` (a device uint8 array) on every row of x, a new array; None
        when the kernels cannot take this layer or this blob (the general path's then)."""
        n = int(x.shape[0])
        out = cp.empty((n, int(x.shape[1])), dtype=cp.float32)
        every = np.arange(n)
        return out if self.run(gguf, layer, x, [(blob, every, every)], out) else None

    def routed(self, gguf, layer: int, x, ids, addresses: np.ndarray):
        """y [n, k, n_embd] of the device-routed ids [n, k] when every expert's blob address is in
        `addresses` (host uint64 [n_expert]) and the row kernels read this layer, else None."""
        spec = self._layout(gguf, layer)
        if spec is None:
            return None
        if (addresses % np.uint64(spec.align)).any():
            fall_back(ROWS_PATH, f"expert blobs not aligned on {spec.align} bytes")
            return None
        pairs = self.routed_pairs(gguf, layer, x, ids, len(addresses))
        if pairs is None:
            return None
        self.compute_routed(pairs, addresses)
        return pairs.y

    def routed_pairs(self, gguf, layer: int, x, ids, n_expert: int):
        """The device-routed pairs of ids [n, k] grouped by expert (RoutedPairs, with `y`, the
        [n, k, n_embd] outputs `compute_routed` writes), or None when the row kernels do not read
        this layer."""
        spec = self._layout(gguf, layer)
        if spec is None:
            return None
        why = first_failed((
            (int(x.shape[1]) == spec.n_embd,
             f"rows of {int(x.shape[1])} columns for experts of {spec.n_embd}"),
            (n_expert <= MAX_GROUP_EXPERTS,
             f"{n_expert} experts (the grouping kernels take at most {MAX_GROUP_EXPERTS})")))
        if why:
            fall_back(ROWS_PATH, why)
            return None
        pairs = self.group_routed(spec, x, ids, n_expert)
        n, k = (int(v) for v in ids.shape)
        pairs.y = self._buf("y", (n, k, spec.n_embd), cp.float32)
        return pairs

    def compute_routed(self, pairs: "RoutedPairs", addresses: np.ndarray) -> None:
        """Compute into pairs.y the pairs whose expert has a blob address in `addresses` (host
        uint64 [n_expert], each aligned to pairs.spec.align: the caller checks; 0: another
        call's)."""
        n, k, d = (int(v) for v in pairs.y.shape)
        self.compute_grouped(pairs, self._upload("blob_table", addresses),
                             pairs.y.reshape(n * k, d))

    def run(self, gguf, layer: int, x, jobs, out) -> bool:
        """out[dest] = SwiGLU of expert `blob` on x[rows], for each job (blob, rows, dest): blob a
        device uint8 array, rows and dest host integer arrays, out [m, n_embd] float32. False
        (nothing done) when the kernels cannot take this layer or these blobs."""
        spec = self._layout(gguf, layer)
        return spec is not None and self.run_spec(spec, x, jobs, out)

    def run_spec(self, spec: ExpertLayout, x, jobs, out) -> bool:
        """`run` for blobs of the layout `spec`."""
        jobs = [(b, np.asarray(r), np.asarray(d)) for b, r, d in jobs if len(r)]
        if x.shape[1] != spec.n_embd:
            fall_back(ROWS_PATH, f"rows of {int(x.shape[1])} columns for experts of {spec.n_embd}")
            return False
        if not jobs:
            return True
        blobs = np.array([int(b.data.ptr) for b, _, _ in jobs], dtype=np.uint64)
        if (blobs % spec.align).any():
            fall_back(ROWS_PATH, f"expert blobs not aligned on {spec.align} bytes")
            return False
        items, start = [], 0
        for j, (_, rows, _) in enumerate(jobs):
            items += [(j, start + s, min(TILE_M, len(rows) - s), 0)
                      for s in range(0, len(rows), TILE_M)]
            start += len(rows)
        # one upload for the index tables: items, then each pair's input row, then its output row
        pack = np.concatenate([np.asarray(items, dtype=np.int32).ravel()]
                              + [r.astype(np.int32) for _, r, _ in jobs]
                              + [d.astype(np.int32) for _, _, d in jobs])
        with cp.cuda.Device(self.device):
            pack_d, blobs_d = self._upload("pack", pack), self._upload("pack_blobs", blobs)
            n_items, pairs = len(items), start
            items_d = pack_d[:4 * n_items]
            rows_d = pack_d[4 * n_items:4 * n_items + pairs]
            dest_d = pack_d[4 * n_items + pairs:]
            self._launch(spec, blobs_d, items_d, n_items, rows_d, dest_d, pairs, x, out)
        return True

    def _launch(self, spec: ExpertLayout, blobs, items, n_items: int, rows, dest, pairs: int, x,
                out) -> None:
        """The layer's two launches over `n_items` work items of `pairs` sorted pairs (rows[q],
        dest[q]: input row and output row of sorted pair q). The tensor-core build reads its rows
        as f16 (`rows_to_half`: x, then the SwiGLU outputs)."""
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        act = self._buf("act", (pairs, spec.n_ff), cp.float32)
        self.gate_up(spec, blobs, items, n_items, rows,
                     self._half(x, "x16", "x_unscale") if self.mma else (x,), act)
        self.down(spec, blobs, items, n_items, dest,
                  self._half(act, "act16", "act_unscale") if self.mma else (act,), out)

    def gate_up(self, spec: ExpertLayout, blobs, items, n_items: int, rows, rows_in, act) -> None:
        """act[q] = SwiGLU of sorted pair q's expert on its input row (rows_in: (x,) for the FMA
        build, (f16 rows, unscale) for the tensor-core build)."""
        fn, shared = self._fn("moe_gate_up_rows", spec.gate_type, 2)
        fn((n_items, math.ceil(spec.n_ff / TILE_N)), (256,),
           (blobs, items, rows, *rows_in, np.int32(spec.n_embd), np.int64(spec.up_at),
            np.int64(spec.gate_row_bytes), np.int64(spec.up_row_bytes), np.int32(spec.n_ff), act),
           shared_mem=shared)

    def down(self, spec: ExpertLayout, blobs, items, n_items: int, dest, act_in, out) -> None:
        """out[dest[q]] = sorted pair q's expert's down rows times its SwiGLU output (act_in as
        rows_in above)."""
        fn, shared = self._fn("moe_down_rows", spec.down_type, 1)
        fn((n_items, math.ceil(spec.n_embd / TILE_N)), (256,),
           (blobs, items, dest, *act_in, np.int32(spec.n_ff), np.int64(spec.down_at),
            np.int64(spec.down_row_bytes), np.int32(spec.n_embd), out), shared_mem=shared)

    def _half(self, a, name: str = "x16", unscale_name: str = "x_unscale"):
        """(f16 rows, their unscale) of float32 rows a [m, K] (experts_rows.cu rows_to_half), in
        the buffers of those names."""
        m, cols = (int(v) for v in a.shape)
        h = self._buf(name, (m, cols), cp.float16)
        unscale = self._buf(unscale_name, (m,), cp.float32)
        if m:
            function(KERNELS, "rows_to_half", self.device)((m,), (256,),
                                                          (a, np.int32(cols), h, unscale))
        return h, unscale

    def route(self, logits, k: int, normalize: bool):
        """(ids, wts) [n, k] on the device from router logits [n, n_expert] into this chunk's
        buffers (ops/route.py route_rows); None when a layer has more experts than the kernels
        take."""
        return route_rows(self.device, self._buf, logits, k, normalize)

    def run_routed(self, spec: ExpertLayout, x, ids, blob_table, out) -> None:
        """out[p] (p = row * k + rank, out [n * k, n_embd]) = SwiGLU of expert ids[row, rank] on
        x[row], every expert's blob address in `blob_table` (device uint64 [n_expert]); the pairs
        grouped on the device into the layout the host path builds (kernels/abi.py group_layout),
        so the bits are the same. Rows that picked no expert are left unwritten (their weight is
        NaN)."""
        self.compute_grouped(self.group_routed(spec, x, ids, int(blob_table.shape[0])),
                             blob_table, out)

    def group_routed(self, spec: ExpertLayout, x, ids, n_expert: int) -> "RoutedPairs":
        """A layer's device-routed pairs grouped by expert, and its input rows as the launches
        read them: computed by one `compute_grouped` (every blob resident) or by several, each
        with a table holding some of the experts (a partial cache's misses, a batch at a time)."""
        n, k = (int(v) for v in ids.shape)
        with cp.cuda.Device(self.device):
            rows, dest, items, counts = self._group(ids, n_expert)
            x = cp.ascontiguousarray(x, dtype=cp.float32)
            rows_in = self._half(x, "x16", "x_unscale") if self.mma else (x,)
        return RoutedPairs(spec, rows, dest, items, n * k, rows_in, counts)

    def compute_grouped(self, pairs: "RoutedPairs", blob_table, out) -> None:
        """out[p] for the grouped pairs whose expert has a blob in `blob_table` (device uint64
        [n_expert]; 0: not in this launch, its pairs left as they are)."""
        spec = pairs.spec
        with cp.cuda.Device(self.device):
            act = self._buf("act", (pairs.n_pairs, spec.n_ff), cp.float32)
            n_items = len(pairs.items)
            self.gate_up(spec, blob_table, pairs.items, n_items, pairs.rows, pairs.rows_in, act)
            self.down(spec, blob_table, pairs.items, n_items, pairs.dest,
                      self._half(act, "act16", "act_unscale") if self.mma else (act,), out)

    def group(self, ids, n_expert: int):
        """(rows, dest, items) of kernels/abi.py group_layout, built on the device from ids [n, k]:
        items [n * k / TILE_M + n_expert, 4], the unused ones with count 0 (the launches are sized
        before the counts exist on the host)."""
        return self._group(ids, n_expert)[:3]

    def _group(self, ids, n_expert: int):
        """`group`, and each expert's pair count (device int32 [n_expert])."""
        if not 0 < n_expert <= MAX_GROUP_EXPERTS:
            raise ValueError(f"{n_expert} experts: the grouping kernels take 1..{MAX_GROUP_EXPERTS}")
        n, k = (int(v) for v in ids.shape)
        pairs = n * k
        max_items = math.ceil(pairs / TILE_M) + n_expert
        i32 = np.int32
        g = lambda name: function(KERNELS, name, self.device)  # noqa: E731
        with cp.cuda.Device(self.device):
            ids = cp.ascontiguousarray(ids, dtype=cp.int32)
            rank, rows, dest = (self._buf(name, (pairs,), cp.int32)
                                for name in ("pair_rank", "pair_rows", "pair_dest"))
            counts = self._buf("group_counts", (n_expert,), cp.int32)
            starts = self._buf("group_starts", (n_expert,), cp.int32)
            items = self._buf("items", (max_items, 4), cp.int32)
            g("group_count")((n_expert,), (32,), (ids, i32(pairs), rank, counts))
            g("group_items")((1,), (256,), (counts, i32(n_expert), i32(max_items), starts, items))
            if pairs:
                g("group_scatter")((math.ceil(pairs / 256),), (256,),
                                   (ids, i32(pairs), i32(k), i32(n_expert), rank, starts, rows,
                                    dest))
        return rows, dest, items, counts

    def _fn(self, kind: str, ggml_type: int, nmat: int):
        """(kernel, its dynamic shared bytes): the tensor-core build copies its weight stages into
        shared memory past the default 48 KiB, which the kernel has to be allowed once."""
        key = (kind, ggml_type, nmat)
        if key not in self._kernels:
            if not self.mma:
                self._kernels[key] = (
                    function(KERNELS, f"{kind}_{TYPE_NAMES[ggml_type]}", self.device), 0)
            else:
                fn = function(KERNELS, f"{kind}_mma_{TYPE_NAMES[ggml_type]}", self.device)
                shared = rows_mma_shared_bytes(ggml_type, nmat)
                fn.max_dynamic_shared_size_bytes = shared
                self._kernels[key] = (fn, shared)
        return self._kernels[key]


def combine_ranked(backend, y, wts):
    """sum over ranks of y [n, k, d] times wts [n, k] in rank order as one launch (prompt_ops.cu
    combine_ranked) into the backend's buffer moe_out; None (the reason logged once) where the
    kernel does not read these arrays (the array path's then)."""
    rows = int(y.shape[0]) if y.ndim else 0
    why = first_failed((
        (f32_rows(y) and f32_rows(wts), "outputs or weights not contiguous float32 device rows"),
        (y.ndim == 3 and wts.shape == y.shape[:2],
         f"outputs {tuple(y.shape)} and weights {tuple(wts.shape)} are not [n, k, d] and [n, k]"),
        (rows <= MAX_GRID_Y, f"{rows} rows (a launch takes at most {MAX_GRID_Y})")))
    if why:
        fall_back("the fused combine of a prompt chunk's experts (fused_prompt_ops)", why)
        return None
    n, k, d = (int(v) for v in y.shape)
    out = backend.buffer("moe_out", (n, d), cp.float32)
    if n:
        function("prompt_ops.cu", "combine_ranked", backend.index)(
            (-(-d // OPS_THREADS), n), (OPS_THREADS,), (y, wts, np.int32(k), np.int32(d), out))
    return out


# ---- the decode graph's routed experts ----------------------------------------------------------
def expert_spec(graph, layer: int) -> dict:
    """A layer's ExpertSpec row (kernels/abi.py EXPERT_SPEC) for the decode graph's expert
    kernels: where the graph's blob table holds the layer's addresses, and the blob layout;
    Unsupported when the blobs are not aligned for the kernels."""
    g = graph.g
    try:
        lay = expert_layout(graph.model.gguf, layer)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    graph.blob_align[layer] = lay.align     # what a table repointed later is held to
    if (graph.addresses.blob_of[layer] % np.uint64(lay.align)).any():
        raise Unsupported(f"blk.{layer}: expert blobs are not aligned on {lay.align} bytes "
                          f"for the expert kernels")
    return dict(blob_of=int(graph.blob_of.data.ptr) + 8 * layer * g.n_expert,
                up_at=lay.up_at, down_at=lay.down_at, gate_row_bytes=lay.gate_row_bytes,
                up_row_bytes=lay.up_row_bytes, down_row_bytes=lay.down_row_bytes,
                gate_type=lay.gate_type, up_type=lay.up_type, down_type=lay.down_type,
                n_ff=g.n_ff_exp, n_embd=g.n_embd, k=g.n_expert_used)


def graph_experts(graph, spec: dict, routed, h, n: int) -> None:
    """The decode graph's routed experts over n rows, two launches: moe_gate_up_<type> (each
    chosen expert's gate and up rows on `routed`, the router's normed rows, SwiGLU into the
    graph's act), then moe_down_<type> adding each expert's down rows times its weight into h
    (the residual). Their grids' blocks over n_ff and n_embd are the kernel shape's (KernelShape
    gate_up_block / down_block, by the layer's expert types)."""
    g, f, shape = graph.g, graph._launch, graph.shape
    gate_up, down = spec["expert_types"]
    gate_codes, down_codes = spec["expert_codes"]
    ff, out = shape.gate_up_block(gate_codes), shape.down_block(down_codes)
    f(f"moe_gate_up_{gate_up}")(((g.n_ff_exp + ff - 1) // ff, g.n_expert_used, n),
                                (BLOCK_THREADS,),
                                (spec["experts"], routed, graph.blobs, graph.act))
    f(f"moe_down_{down}")(((g.n_embd + out - 1) // out, n), (BLOCK_THREADS,),
                          (spec["experts"], graph.act, graph.blobs, graph.wts, h))


def graph_shared_expert(graph, spec: dict, routed, n: int) -> None:
    """qwen3next's shared expert over the rows the router's matvec normed (`routed`: the graph's
    xn), adding into the residual: its gate, up and one-row gate logit in one matvec launch a
    type, next_shexp_act (SwiGLU times the sigmoid of that logit), then ffn_down_shexp."""
    g, sh = graph.g, graph.g.n_ff_shexp
    graph._matvec(spec["shexp_in"], routed, g.n_embd, n)
    graph._launch("next_shexp_act")((-(-sh // BLOCK_THREADS), n), (BLOCK_THREADS,),
                                    (graph.shexp_gu, graph.shexp_logit, np.int32(sh),
                                     graph.shexp_act))
    graph._matvec(spec["shexp_down"], graph.shexp_act, sh, n)
