"""Kept conversations (--conversation-cache-mib): one stage's copies of earlier conversations'
state, so a request can resume from the longest prefix of ANY kept conversation, not only from
what the serving session holds now.

The head (strata_dist/head/session.py, `ConversationTable`) knows each kept conversation's token ids and
drives everything; a stage only obeys the `ConversationStep` that rides on a request's first
prompt chunk (protocol/conversations.py), before the chunk is read:

1. `keep`: copy the serving session's state as the conversation `keep` of `keep_n` cells — the
   K/V rows [0, keep_n) of this stage's own attention layers and, on a stage with linear layers
   (qwen3next), their conv and recurrent state, which is valid only at the session's own position
   (kept only when the session is at exactly `keep_n`), with the serving session's checkpoints
   below `keep_n` (strata_dist/checkpoints.py: shared, not copied; device copies only).
2. `forget`: drop conversations the head no longer needs.
3. `restore`: copy conversation `restore`'s first `restore_n` cells back into the serving session
   and move it there. Recurrent state exists only at the kept length and at its kept checkpoints:
   a stage with linear layers refuses any other `restore_n` (the head never asks it), so a wrong
   state is never read.

Each stage keeps only its own layers. A stage's kept conversations take at most its budget (the
planner's `conversation_bytes`, priced per stage); the least recently kept or restored ones go
first. A conversation too large for the budget is not kept. After every step the stage reports the
keys it holds, the pipeline intersects them (Hidden.conversations → PromptProgress.conversations),
and the head forgets any key some stage lacks: an incomplete set is no conversation.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from ..checkpoints import is_recurrent

log = logging.getLogger("strata.conversations")


def common_keys(upstream: list[int] | None, own: list[int]) -> list[int]:
    """The conversations held by every stage so far and this one (None upstream: the first stage)."""
    return sorted(own) if upstream is None else sorted(set(upstream) & set(own))


def kv_parts(session) -> list:
    """The raw arrays of the session's K/V rows (a q8_0 store is its quants and its scales), each
    with the cells as its first axis."""
    out = []
    for rows in session.kv_rows():
        out += [rows.q, rows.scale] if hasattr(rows, "scale") else [rows]
    return out


def state_parts(session) -> list:
    """The conv and recurrent state of the session's own linear layers (none: positional)."""
    return [a for l in getattr(session, "linear_layers", ())
            for a in (session.conv_state(l), session.recurrent_state(l))]


def row_bytes(session) -> int:
    """Bytes one cell of the session's K/V takes on this stage."""
    return sum(int(a.nbytes) // int(a.shape[0]) for a in kv_parts(session))


def conversation_nbytes(session, n: int) -> int:
    """What keeping `n` cells of the session costs this stage: its K/V rows and, with linear
    layers, one copy of their state."""
    return row_bytes(session) * n + sum(int(a.nbytes) for a in state_parts(session))


@dataclass
class KeptConversation:
    n: int          # cells kept, from position 0
    rows: list      # the first n cells of each kv_parts array
    state: list     # copies of state_parts (empty: positional)
    nbytes: int
    prefix: dict    # position < n -> the serving session's checkpoint there (recurrent only)


class ConversationCache:
    """One stage's kept conversations within `budget_bytes`, least recently used first out.
    `host`: the copies live in pinned host memory instead of the device (the plan's choice when
    the card had no room); on CPU stages both are host memory."""

    def __init__(self, backend, budget_bytes: int, host: bool = False):
        if budget_bytes < 0:
            raise ValueError(f"the conversation cache budget must be >= 0 bytes, got {budget_bytes}")
        self.backend, self.budget_bytes, self.host = backend, int(budget_bytes), host
        self._kept: OrderedDict[int, KeptConversation] = OrderedDict()
        self.counters = {"conversations_kept": 0, "conversations_restored": 0,
                         "conversations_evicted": 0, "conversations_skipped": 0}

    def keys(self) -> list[int]:
        return sorted(self._kept)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._kept.values())

    def keep(self, session, key: int, n: int, protect: int = 0, prefix: dict | None = None) -> bool:
        """Copy the session's first `n` cells (and its recurrent state, which must be at n) as
        conversation `key`, making room by dropping the least recently used but `protect` (the
        one about to be restored). `prefix`: the session's checkpoints below n, kept with it
        (their bytes count; not with host copies, which hold no device state). False when not
        kept: it cannot fit the budget, or the session's recurrent state is not at n."""
        if key <= 0 or not 0 < n <= session.max_cells:
            raise ValueError(f"conversation {key} of {n} cells: the key must be > 0 and the "
                             f"cells in (0, {session.max_cells}]")
        self._kept.pop(key, None)
        prefix = {} if self.host or not is_recurrent(session) else dict(prefix or {})
        need = conversation_nbytes(session, n) + sum(int(c.nbytes) for c in prefix.values())
        room = self.budget_bytes - (self._kept[protect].nbytes if protect in self._kept else 0)
        if need > room or (is_recurrent(session) and session.n_past != n):
            self.counters["conversations_skipped"] += 1
            if need > self.budget_bytes:
                log.info("conversation %d (%d cells, %d bytes) exceeds the stage's budget of %d "
                         "bytes: not kept", key, n, need, self.budget_bytes)
            return False
        for old in [k for k in self._kept if k != protect]:    # least recently used first
            if self.nbytes + need <= self.budget_bytes:
                break
            del self._kept[old]
            self.counters["conversations_evicted"] += 1
        be = self.backend
        try:
            self._kept[key] = KeptConversation(
                n=n, rows=[be.keep_rows(a, n, self.host) for a in kv_parts(session)],
                state=[be.keep_rows(a, int(a.shape[0]), self.host) for a in state_parts(session)],
                nbytes=need, prefix=prefix)
        except (MemoryError, RuntimeError) as e:   # the device or pinned memory said no: fail soft
            self.counters["conversations_skipped"] += 1
            log.warning("conversation %d (%d cells) not kept: %s", key, n, e)
            return False
        self.counters["conversations_kept"] += 1
        return True

    def restore(self, session, key: int, n: int) -> None:
        """Put conversation `key`'s first `n` cells back into the session and move it to n. A
        stage with linear layers restores only the kept length or a kept checkpoint's position
        (its state exists only there)."""
        kept = self._kept.get(key)
        if kept is None:
            raise ValueError(f"conversation {key} is not kept on this stage (kept: {self.keys()})")
        if not 0 < n <= kept.n or (kept.state and n != kept.n and n not in kept.prefix):
            raise ValueError(f"conversation {key} keeps {kept.n} cells"
                             + (f" with recurrent state valid only there and at "
                                f"{sorted(kept.prefix)}" if kept.state else "")
                             + f"; {n} cannot be restored")
        be = self.backend
        for dst, src in zip(kv_parts(session), kept.rows):
            be.put_rows(dst, src[:n])
        if n in kept.prefix:
            session.restore(kept.prefix[n])     # its own checkpoint's state, and position n
        else:
            for dst, src in zip(state_parts(session), kept.state):
                be.put_rows(dst, src)
        session.n_past = n
        self._kept.move_to_end(key)
        self.counters["conversations_restored"] += 1

    def forget(self, keys) -> None:
        for k in keys:
            self._kept.pop(k, None)

    def clear(self) -> None:
        self._kept.clear()
