"""The head's side of kept conversations (--conversation-cache-mib): which conversations the
stages keep (their token ids, under which salt), where a new request resumes, and the
ConversationStep that tells every stage what to keep, drop and restore before it
(strata_dist/conversation_cache.py is the stages' side).

- A request resumes from the longest usable prefix of the serving session (what it holds now,
  head.py) or of ANY kept conversation of the same salt (the API key and `cache_salt`: a reuse shows
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

from dataclasses import dataclass

from protocol.conversations import ConversationStep


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
