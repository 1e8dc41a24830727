"""What a decode graph step hands the host, and the host buffers of the steps in flight.

A step's descriptor goes in and its token (and routes) come back through pinned host buffers; a
`HostSlot` holds one step's set. With a step ahead (the default, cuda_decode.py) two
steps can be in flight, so the runner keeps two slots: the next step's descriptor must not
overwrite the pinned buffer a queued copy still reads.

A step ahead is the next greedy decode step of a single-stage pipeline, launched before the host
has read the current step's token: its embedding reads that token on the device, so the GPU runs
step t+1 while the host sends token t on. It is the `Ahead` record until the host asks for
exactly that step (same session, position and token) and takes it; anything else waits for it
and drops it (the cells it wrote past the session's length are rewritten before they are read).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np


class StepLogits:
    """The last row's logits of a graph step. The greedy token is already on the host; the
    sampler reads the row on the card (`on_device`), and the full row is copied only when asked
    (`np.asarray`). It is the runner's buffer, valid until the next
    step is launched (a step ahead is launched before this one is returned: its callers take the
    greedy token only); reading it later raises rather than return another step's row."""

    def __init__(self, token: int, logits, current=lambda: True):
        self.greedy_token = token
        self._logits = logits
        self._current = current

    def on_device(self):
        """The row where it is, on the card (the sampler reads it there: ops/sample.py row_of)."""
        if not self._current():
            raise RuntimeError("these logits were overwritten by a later decode step")
        return self._logits

    def __array__(self, dtype=None, copy=None):
        import cupy as cp
        host = cp.asnumpy(self.on_device())
        return host if dtype is None else host.astype(dtype)


class RowLogits(StepLogits):
    """One row of a batched graph step (`BatchLogits`): its logits stay on the card, as a
    one-session step's do; `greedy_token` is None when the row has no finite best logit (the
    sampler's draw on the card then refuses it), and `nan` says the row holds a NaN (the last
    stage refuses such a row as it refuses a host row with one)."""

    def __init__(self, token: int | None, logits, nan: bool):
        super().__init__(token, logits)
        self.nan = nan


class BatchLogits:
    """Every row's logits of a batched graph step [n, vocab], kept on the card: the rows are
    sampled where they are (ops/sample.py, as a one-session step's row is), and only each row's
    greedy token, whether its best logit is finite and whether it holds a NaN came back, in one
    small copy. Indexing gives a row's `RowLogits` (a slice, a list of them); `np.asarray`
    copies the whole block to the host (tests ask for it; the serving path never does)."""

    def __init__(self, rows, tokens: np.ndarray, finite: np.ndarray, nan: np.ndarray):
        self.rows = rows
        self._tokens = [int(t) if ok else None for t, ok in zip(tokens.tolist(), finite.tolist())]
        self._nan = [bool(x) for x in nan.tolist()]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(d) for d in self.rows.shape)

    def __len__(self) -> int:
        return len(self._tokens)

    def row(self, i: int) -> RowLogits:
        return RowLogits(self._tokens[i], self.rows[i], self._nan[i])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.row(j) for j in range(len(self))[i]]
        return self.row(int(i))

    def __array__(self, dtype=None, copy=None):
        import cupy as cp
        host = cp.asnumpy(self.rows)
        return host if dtype is None else host.astype(dtype)


@dataclass
class HostSlot:
    """Pinned host buffers of one step in flight and the event that says it finished."""
    desc: np.ndarray          # the descriptor copied in (position, rows, token ids)
    token: np.ndarray         # the greedy token copied out (last stage)
    ids: np.ndarray           # the routes copied out (when some experts are read from the host)
    done: object              # cupy Event recorded after the step's copies
    launch_no: int = 0        # the runner's launch count when this step was launched

    @classmethod
    def allocate(cls, desc_words: int, ids_shape: tuple[int, ...]) -> "HostSlot":
        import cupy as cp
        import cupyx
        return cls(cupyx.empty_pinned(desc_words, dtype=np.int32),
                   cupyx.empty_pinned(1, dtype=np.int32),
                   cupyx.empty_pinned(ids_shape, dtype=np.int32),
                   cp.cuda.Event(disable_timing=True))


@dataclass
class Ahead:
    """A step launched ahead: session, position, the slot of its host buffers, and the token it
    reads (known once the step before it has finished)."""
    session: weakref.ref
    pos: int
    slot: int
    token: int | None = None

    def is_for(self, session, pos: int, ids) -> bool:
        return (self.session() is session and self.pos == pos and ids is not None
                and len(ids) == 1 and self.token is not None and int(ids[0]) == self.token)
