"""ConversationStep: what the head tells every stage about kept conversations before a request
(--conversation-cache-mib; strata_dist/rank/conversation_cache.py does it, strata_dist/head/session.py decides).

It rides on the request's first prompt chunk (Tokens, then Hidden stage to stage), so every stage
applies it in the pipeline's order, before the chunk's rows, with no message of its own. Kept
apart from messages.py as compute_options.py is (a record of its own)."""

from __future__ import annotations

from dataclasses import field

from .structs import Struct, struct

MAX_FORGET = 4096   # conversations one step may drop: far more than any budget keeps


@struct
class ConversationStep(Struct):
    """In order: keep the serving session's first `keep_n` cells as conversation `keep` (0: none);
    drop the conversations `forget`; restore conversation `restore`'s first `restore_n` cells
    into the serving session (0: none). Keys are the head's, > 0."""

    keep: int = 0
    keep_n: int = 0
    forget: list[int] = field(default_factory=list)
    restore: int = 0
    restore_n: int = 0

    def check(self, arrays: list) -> None:
        for name in ("keep", "keep_n", "restore", "restore_n"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if bool(self.keep) != bool(self.keep_n):
            raise ValueError(f"keep {self.keep} and keep_n {self.keep_n} come together")
        if bool(self.restore) != bool(self.restore_n):
            raise ValueError(f"restore {self.restore} and restore_n {self.restore_n} come together")
        if len(self.forget) > MAX_FORGET:
            raise ValueError(f"forget names {len(self.forget)} conversations; at most {MAX_FORGET}")
