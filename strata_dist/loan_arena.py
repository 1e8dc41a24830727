"""A prompt chunk's device buffers, carved from the stage's loan (the lent tail of its cache).

While a stage reads a prompt chunk on a GPU, every CuPy allocation it makes (activations, router
scores, attention tiles, the batch of experts streamed in) is served from the loan instead of
CuPy's pool, so the prompt path never takes memory beyond the card's budget and, outside a prompt,
the whole cache is expert cache again. An allocation the loan cannot hold goes to CuPy's pool and
is counted (`overflow_bytes`): the plan's estimate of prompt buffers per token was short.

The bookkeeping (`RangeAllocator`) is plain first-fit over byte offsets with coalescing, testable
without a GPU; `LoanAllocator` maps it onto a device region through CuPy's allocator hook. A block
returns to the free list when CuPy drops the memory object that owns it (its array is gone)."""
from __future__ import annotations

import bisect
from contextlib import contextmanager

ALIGN = 512   # CuPy's own pool rounds to 512 bytes: the same alignment for every kernel


class RangeAllocator:
    """First-fit allocation of byte ranges in [0, capacity); free() coalesces neighbours."""

    def __init__(self, capacity: int, align: int = ALIGN):
        if capacity < 0 or align <= 0:
            raise ValueError(f"capacity must be >= 0 and align > 0, got {capacity}, {align}")
        self.capacity, self.align = int(capacity), int(align)
        self._free_starts = [0] if capacity > 0 else []   # sorted starts of free ranges
        self._free_len = {0: int(capacity)} if capacity > 0 else {}
        self._used: dict[int, int] = {}                    # start -> length of live blocks
        self.used = self.peak = 0

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new block of at least nbytes, or None when no free range holds it."""
        need = max(self.align, -(-int(nbytes) // self.align) * self.align)
        for i, start in enumerate(self._free_starts):
            length = self._free_len[start]
            if length < need:
                continue
            del self._free_starts[i], self._free_len[start]
            if length > need:
                bisect.insort(self._free_starts, start + need)
                self._free_len[start + need] = length - need
            self._used[start] = need
            self.used += need
            self.peak = max(self.peak, self.used)
            return start
        return None

    def free(self, offset: int) -> None:
        length = self._used.pop(offset, None)
        if length is None:
            raise ValueError(f"no block at offset {offset} is in use")
        self.used -= length
        i = bisect.bisect_left(self._free_starts, offset)
        start, end = offset, offset + length
        if i < len(self._free_starts) and self._free_starts[i] == end:        # merge the next
            end += self._free_len.pop(self._free_starts.pop(i))
        if i > 0:                                                           # merge the previous
            prev = self._free_starts[i - 1]
            if prev + self._free_len[prev] == start:
                start = prev
                del self._free_starts[i - 1], self._free_len[prev]
        bisect.insort(self._free_starts, start)
        self._free_len[start] = end - start

    @property
    def live_blocks(self) -> int:
        return len(self._used)

    @property
    def largest_free(self) -> int:
        return max(self._free_len.values(), default=0)


class LoanAllocator:
    """CuPy allocations served from a device region (the loan) while `active()`."""

    def __init__(self, region):
        import cupy as cp
        self._cp = cp
        self.region = region
        self.ranges = RangeAllocator(int(region.nbytes))
        self.overflow_bytes = 0
        self._block_type = _block_class(cp)

    def malloc(self, nbytes: int):
        cp = self._cp
        if nbytes == 0:
            return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(0, 0, None), 0)
        offset = self.ranges.alloc(nbytes)
        if offset is None:   # the loan is full: CuPy's pool, counted
            self.overflow_bytes += int(nbytes)
            return cp.get_default_memory_pool().malloc(nbytes)
        mem = self._block_type(int(self.region.data.ptr) + offset, int(nbytes), self.region,
                               self.region.data.device_id)
        mem.release = (self.ranges, offset)
        return cp.cuda.MemoryPointer(mem, 0)

    @contextmanager
    def active(self):
        with self._cp.cuda.using_allocator(self.malloc):
            yield self


_BLOCK = None


def _block_class(cp):
    """A CuPy memory object that gives its range back when CuPy drops it."""
    global _BLOCK
    if _BLOCK is None:
        class LoanBlock(cp.cuda.UnownedMemory):
            release = None

            def __del__(self):
                if self.release is not None:
                    ranges, offset = self.release
                    self.release = None
                    ranges.free(offset)
        _BLOCK = LoanBlock
    return _BLOCK
