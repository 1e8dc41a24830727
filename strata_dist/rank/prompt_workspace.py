"""A prompt chunk's device buffers, carved by the architecture's fixed layout (plan/workspace.py)
from one region: the stage's loan (the lent tail of its cache), or its own prompt buffers where it
does not lend. The planner prices the loan with the same layout, so priced == carved.

While a chunk runs, the backend's operations write their results into the named buffers
(`Backend.buffer`); nothing on the default GPU path allocates. Whatever still allocates (a path a
switch turns on, or a buffer the layout does not hold) goes to CuPy's pool and is counted as
overflow: a layout that is short says so in the stage's counters instead of taking memory the
plan never priced."""
from __future__ import annotations

import logging
from contextlib import contextmanager

import numpy as np

log = logging.getLogger("strata.workspace")


class PromptWorkspace:
    """The buffers of `layout` for chunks of up to n_tokens, carved from `region` (a device
    uint8 array at least layout.nbytes(n_tokens) long)."""

    def __init__(self, layout, n_tokens: int, region):
        need = layout.nbytes(n_tokens)
        if int(region.nbytes) < need:
            raise ValueError(f"a prompt workspace for {n_tokens} tokens takes {need} bytes; the "
                             f"region has {int(region.nbytes)}")
        self.layout, self.n_tokens, self.region = layout, n_tokens, region
        self.slots = layout.carve(n_tokens)
        self.nbytes = need
        self.overflow_bytes = 0        # allocated from the pool while active
        self.taken: set[str] = set()   # the buffers written (what tests check the layout by)
        self._short: set[str] = set()
        # each (name, shape, dtype) asked before: its view, as it was made (every layer asks the
        # same ones, and a view made anew costs the host several CuPy calls)
        self._views: dict = {}

    @classmethod
    def allocate(cls, layout, n_tokens: int, xp) -> "PromptWorkspace":
        """A workspace over a region of its own (a stage that does not lend, the single-process
        runner), allocated once."""
        return cls(layout, n_tokens, xp.empty(layout.nbytes(n_tokens), dtype=np.uint8))

    def capacity(self, name: str) -> int:
        return self.slots[name][1] if name in self.slots else 0

    def take(self, name: str, shape, dtype):
        """A view of buffer `name` as an array of `shape` and `dtype`; a new (counted) array when
        the layout has no such buffer or it is too small."""
        self.taken.add(name)
        key = (name, tuple(shape), dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        at, size = self.slots.get(name, (0, -1))
        if nbytes > size:
            if name not in self._short:
                self._short.add(name)
                log.error("prompt buffer %r: %d bytes asked, %s carved for %d tokens; taken "
                          "from the pool", name, nbytes, "none" if size < 0 else size,
                          self.n_tokens)
            import cupy as cp
            return cp.empty(shape, dtype=dtype)
        view = self._views[key] = self.region[at:at + nbytes].view(dtype).reshape(shape)
        return view

    @contextmanager
    def active(self, backend):
        """The backend writes into this workspace; any allocation meanwhile is counted."""
        import cupy as cp
        pool = cp.get_default_memory_pool()

        def counted(nbytes: int):
            self.overflow_bytes += int(nbytes)
            return pool.malloc(nbytes)
        backend.workspace = self
        try:
            with cp.cuda.using_allocator(counted):
                yield self
        finally:
            backend.workspace = None
