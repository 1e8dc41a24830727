"""The rows of a decode graph step (backends/cuda_decode.py DecodeGraph): which session each row
reads and writes and at which position, packed into the step descriptor the kernels read
(kernels/abi.py DESC_*; kernels/attention.cuh row_position, row_table, row_step_end), and which
session's pointer table each slot of the device table holds.

A batched step (many users: Stage.run_batch) names a session per row, each at its own position; a
one-session step of n rows (positions pos, pos + 1, ...) is the case where every row names the
same session, whose table is then in slot 0 (qwen3next's recurrent kernels read slot 0 only,
backends/next_decode.py). The graphs are captured per row count (1 .. MAX_ROWS), so no row of a
step is padding: the descriptor's words past the step's rows are zeros that no kernel reads.

No CuPy here: tests/test_decode_rows.py checks the packing on a CPU."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from ..kernels.abi import (DESC_POS, DESC_ROW_END, DESC_ROW_POS, DESC_ROW_TABLE, DESC_ROWS,
                           DESC_TABLE_WORDS, DESC_TOKENS, DESC_WORDS, MAX_ROWS)


@dataclass(frozen=True)
class SessionRun:
    """A session's rows of a step: `count` rows at positions first, first + 1, ..."""
    session: object
    first: int
    count: int

    @property
    def end(self) -> int:
        """The newest cell the step writes of this session, + 1."""
        return self.first + self.count


@dataclass(frozen=True)
class StepRows:
    """Row i of a step is the token at positions[i] of sessions[i]. A session's rows are at
    consecutive positions in row order (a verify window's; a batched step gives it one row), so
    within a step no cell is written twice and each row sees the keys of the rows before it."""
    sessions: tuple
    positions: tuple

    def __post_init__(self) -> None:
        n = len(self.sessions)
        if not 1 <= n <= MAX_ROWS:
            raise ValueError(f"a graph step takes 1..{MAX_ROWS} rows, got {n}")
        if len(self.positions) != n:
            raise ValueError(f"{n} rows but {len(self.positions)} positions")
        last: dict[int, int] = {}
        for s, p in zip(self.sessions, self.positions):
            if p < 0:
                raise ValueError(f"position {p} of a row is negative")
            if id(s) in last and p != last[id(s)] + 1:
                raise ValueError(f"a session's rows at positions {last[id(s)]} then {p}: a "
                                 f"session's rows of one step are consecutive positions")
            last[id(s)] = p

    @classmethod
    def window(cls, session, pos: int, n: int) -> "StepRows":
        """n rows of one session at positions pos .. pos + n - 1."""
        return cls((session,) * n, tuple(range(pos, pos + n)))

    @property
    def n(self) -> int:
        return len(self.sessions)

    def runs(self) -> list[SessionRun]:
        """Each session's rows, in the order the sessions first appear."""
        first: dict[int, list] = {}
        for s, p in zip(self.sessions, self.positions):
            run = first.setdefault(id(s), [s, p, 0])
            run[2] += 1
        return [SessionRun(*run) for run in first.values()]


class SessionSlots:
    """The host copy of the device pointer table [MAX_ROWS slots, words]: the k-th session of a
    step (in the order its rows first appear) in slot k. `pointers(session)` gives a session's
    table. Only slots whose session changed are written again, so a batch that keeps its order
    (and every one-session step after the first) uploads nothing."""

    def __init__(self, words: int, pointers):
        self.words = words
        self.pointers = pointers
        self.host = np.zeros((MAX_ROWS, words), dtype=np.uint64)
        self._held: list = [None] * MAX_ROWS          # weakref of each slot's session

    def assign(self, rows: StepRows) -> tuple[np.ndarray, bool]:
        """Each row's slot (int32 [n]) and whether the host table changed (then the caller
        uploads it before the step)."""
        slot_of: dict[int, int] = {}
        changed = False
        for k, run in enumerate(rows.runs()):
            slot_of[id(run.session)] = k
            held = self._held[k]
            if held is None or held() is not run.session:
                table = np.asarray(self.pointers(run.session), dtype=np.uint64)
                if table.shape != (self.words,):
                    raise ValueError(f"a session's pointer table has {table.size} words, the "
                                     f"device table {self.words}")
                self.host[k] = table
                self._held[k] = weakref.ref(run.session)
                changed = True
        return np.array([slot_of[id(s)] for s in rows.sessions], dtype=np.int32), changed


def pack_descriptor(desc: np.ndarray, rows: StepRows, slots: np.ndarray, words: int,
                    ids=None) -> None:
    """Write the step descriptor (int32 [DESC_WORDS]) of `rows` whose tables are at `slots` in
    a table of `words` words a slot; `ids`: the first stage's token ids, one per row."""
    if desc.shape != (DESC_WORDS,) or desc.dtype != np.int32:
        raise ValueError(f"a step descriptor is int32 [{DESC_WORDS}]")
    if words <= 0:
        raise ValueError("a pointer table has at least one word")
    n = rows.n
    ends = {id(r.session): r.end for r in rows.runs()}
    desc[:] = 0
    desc[DESC_POS], desc[DESC_ROWS] = rows.positions[0], n
    if ids is not None:
        desc[DESC_TOKENS:DESC_TOKENS + n] = ids
    desc[DESC_TABLE_WORDS] = words
    desc[DESC_ROW_POS:DESC_ROW_POS + n] = rows.positions
    desc[DESC_ROW_TABLE:DESC_ROW_TABLE + n] = slots
    desc[DESC_ROW_END:DESC_ROW_END + n] = [ends[id(s)] for s in rows.sessions]


def session_pointers(session, lb: int, le: int, q8: bool, ring) -> list[int]:
    """A qwen3moe session's pointer table (kernels/attention.cuh): each layer slot's K and V, then
    the RoPE tables, then with q8_0 the K and V scales, then with --kv-resident the ring's words
    (kv_cache.DeviceRing.table_tail; a ring store's K / V and scales are its card's)."""
    kv = [a for layer in range(lb, le) for a in (session.k(layer), session.v(layer))]
    if q8:                   # q8_0 (Q8Rows): the int8 values, and the scales after the RoPE
        ptrs = [int(a.q.data.ptr) for a in kv]
    else:
        ptrs = [int(a.data.ptr) for a in kv]
    ptrs += [int(session.rope_cos.data.ptr), int(session.rope_sin.data.ptr)]
    if q8:
        ptrs += [int(a.scale.data.ptr) for a in kv]
    return ptrs + ring.table_tail(kv)
