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
    """A prompt's missing experts of one layer, from pinned host memory into a device region
    (the loan) in batches: the region is cut in two halves, batch b copied into half b % 2 on a
    copy stream once the kernels of batch b - 2 are done with it, and batch b computed on the
    current stream once its copy is in. The host only queues work."""

    def __init__(self, blobs: MappedHostBlobs):
        self.blobs = blobs
        self.copy = cp.cuda.Stream(non_blocking=True)

    def run(self, layer: int, experts: list[int], region, size: int, compute) -> int:
        """compute(batch, blob_of) queues the kernels of a batch, blob_of[e] its device bytes.
        Returns the number of experts streamed."""
        slots = int(region.nbytes) // size
        halves = 2 if slots >= 2 else 1
        per = slots // halves
        compute_stream = cp.cuda.get_current_stream()
        # the region's memory may have been read by kernels queued before this call (an earlier
        # layer's batch): no copy into it starts before they are done
        queued = cp.cuda.Event(disable_timing=True)
        queued.record(compute_stream)
        self.copy.wait_event(queued)
        free: list = [None] * halves        # the event after the last kernels reading each half
        for b, start in enumerate(range(0, len(experts), per)):
            batch, half = experts[start:start + per], b % halves
            base = half * per * size
            if free[half] is not None:
                self.copy.wait_event(free[half])
            for i, e in enumerate(batch):
                cp.cuda.runtime.memcpyAsync(int(region.data.ptr) + base + i * size,
                                            self.blobs.host_address(layer, e), size,
                                            cp.cuda.runtime.memcpyHostToDevice, self.copy.ptr)
            copied = cp.cuda.Event(disable_timing=True)
            copied.record(self.copy)
            compute_stream.wait_event(copied)
            compute(batch, {e: region[base + i * size:base + (i + 1) * size]
                            for i, e in enumerate(batch)})
            free[half] = cp.cuda.Event(disable_timing=True)
            free[half].record(compute_stream)
        return len(experts)
