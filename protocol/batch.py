"""BatchRows: the rows of one batched decode step (--parallel B; strata_dist/batch_scheduler.py
sends it, strata_dist/stage_step.py runs it).

A batched step is one Tokens (head → first stage: `ids` holds each row's token) or Hidden (stage to
stage: one hidden row per entry) whose `batch` names, row by row, the request, the session and the
position that row is at. Each stage runs every row through its layers once: attention per row over
its own session's KV at its own position, the dense and expert layers over all rows together; the
last stage samples each row with its own request's sampling and answers one Token per row to the
head (never a next step: the head sends each batched step). Kept apart from messages.py as
conversations.py is (a record of its own)."""

from __future__ import annotations

from dataclasses import field

from .structs import Struct, struct

MAX_BATCH_ROWS = 64   # rows one step may carry (--parallel's bound)


@struct
class BatchRows(Struct):
    """Row i is request `request_ids[i]`'s next token, in session `session_ids[i]` at position
    `positions[i]`. A session appears at most once in a step."""

    request_ids: list[int] = field(default_factory=list)
    session_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def check(self, arrays: list) -> None:
        n = len(self.request_ids)
        if not 0 < n <= MAX_BATCH_ROWS:
            raise ValueError(f"a batched step carries 1 to {MAX_BATCH_ROWS} rows, not {n}")
        if len(self.session_ids) != n or len(self.positions) != n:
            raise ValueError(f"request_ids has {n} entries, session_ids {len(self.session_ids)}, "
                             f"positions {len(self.positions)}")
        if len(set(self.session_ids)) != n:
            raise ValueError("a session appears twice in one batched step")
        bad = [p for p in self.positions if p < 0] + [s for s in self.session_ids if s < 0]
        if bad:
            raise ValueError(f"positions and session ids must be >= 0, got {bad[0]}")

    def __len__(self) -> int:
        return len(self.request_ids)
