"""The head's side of kept conversations (--conversation-cache-mib): which conversations the
stages keep (their token ids, under which salt), where a new request resumes, and the
ConversationStep that tells every stage what to keep, drop and restore before it
(strata_dist/rank/conversation_cache.py is the stages' side).

- A request resumes from the longest usable prefix of the serving session (what it holds now,
  head/session.py) or of ANY kept conversation of the same salt (the API key and `cache_salt`: a reuse shows
  in the reply, so it never crosses salts). A kept conversation is usable up to its common prefix
  with the request when every stage's state is positional (K/V only), and only at exactly its
  length or at a checkpoint every stage held when it was kept when some stage holds recurrent
  state (qwen3next): that state exists only there.
- Before the serving session is overwritten (the request does not simply continue it, or comes
  under another salt), it is kept under a new key. With positional state, kept conversations whose
  tokens are a prefix of it are dropped: it serves every request they would.
- The stages report the keys every one of them holds with each prompt chunk; the table keeps only
  those (a stage may have evicted one, or lacked room for it). A request that fails before any
  report leaves its new key unconfirmed: the next step drops it on every stage.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

from protocol.conversations import ConversationStep

log = logging.getLogger("strata.conversations")


@dataclass
class KeptTokens:
    tokens: list[int]     # what the conversation's kept cells hold, position by position
    salt: str
    positions: list[int] | None = None   # where it can be restored (None: anywhere, positional)


def common_prefix(a: list[int], b: list[int]) -> int:
    n, top = 0, min(len(a), len(b))
    while n < top and a[n] == b[n]:
        n += 1
    return n


class ConversationTable:
    def __init__(self, on: bool, checkpoints_kept: bool = True):
        """`checkpoints_kept` False: some stage keeps its copies in pinned host memory, which keep
        no checkpoints (conversation_cache.py), so a recurrent conversation restores only at its
        kept length."""
        self.on, self.checkpoints_kept = on, checkpoints_kept
        self.kept: dict[int, KeptTokens] = {}   # as the stages last reported, plus the one sent
        self._next_key = 1
        self._unconfirmed: list[int] = []       # sent to keep, not reported yet
        self._forget: list[int] = []            # to drop on every stage with the next step

    def begin(self) -> None:
        """Before a request picks where to resume: a key sent to keep and never reported (its
        request failed first) is no conversation; every stage drops it with the next step."""
        for key in self._unconfirmed:
            self.kept.pop(key, None)
        self._forget += self._unconfirmed
        self._unconfirmed = []

    def best(self, ids: list[int], salt: str, positional: bool) -> tuple[int, int]:
        """(key, cells) of the kept conversation a request for `ids` resumes from furthest, at
        least one token left to read; (0, 0) when none serves."""
        best = (0, 0)
        for key, k in self.kept.items():
            if k.salt != salt:
                continue
            n = min(common_prefix(ids, k.tokens), len(ids) - 1)
            usable = n if positional or k.positions is None else max(
                [0] + [p for p in k.positions if p <= n])
            if usable > best[1]:
                best = (key, usable)
        return best

    def step(self, live: list[int], live_salt: str, salt: str, resume: int, restore: tuple[int, int],
             positional: bool, live_checkpoints: list[int] = ()) -> ConversationStep | None:
        """What the stages do before the request: keep the serving session (`live`, under
        `live_salt`, with its checkpoints every stage holds) unless the request continues it
        (same salt, resuming at its end without a restore), drop what is superseded or
        unconfirmed, restore `restore` = (key, cells)."""
        keep = keep_n = 0
        forget, self._forget = self._forget, []
        continues = not restore[0] and salt == live_salt and resume == len(live)
        if self.on and live and not continues and not any(
                k.tokens == live and k.salt == live_salt for k in self.kept.values()):
            keep, keep_n = self._next_key, len(live)
            self._next_key += 1
            if positional:
                forget += [key for key, k in self.kept.items() if key != restore[0]
                           and k.salt == live_salt and live[:len(k.tokens)] == k.tokens]
            for key in forget:
                self.kept.pop(key, None)
            below = live_checkpoints if self.checkpoints_kept else ()
            self.kept[keep] = KeptTokens(list(live), live_salt, None if positional else sorted(
                {p for p in below if 0 < p < len(live)} | {len(live)}))
            self._unconfirmed = [keep]
        if not (keep or forget or restore[0]):
            return None
        return ConversationStep(keep=keep, keep_n=keep_n, forget=forget, restore=restore[0],
                                restore_n=restore[1])

    def reported(self, keys: list[int]) -> None:
        """The keys every stage holds, as the last stage reported with a prompt chunk."""
        held = set(keys)
        self.kept = {k: v for k, v in self.kept.items() if k in held}
        self._unconfirmed = []

    def unconfirmed(self, step: ConversationStep) -> None:
        """`step` was sent but no stage reported after it: each stage may or may not have applied
        it. Its new key stays unconfirmed (the next step drops it everywhere) and its forgets go
        again with the next step (dropping an absent key is nothing); its restore only copies."""
        self._forget += [k for k in step.forget if k not in self._forget]

    def discard(self, key: int) -> None:
        """A restore of `key` failed: it is dropped here and, with the next step, on every stage."""
        if self.kept.pop(key, None) is not None:
            self._forget.append(key)

    def clear(self) -> None:
        """A rank was replaced: it holds none of them (the others drop theirs as unconfirmed)."""
        self._forget += list(self.kept)
        self.kept.clear()
        self._unconfirmed = []


TURN_WAIT_S = 300.0   # the longest a request waits for the one ahead's step to be confirmed
TURN_POLL_S = 0.5     # how often a waiting request looks whether the one ahead still runs


class SharedConversationTable(ConversationTable):
    """One table for every session of `--parallel B` (strata_dist/server/parallel.py gives it to
    each HeadSession): a request on any session resumes from the longest kept prefix of ANY
    conversation of its salt, whichever session it was served in, while others decode.

    Each request calls the table from its own thread (the server runs every job on a thread of
    its own, and HeadSession.generate calls the table there, its stream events included), so the
    thread names the request. The stages apply the requests' ConversationSteps in the order their
    first prompt chunks reach them (strata_dist/head/batch_scheduler.py reads prompts one at a time, in
    the order they came), so:
    - a request picks where it resumes and makes its step only once every step made before is
      confirmed (its request's first report came back) or settled (its request ended without
      one): then the keys this table holds are what every stage holds, and no stage evicts a
      conversation (to make room for a keep) between this request's choice and its restore.
      Between `begin` and `step` it holds the turn; a step that is None waits for nothing after.
    - a report speaks only for the keys kept by its own request's step or by earlier ones: a
      stage has not applied a later request's step when it reports an earlier request's chunk.
    - a rank replaced (`coord.rejoins`) clears the table once, whichever session sees it first."""

    def __init__(self, on: bool, checkpoints_kept: bool = True, coordinator=None,
                 wait_s: float = TURN_WAIT_S):
        super().__init__(on, checkpoints_kept)
        self.coord, self.wait_s = coordinator, wait_s
        self._cond = threading.Condition()
        self._turn: threading.Thread | None = None           # between its begin and its step
        self._pending: dict[threading.Thread, ConversationStep] = {}   # sent, not confirmed
        self._seq = itertools.count(1)
        self._seq_of: dict[threading.Thread, int] = {}        # each request's place in order
        self._key_seq: dict[int, int] = {}                   # each kept key's step's place
        self._no_restore: set[threading.Thread] = set()       # waited past wait_s: no restore
        self._rejoins = getattr(coordinator, "rejoins", 0)

    def _blocked(self, me: threading.Thread) -> list[threading.Thread]:
        """The other requests this one waits for (a thread that ended settles its own)."""
        for t in [t for t in self._pending if t is not me and not t.is_alive()]:
            self._settle(t)
        if self._turn is not None and self._turn is not me and not self._turn.is_alive():
            self._turn = None
        return [t for t in [self._turn, *self._pending] if t is not None and t is not me]

    def begin(self) -> None:
        me = threading.current_thread()
        with self._cond:
            deadline = time.monotonic() + self.wait_s
            self._no_restore.discard(me)
            while self._blocked(me):
                left = deadline - time.monotonic()
                if left <= 0:
                    # the one ahead never confirmed (its stream is stuck behind others): this
                    # request restores nothing, so no eviction its step may cause can hurt it
                    log.warning("kept conversations: the request ahead was not confirmed in %g s; "
                                "this one resumes only from its own session", self.wait_s)
                    self._no_restore.add(me)
                    break
                self._cond.wait(min(left, TURN_POLL_S))
            self._turn = me
            self._seq_of[me] = next(self._seq)

    def best(self, ids: list[int], salt: str, positional: bool) -> tuple[int, int]:
        with self._cond:
            if threading.current_thread() in self._no_restore:
                return (0, 0)
            return super().best(ids, salt, positional)

    def step(self, live: list[int], live_salt: str, salt: str, resume: int,
             restore: tuple[int, int], positional: bool,
             live_checkpoints: list[int] = ()) -> ConversationStep | None:
        me = threading.current_thread()
        with self._cond:
            try:
                step = super().step(live, live_salt, salt, resume, restore, positional,
                                    live_checkpoints)
                self._unconfirmed = []      # settled per request here (`unconfirmed`, `_settle`)
                if step is not None:
                    if step.keep:
                        self._key_seq[step.keep] = self._seq_of.get(me, 0)
                    self._pending[me] = step
                return step
            finally:
                if self._turn is me:
                    self._turn = None
                self._cond.notify_all()

    def reported(self, keys: list[int]) -> None:
        me = threading.current_thread()
        with self._cond:
            seq, held = self._seq_of.get(me, 0), set(keys)
            self.kept = {k: v for k, v in self.kept.items()
                         if k in held or self._key_seq.get(k, 0) > seq}
            self._key_seq = {k: s for k, s in self._key_seq.items() if k in self.kept}
            if self._pending.pop(me, None) is not None:
                self._cond.notify_all()

    def unconfirmed(self, step: ConversationStep) -> None:
        with self._cond:
            self._pending.pop(threading.current_thread(), None)
            self._drop_unconfirmed(step)
            self._cond.notify_all()

    def _drop_unconfirmed(self, step: ConversationStep) -> None:
        """What `begin` and `unconfirmed` do for one table: its new key is no conversation (every
        stage drops it with the next step) and its forgets go again."""
        if step.keep and self.kept.pop(step.keep, None) is not None:
            self._forget.append(step.keep)
        self._key_seq.pop(step.keep, None)
        super().unconfirmed(step)

    def _settle(self, thread: threading.Thread) -> None:
        step = self._pending.pop(thread, None)
        if step is not None:
            self._drop_unconfirmed(step)
        self._seq_of.pop(thread, None)
        self._no_restore.discard(thread)
        self._cond.notify_all()

    def settle(self) -> None:
        """The calling thread's request is over: a step of it never confirmed is settled as
        unconfirmed (server/parallel.py calls this after every job, whatever ended it)."""
        with self._cond:
            self._settle(threading.current_thread())

    def discard(self, key: int) -> None:
        with self._cond:
            super().discard(key)

    def clear(self) -> None:
        with self._cond:
            rejoins = getattr(self.coord, "rejoins", 0)
            if rejoins == self._rejoins:
                return          # another session cleared it for this replacement already
            self._rejoins = rejoins
            super().clear()
            self._key_seq.clear()
