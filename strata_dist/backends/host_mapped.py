"""Expert blobs in pinned host memory that the decode kernels read in place (zero-copy over PCIe).

A stage whose cache lacks some of its experts keeps the missing blobs here, laid out as in the
cache (gate, up, down rows as stored, `GGUFModel.expert_blob`), and the decode graph's table of
blob addresses points at them: the same expert kernels compute a cache hit and a host miss, so
the bits do not depend on the tier and the step stays one graph. With unified addressing (every
64-bit CUDA platform) pinned host memory has a device address, read over PCIe on demand.

The same pinned copies feed a prompt's misses (`BlobStreamer`): copied into the loan on a copy
stream, double-buffered against the kernels computing the batch before, with no host copy and no
synchronize.

Pinning is page-locking: tens of GiB may exceed a unit's memlock limit (`LimitMEMLOCK`, set by
deploy/) or the host's free memory; the caller then falls back to the general path."""
from __future__ import annotations

import ctypes
import logging
import time

import numpy as np
import cupy as cp

log = logging.getLogger("strata.host_mapped")

HOST_ALLOC_PORTABLE, HOST_ALLOC_MAPPED = 1, 2     # cudaHostAllocPortable, cudaHostAllocMapped
BLOB_ALIGN = 256                                  # each blob starts on a 256-byte boundary


class MappedHostBlobs:
    """The blobs of `pairs` (layer, expert) of `gguf` in one pinned host buffer."""

    def __init__(self, gguf, pairs):
        t0 = time.perf_counter()
        self.pairs = [(int(l), int(e)) for l, e in pairs]
        sizes = np.array([gguf.blob_bytes(l) for l, _ in self.pairs], dtype=np.int64)
        padded = (sizes + BLOB_ALIGN - 1) // BLOB_ALIGN * BLOB_ALIGN
        self.offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
        self.nbytes = int(self.offsets[-1])
        self.ptr = 0
        self._index: dict[tuple[int, int], int] = {}
        if not self.pairs:
            self.device_ptr = 0
            return
        self.ptr = int(cp.cuda.runtime.hostAlloc(self.nbytes,
                                                 HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED))
        try:
            host = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.ptr))
            for i, (layer, expert) in enumerate(self.pairs):
                lo = int(self.offsets[i])
                host[lo:lo + int(sizes[i])] = gguf.expert_blob(layer, expert)
            # the address kernels use (the host address itself under unified addressing)
            self.device_ptr = int(cp.cuda.runtime.pointerGetAttributes(self.ptr).devicePointer)
            self._index = {p: i for i, p in enumerate(self.pairs)}
        except BaseException:
            self.close()
            raise
        log.info("%d expert blobs (%.1f GiB) pinned in host memory for zero-copy reads in %.1f s",
                 len(self.pairs), self.nbytes / 2**30, time.perf_counter() - t0)

    def addresses(self) -> dict[tuple[int, int], int]:
        """(layer, expert) -> the device address of its blob."""
        return {p: self.device_ptr + int(self.offsets[i]) for i, p in enumerate(self.pairs)}

    def holds(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._index

    def host_address(self, layer: int, expert: int) -> int:
        """The host address of a held pair's blob (a DMA source)."""
        return self.ptr + int(self.offsets[self._index[(layer, expert)]])

    def close(self) -> None:
        if self.ptr:
            cp.cuda.runtime.freeHost(self.ptr)
            self.ptr = 0

    def __del__(self):
        try:
            self.close()
        except Exception:   # interpreter shutdown: the driver may be gone already
            pass


class BlobStreamer:
    """A prompt's missing experts, from pinned host memory into a device region in batches: the
    region is cut in two halves, each batch copied into the next half on a copy stream once the
    kernels of the batch before last are done with it, and computed on the current stream once
    its copy is in. The host only queues work, so while the device computes one layer the copy
    stream already fills the other half with the next layer's first batch. Which kernels read
    each half last is kept from one call to the next, for as long as the region is the same
    memory cut the same way; `reset` forgets it (a region that may have been other buffers)."""

    def __init__(self, blobs: MappedHostBlobs):
        self.blobs = blobs
        self.copy = cp.cuda.Stream(non_blocking=True)
        self.reset()

    def reset(self) -> None:
        self._cut = None      # (region address, half bytes, halves) the events below are about
        self._free: list = []  # per half: the event after the last kernels reading it
        self._next = 0        # the half the next batch goes to

    def run(self, layer: int, experts: list[int], region, size: int, compute,
            stride: int | None = None) -> int:
        """compute(batch, blob_of) queues the kernels of a batch, blob_of[e] its device bytes
        (`stride` bytes apart in the region, at least `size`). Returns the number of experts
        streamed."""
        stride = size if stride is None else stride
        slots = int(region.nbytes) // stride
        if not experts or slots == 0:
            return 0
        halves = 2 if slots >= 2 else 1
        per = slots // halves
        compute_stream = cp.cuda.get_current_stream()
        cut = (int(region.data.ptr), per * stride, halves)
        if cut != self._cut:
            # memory the kernels queued so far may still read (other buffers, an earlier cut):
            # no copy into it starts before they are done
            queued = cp.cuda.Event(disable_timing=True)
            queued.record(compute_stream)
            self.copy.wait_event(queued)
            self._cut, self._free, self._next = cut, [None] * halves, 0
        # batches of even size: a layer's last batch is not a few experts computed alone
        n_batches = -(-len(experts) // per)
        each = -(-len(experts) // n_batches)
        for start in range(0, len(experts), each):
            batch, half = experts[start:start + each], self._next
            self._next = (half + 1) % halves
            base = int(region.data.ptr) + half * per * stride
            if self._free[half] is not None:
                self.copy.wait_event(self._free[half])
            for i, e in enumerate(batch):
                cp.cuda.runtime.memcpyAsync(base + i * stride, self.blobs.host_address(layer, e),
                                            size, cp.cuda.runtime.memcpyHostToDevice,
                                            self.copy.ptr)
            copied = cp.cuda.Event(disable_timing=True)
            copied.record(self.copy)
            compute_stream.wait_event(copied)
            off = base - int(region.data.ptr)
            compute(batch, {e: region[off + i * stride:off + i * stride + size]
                            for i, e in enumerate(batch)})
            self._free[half] = cp.cuda.Event(disable_timing=True)
            self._free[half].record(compute_stream)
        return len(experts)
