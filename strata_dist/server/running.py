"""A job generating now and its session's row in /v1/status (`running`, `queue.sessions`): the
worker (worker.py) keeps one RunningJob per job it runs; --parallel (parallel.py) shows every
session, busy or idle."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class RunningJob:
    """A job generating now: its tokens so far (of every choice) and when its first token came
    (its decode rate counts from there); its session, where that session is (the prompt tokens
    read, then one more per token), and what its generation resumed from."""
    job: Any          # worker.Job
    tokens: int = 0
    since: float = 0.0
    session: int = 0
    position: int = 0
    cached_tokens: int = 0
    # where its cached tokens came from: "held" (its session held them), "kept" (a kept
    # conversation restored, --conversation-cache-mib), "none" (its prompt read whole)
    conversation: str = "none"

    def tokens_per_second(self, now: float) -> float:
        return (self.tokens - 1) / max(now - self.since, 1e-3) if self.tokens > 1 else 0.0

    def row(self, now: float) -> dict:
        """Its row in /v1/status (`running`, and the session's in `queue.sessions`)."""
        return {"id": self.job.id, "tokens": self.tokens,
                "tokens_per_second": round(self.tokens_per_second(now), 3),
                "session": self.session, "position": self.position,
                "cached_tokens": self.cached_tokens, "conversation": self.conversation}


def session_row(session, run: RunningJob | None, now: float) -> dict:
    """A session's row in /v1/status's `queue.sessions`: the job it serves (None: idle, holding
    `position` tokens of its last conversation) with that job's row."""
    if run is None:
        return {"session": session.session_id, "request": None, "position": len(session.tokens),
                "tokens": 0, "tokens_per_second": 0.0, "cached_tokens": 0, "conversation": None}
    row = run.row(now)
    return {"session": session.session_id, "request": row.pop("id"), **row}
