"""Conversation checkpoints of sessions whose state is not positional (qwen3next's linear layers).

KV rows are positional: a session can move back to any earlier position and read on from there.
The conv and delta-rule state of a linear layer is not: it is the whole past folded in, so moving
back needs a copy of it taken at that position — a checkpoint. One rule, in this module, for the
stages (strata_dist/rank/stage.py), the head (strata_dist/head/session.py) and the single-process SingleProcessRunner, so a
distributed run and the SingleProcessRunner resume at the same position and read the same chunks:

- Which positions a request checkpoints (`request_positions`), all chunk boundaries of the request:
  its start position when > 0 (where the previous request left the session: the end of each request
  becomes a checkpoint as soon as the session reads on from it, so a chat follow-up or a regenerate
  of the turn resumes there), the first chunk end at or past each multiple of `every`
  (`--prompt-cache-every`, mid-prompt), and the end of the prompt (where the reply begins).
- Each stage saves and restores only its own part (HybridSession.save/restore: the conv and
  recurrent state of its own linear layers, tagged with its [lb, le)); KV needs no copy.
- A stage keeps at most MAX_PER_SESSION checkpoints per session, the oldest dropped (which is also
  the lowest position: every valid checkpoint lies on the session's current history, see
  `CheckpointStore.enter`). One checkpoint costs the stage `checkpoint_nbytes` (its session's
  "recurrent" part); they are allocated on demand, so a stage's bound is MAX_PER_SESSION x that
  per session, reported in Ready.allocated["checkpoints"]. A save that cannot allocate is skipped
  (that stage then lacks the part).
- A position is usable only when EVERY stage holding recurrent state has its part there
  (`common_positions`; an incomplete set is no checkpoint). The last stage reports that set to the
  head with every prompt chunk (PromptProgress.checkpoints).
- A request resumes at the longest usable position <= its common prefix with the session
  (`resume_point`): 0, the session's live position, or a checkpoint every stage holds. A session
  with only positional state (qwen3moe, or a stage with no linear layer) can resume anywhere.
"""
from __future__ import annotations

import logging

log = logging.getLogger("strata.checkpoints")

MAX_PER_SESSION = 4     # checkpoints a stage keeps per session (oldest dropped)
DEFAULT_EVERY = 2048    # --prompt-cache-every default: mid-prompt checkpoints every N tokens


def is_recurrent(session) -> bool:
    """Whether a session holds non-positional state (a linear layer's conv/recurrent state)."""
    return bool(getattr(session, "linear_layers", ()))


def request_positions(start: int, total: int, prompt_chunk: int, every: int) -> list[int]:
    """The positions a request that reads prompt positions [start, total) in chunks of
    `prompt_chunk` tokens (chunk k = [start + k*prompt_chunk, ...)) checkpoints, ascending; every one a chunk boundary:
    `start` when > 0, the first chunk end at or past each multiple of `every` (0: none), `total`."""
    if prompt_chunk < 1:
        raise ValueError(f"prompt_chunk must be >= 1, got {prompt_chunk}")
    if every < 0:
        raise ValueError(f"every must be >= 0 (0: no mid-prompt checkpoints), got {every}")
    out = [start] if start > 0 else []
    if every > 0:
        prev = start
        for end in range(start + prompt_chunk, total, prompt_chunk):
            if end // every > prev // every:   # a multiple of `every` lies in (prev, end]
                out.append(end)
            prev = end
    if total > start:
        out.append(total)
    return out


def chunk_positions(positions, pos: int, n: int, first: bool) -> list[int]:
    """The positions of a request's checkpoints that belong to the chunk of rows [pos, pos+n): its
    end, and its start for the request's first chunk (a boundary is saved once, after the chunk
    that ends there)."""
    return [p for p in positions if pos < p <= pos + n or (first and p == pos)]


def common_positions(upstream: list[int] | None, own: list[int] | None) -> list[int] | None:
    """Merge the positions usable on the stages so far with one more stage's: None means every
    position (only positional state so far); otherwise the positions every stage holding recurrent
    state has its checkpoint at."""
    if upstream is None:
        return None if own is None else sorted(own)
    if own is None:
        return sorted(upstream)
    return sorted(set(upstream) & set(own))


def resume_point(common: int, live: int, held: list[int] | None) -> int:
    """Where a request whose prompt shares `common` leading tokens with the session's (already
    capped to leave one token to read) resumes: the longest usable position <= common. `live` is
    the session's position (its state is there); `held` the positions every stage holds a
    checkpoint at, None when every position is usable (positional state only)."""
    if held is None:
        return common
    return max([0] + [p for p in (*held, live) if p <= common])


class CheckpointStore:
    """One stage's (or the SingleProcessRunner's) checkpoints of one session: at most `limit`, oldest dropped.
    For a positional session it holds nothing and moves the session anywhere."""

    def __init__(self, limit: int = MAX_PER_SESSION):
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self._by_pos: dict[int, object] = {}   # insertion order: oldest first
        self.saves = self.restores = self.failed = 0

    def positions(self) -> list[int]:
        return sorted(self._by_pos)

    def held(self, session) -> list[int] | None:
        """What this store lets a request resume at: None (anywhere) for a positional session."""
        return self.positions() if is_recurrent(session) else None

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self._by_pos.values())

    def enter(self, session, pos: int) -> None:
        """Move the session to `pos` before reading there: 0 starts afresh, the session's own
        position continues, a positional session moves anywhere; otherwise the checkpoint at `pos`
        is restored, and without one the move is refused (RecurrentRewindError). Checkpoints past
        `pos` are dropped: reading from `pos` overwrites the KV rows they rely on."""
        if pos == 0:
            session.reset(0)
        elif pos != session.n_past:
            ckpt = self._by_pos.get(pos) if is_recurrent(session) else None
            if ckpt is None:
                session.reset(pos)   # positional: moves; recurrent: raises RecurrentRewindError
            else:
                session.restore(ckpt)
                self.restores += 1
        self.drop_after(pos)

    def save(self, session, pos: int) -> bool:
        """Checkpoint the session at `pos` (its position). Nothing to do for a positional session
        or a position already held; a copy that cannot be allocated is skipped (logged, counted):
        this stage then lacks the part, and the set is incomplete. True when held afterwards."""
        if not is_recurrent(session) or self.limit == 0:
            return False
        if pos in self._by_pos:
            return True
        try:
            ckpt = session.save(pos)
        except MemoryError as e:   # cupy's OutOfMemoryError is a MemoryError
            self.failed += 1
            log.warning("checkpoint at %d of [%d, %d) skipped: %s", pos, session.lb, session.le, e)
            return False
        self._by_pos[pos] = ckpt
        self.saves += 1
        while len(self._by_pos) > self.limit:
            del self._by_pos[next(iter(self._by_pos))]
        return True

    def before(self, pos: int) -> dict[int, object]:
        """The checkpoints below `pos` (shared, not copied: a checkpoint is never written)."""
        return {p: c for p, c in self._by_pos.items() if p < pos}

    def drop_after(self, pos: int) -> None:
        for p in [p for p in self._by_pos if p > pos]:
            del self._by_pos[p]

    def drop(self, pos: int) -> None:
        self._by_pos.pop(pos, None)

    def clear(self) -> None:
        self._by_pos.clear()


def bound_bytes(session, limit: int = MAX_PER_SESSION) -> int:
    """The most a session's checkpoints can take on its stage: limit x one checkpoint."""
    return limit * int(getattr(session, "checkpoint_nbytes", 0)) if is_recurrent(session) else 0
