"""BatchRows: the rows of one batched decode step (--parallel B; strata_dist/head/batch_scheduler.py
sends it, strata_dist/rank/stage_step.py runs it).

A batched step is one Tokens (head → first stage: `ids` holds each row's token) or Hidden (stage to
stage: one hidden row per entry) whose `batch` names, row by row, the request, the session and the
position that row is at. Each stage runs every row through its layers once: attention per row over
its own session's KV at its own position, the dense and expert layers over all rows together; the
last stage samples each row with its own request's sampling and answers one Token per row to the
head (never a next step: the head sends each batched step), since v24 all of the step's Tokens in
one StepTokens (messages.py). Since v20 an entry may be a verify
window (speculative decoding, --spec K beside --parallel B): `window_rows[i]` rows of request i,
its last token and its drafts at positions `positions[i]`.., which every stage runs as that
session's verify window and the last stage verifies as the one-session path does; the final Token
of each window carries the drafts of that request's next one. Kept apart from messages.py as
conversations.py is (a record of its own)."""

from __future__ import annotations

from dataclasses import field

from .structs import Struct, struct

MAX_BATCH_ROWS = 64   # entries (requests) one step may carry (--parallel's bound)
# rows one entry's verify window may have: the decode step's rows (strata_dist/plan/pricing.py
# DECODE_ROWS, which --spec K + 1 fits)
MAX_WINDOW_ROWS = 8


@struct
class BatchRows(Struct):
    """Row i is request `request_ids[i]`'s next token, in session `session_ids[i]` at position
    `positions[i]` (v20: and the `window_rows[i]` - 1 drafts after it, at the positions after;
    empty: one row each). A session appears at most once in a step."""

    request_ids: list[int] = field(default_factory=list)
    session_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    window_rows: list[int] = field(default_factory=list)   # v20: rows of each entry (empty: 1s)

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
        if self.window_rows:
            if len(self.window_rows) != n:
                raise ValueError(f"request_ids has {n} entries, window_rows "
                                 f"{len(self.window_rows)}")
            wrong = [r for r in self.window_rows if not 1 <= r <= MAX_WINDOW_ROWS]
            if wrong:
                raise ValueError(f"a verify window has 1 to {MAX_WINDOW_ROWS} rows, not "
                                 f"{wrong[0]}")

    def rows_each(self) -> list[int]:
        """Rows of each entry, in order (1 each unless window_rows says otherwise)."""
        return list(self.window_rows) if self.window_rows else [1] * len(self.request_ids)

    @property
    def total_rows(self) -> int:
        """Rows the step carries: ids on Tokens, n on Hidden."""
        return sum(self.window_rows) if self.window_rows else len(self.request_ids)

    def __len__(self) -> int:
        return len(self.request_ids)
