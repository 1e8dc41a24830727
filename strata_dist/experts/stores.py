"""Expert stores: where a (layer, expert)'s weights come from and how its SwiGLU is computed.

Every store hands the expert's blob (gate, up, down as stored in the file) to the backend's
`expert_swiglu` / `experts_swiglu` (decoded by `expert_weights`, then the backend's `swiglu`;
or, on a GPU unless STRATA_GROUPED_EXPERTS=0, the row kernels of ops/moe.py) — so a
(token, expert) output is the same bits whichever store computed it, and whatever other rows
shared the call (the batch-invariance rule of docs/DEVELOPING.md, "Conventions")."""
from __future__ import annotations

import numpy as np

from .host_pinning import reads_host_in_place


def stored_rows_jobs(idx: np.ndarray, mask: np.ndarray, blob_of) -> list:
    """The jobs of backend.experts_swiglu for the (row, rank) pairs of `mask`, one per expert:
    (its blob, the rows, the flat output rows row * k + rank of an [n * k, d] output)."""
    k = idx.shape[1]
    # the pairs' flat positions row * k + rank, grouped by expert in one stable sort (each
    # group keeps row-major order) instead of one scan of idx per expert
    flat = np.flatnonzero(mask)
    experts = idx.ravel()[flat]
    order = np.argsort(experts, kind="stable")
    flat, experts = flat[order], experts[order]
    starts = np.flatnonzero(np.diff(experts, prepend=experts[:1] - 1)) if len(flat) else []
    bounds = list(starts) + [len(flat)]
    jobs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        pos = flat[a:b]
        jobs.append((blob_of(int(experts[a])), pos // k, pos))
    return jobs


class ExpertStore:
    """compute(layer, expert, x) -> outputs of the rows x routed to that expert."""

    def compute(self, layer: int, expert: int, x):
        raise NotImplementedError

    def outputs_device(self, layer: int, x, idx):
        """`outputs` for routing held on the device (idx a device array), without bringing it
        to the host, or None where this store cannot (the caller then brings it over)."""
        return None

    def outputs(self, layer: int, x, idx: np.ndarray):
        """y[row, rank] = expert idx[row, rank] applied to x[row], unweighted."""
        xp = self.backend.xp
        n, k = idx.shape
        y = xp.zeros((n, k, x.shape[1]), dtype=np.float32)
        for expert in np.unique(idx):
            rows, ranks = np.nonzero(idx == expert)
            sel = self.backend.asarray(rows)
            y[sel, self.backend.asarray(ranks)] = self.compute(layer, int(expert), x[sel])
        return y

    @property
    def misses_read_in_place(self) -> bool:
        """Whether a GPU decode graph over this store pins the experts its cache lacks in host
        memory and reads them there (host_pinning.reads_host_in_place of this store). The table's
        builder (experts/addresses.py) asks it, so that backends need not know the tiers' policy."""
        return reads_host_in_place(self)


class HostTier(ExpertStore):
    """Experts read from the model file when used (a GPU rank streams the stored blob to the
    device first and decodes it there, with the same kernel as a cache hit)."""

    def __init__(self, backend, gguf):
        self.backend, self.gguf = backend, gguf

    def compute(self, layer: int, expert: int, x):
        blob = self.backend.stage_blob(self.gguf.expert_blob(layer, expert))
        return self.backend.expert_swiglu(self.gguf, layer, blob, x)


class BlobArena(ExpertStore):
    """Expert blobs packed in one buffer (device memory on a GPU rank, host memory on a CPU rank),
    each in its stored format, plus the residency table pair -> slot (-1 when not resident)."""

    def __init__(self, backend, gguf, pairs, n_layers: int, n_experts: int,
                 exportable: bool = False):
        """`exportable` (a GPU helper tier): the blobs go into one allocation of their own, whose
        CUDA IPC handle other processes on the host open to read them in place (`ipc_export`)."""
        self.backend, self.gguf = backend, gguf
        self.ipc_export = None
        self.pairs = [(int(l), int(e)) for l, e in pairs]
        sizes = [gguf.blob_bytes(l) for l, _ in self.pairs]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.nbytes = int(self.offsets[-1])
        self.slot_of = np.full((n_layers, n_experts), -1, dtype=np.int32)
        host = np.empty(self.nbytes, dtype=np.uint8)
        for i, (layer, expert) in enumerate(self.pairs):
            if self.slot_of[layer, expert] >= 0:
                raise ValueError(f"pair ({layer}, {expert}) is listed twice")
            host[self.offsets[i]:self.offsets[i + 1]] = gguf.expert_blob(layer, expert)
            self.slot_of[layer, expert] = i
        if exportable and backend.on_gpu and self.nbytes:
            # an IPC handle names a whole allocation: not a block of CuPy's pool
            import cupy as cp
            from protocol.cuda_ipc import IpcExport
            from protocol.messages import RowSlot
            self.ipc_export = IpcExport(self.nbytes, backend.index, "expert_tier")
            self.buf = self.ipc_export.view(RowSlot(offset=0, nbytes=self.nbytes), np.uint8,
                                            (self.nbytes,))
            cp.cuda.runtime.memcpy(int(self.buf.data.ptr), int(host.ctypes.data), self.nbytes,
                                   cp.cuda.runtime.memcpyHostToDevice)
        else:
            self.buf = backend.asarray(host)
        # the residency table also lives on the device, for kernels that route there
        self.slot_of_device = backend.asarray(self.slot_of)
        self.lent: list[int] = []      # slots lent to the prompt path (their pairs not resident)

    # ---- prompt loans: the tail of the cache, lent for a prompt and refilled after -----------
    def lend_tail(self, n_slots: int) -> int:
        """Lend the last n_slots slots (the coldest pairs: the cache is in rank order) to the
        prompt path; their pairs stop being resident. Returns the bytes lent."""
        if self.lent or n_slots <= 0:
            return self.loan_bytes
        first = max(0, len(self.pairs) - n_slots)
        self.lent = list(range(first, len(self.pairs)))
        for i in self.lent:
            layer, expert = self.pairs[i]
            self.slot_of[layer, expert] = -1
        self._sync_residency()
        return self.loan_bytes

    @property
    def loan_bytes(self) -> int:
        return int(self.nbytes - self.offsets[self.lent[0]]) if self.lent else 0

    def loan_region(self):
        """The lent bytes as one buffer: staging space for experts streamed during a prompt."""
        return self.buf[int(self.offsets[self.lent[0]]):self.nbytes] if self.lent else None

    def refill(self, pinned=None) -> int:
        """Put every lent slot's own pair back and mark it resident again: from its pinned host
        copy where `pinned` (backends/host_mapped.py MappedHostBlobs) holds it (a DMA queued on
        the current stream), else from the model file. Only this arena's slots and only its own
        pairs: a slot refilled into another cache, or another stage's rows marked, would still
        produce fluent tokens."""
        if not self.lent:
            return 0
        n = len(self.lent)
        for i in self.lent:
            layer, expert = self.pairs[i]
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            if pinned is not None and pinned.holds(layer, expert):
                self.backend.copy_from_pinned(self.buf[lo:hi], pinned.host_address(layer, expert))
            else:
                self.buf[lo:hi] = self.backend.asarray(
                    np.asarray(self.gguf.expert_blob(layer, expert)))
            self.slot_of[layer, expert] = i
        self.lent = []
        self._sync_residency()
        return n

    def swap(self, pairs, pinned=None) -> int:
        """The adaptive cache's swaps (strata_dist/experts/adapt.py), [(evicted, taken), ...]: each taken
        pair's blob is copied into its evicted pair's slot (from its pinned host copy where
        `pinned` holds it, a DMA queued on the current stream, else from the model file), then
        the residency table points at it. The caller makes sure no step reads the cache while
        this runs (between steps, nothing lent). Returns the swaps made."""
        if self.lent:
            raise RuntimeError("the cache is lent to a prompt: no swap until it is refilled")
        done = 0
        for evict, take in pairs:
            (el, ee), (tl, te) = (int(v) for v in evict), (int(v) for v in take)
            i = int(self.slot_of[el, ee])
            if i < 0 or self.slot_of[tl, te] >= 0:
                raise ValueError(f"swap {evict} -> {take}: the first must be cached, the second "
                                 f"not")
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            if self.gguf.blob_bytes(tl) != hi - lo:
                raise ValueError(f"swap {evict} -> {take}: a {self.gguf.blob_bytes(tl)}-byte blob "
                                 f"does not fit a {hi - lo}-byte slot")
            # unmarked first: while the slot is being written it holds neither pair
            self.slot_of[el, ee] = -1
            if pinned is not None and pinned.holds(tl, te):
                self.backend.copy_from_pinned(self.buf[lo:hi], pinned.host_address(tl, te))
            else:
                self.buf[lo:hi] = self.backend.asarray(np.asarray(self.gguf.expert_blob(tl, te)))
            self.pairs[i] = (tl, te)
            self.slot_of[tl, te] = i
            done += 1
        if done:
            self._sync_residency()
        return done

    def _sync_residency(self) -> None:
        self.slot_of_device = self.backend.asarray(self.slot_of)

    def holds(self, layer: int, expert: int) -> bool:
        return bool(self.slot_of[layer, expert] >= 0)

    def blob(self, layer: int, expert: int):
        i = int(self.slot_of[layer, expert])
        if i < 0:
            raise KeyError(f"pair ({layer}, {expert}) is not resident")
        return self.buf[int(self.offsets[i]):int(self.offsets[i + 1])]

    def compute(self, layer: int, expert: int, x):
        return self.backend.expert_swiglu(self.gguf, layer, self.blob(layer, expert), x)

    def outputs(self, layer: int, x, idx: np.ndarray):
        """y[row, rank] = expert idx[row, rank] applied to x[row], unweighted: every expert of the
        call in one experts_swiglu."""
        n, k = idx.shape
        y = self.backend.buffer("y", (n, k, x.shape[1]), np.float32)
        y.fill(0)
        self.compute_into(layer, x, idx, np.ones(idx.shape, dtype=bool), y)
        return y

    def outputs_device(self, layer: int, x, idx):
        """Every expert of `layer` resident here: the backend groups and computes on the device."""
        addresses = self.blob_addresses(layer)
        if addresses is None:
            return None
        return self.backend.experts_routed(self.gguf, layer, x, idx, addresses)

    def blob_addresses(self, layer: int) -> np.ndarray | None:
        """Each expert's blob address of `layer` (host uint64 [n_experts]), or None when one is not
        resident (or the arena is host memory)."""
        if (self.slot_of[layer] < 0).any() or self.backend.xp is np:
            return None
        return self.held_addresses(layer)

    def held_addresses(self, layer: int) -> np.ndarray:
        """Each expert's blob address of `layer` in this (device) arena, 0 where it is not
        resident (host uint64 [n_experts])."""
        slots = self.slot_of[layer]
        held = slots >= 0
        out = np.zeros(len(slots), dtype=np.uint64)
        out[held] = (int(self.buf.data.ptr) + self.offsets[slots[held]]).astype(np.uint64)
        return out

    def compute_into(self, layer: int, x, idx: np.ndarray, mask: np.ndarray, y) -> None:
        """y[row, rank] for the pairs of `mask` (all resident here)."""
        jobs = stored_rows_jobs(idx, mask, lambda e: self.blob(layer, e))
        n, k, d = y.shape
        self.backend.experts_swiglu(self.gguf, layer, x, jobs, y.reshape(n * k, d))


def all_pairs(gguf, layers, n_experts: int):
    return [(layer, e) for layer in layers for e in range(n_experts)]


def resident_store(backend, gguf, layers) -> ExpertStore:
    """A single process's store of every expert of `layers`: on a GPU, every blob resident in
    one device buffer in its stored format; on the host, the blobs read from the file when used
    (the file is mapped: resident already)."""
    if not backend.on_gpu:
        return HostTier(backend, gguf)
    layers = list(layers)
    n_experts = gguf.tensor(f"blk.{layers[0]}.ffn_gate_exps.weight").shape[0]
    return BlobArena(backend, gguf, all_pairs(gguf, layers, n_experts), max(layers) + 1, n_experts)
