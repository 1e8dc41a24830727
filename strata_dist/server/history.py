"""What the Monitor draws over time: the recent requests (one row each, for `/v1/status` and the
request list) and a bounded ring of samples taken once a second (`/v1/status/history`), so a page
opened now shows the past minutes at once."""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Any, Callable

from .status import tier_counts

log = logging.getLogger("strata.server")

RECENT_REQUESTS = 50         # rows kept for the request list
SAMPLE_EVERY_S = 1.0
KEEP_S = 600.0               # ten minutes of samples

# the worker's outcome counter -> the row's state
_STATE_OF_OUTCOME = {"requests_ok": "done", "requests_error": "error",
                     "requests_cancelled": "cancelled", "requests_rejected": "rejected"}


class _Row:
    __slots__ = ("job", "prompt_tokens", "queued_at", "created", "outcome", "finished",
                 "generated_tokens", "timings", "finish_reason", "started")

    def __init__(self, job):
        self.job = job
        self.prompt_tokens = len(job.spec.prompt_ids)
        self.queued_at = job.queued_at
        self.created = job.created
        self.outcome: str | None = None
        self.finished: float | None = None
        self.generated_tokens = 0
        self.timings: dict = {}
        self.finish_reason: str | None = None
        self.started: float | None = None


class RequestLog:
    """The last `keep` requests the worker saw. The worker calls queued() before a job enters the
    queue and finished() once it has run (or was refused); whether a waiting job is running, still
    waiting or gone is read from the worker when the rows are asked for."""

    def __init__(self, keep: int = RECENT_REQUESTS):
        self.rows: deque[_Row] = deque(maxlen=keep)
        self.lock = threading.Lock()

    def queued(self, job) -> None:
        with self.lock:
            self.rows.append(_Row(job))

    def finished(self, job, outcome: str, result=None, generated_tokens: int = 0) -> None:
        with self.lock:
            row = next((r for r in reversed(self.rows) if r.job is job), None)
            if row is None:            # pushed out by newer requests already
                return
            row.outcome, row.finished = outcome, time.time()
            row.generated_tokens = generated_tokens
            if result is not None:
                row.generated_tokens = result.completion_tokens
                row.timings = result.timings()
                # a request of n choices (or a batch of prompts) says each distinct reason once
                row.finish_reason = ",".join(dict.fromkeys(c.finish_reason for c in result.choices))

    def started(self, job) -> None:
        with self.lock:
            row = next((r for r in reversed(self.rows) if r.job is job), None)
            if row is not None:
                row.started = time.monotonic()

    def view(self, *, running: dict[int, tuple[int, float]] | None = None,
             serving: bool = True) -> list[dict[str, Any]]:
        """Newest first. `running`: the jobs generating now (several with --parallel), by job
        number, each with its token count and the time its first token came (tok/s is counted
        from there, as the finished rows' is)."""
        running = running or {}
        now = time.monotonic()
        out = []
        with self.lock:
            rows = list(self.rows)
        for r in reversed(rows):
            row: dict[str, Any] = {"id": r.job.id, "number": r.job.number,
                                   "created": round(r.created, 3),
                                   "prompt_tokens": r.prompt_tokens}
            if r.outcome is not None:
                t = r.timings
                row.update(state=_STATE_OF_OUTCOME.get(r.outcome, r.outcome),
                           generated_tokens=r.generated_tokens, finish_reason=r.finish_reason,
                           finished=round(r.finished, 3),
                           prompt_read=t.get("prompt_read"),
                           tokens_per_second=t.get("decode_tokens_per_second"),
                           prompt_tokens_per_second=t.get("prompt_tokens_per_second"),
                           draft_tokens=t.get("draft_tokens"),
                           draft_tokens_accepted=t.get("draft_tokens_accepted"))
            elif r.job.number in running:
                running_tokens, running_since = running[r.job.number]
                live = ((running_tokens - 1) / max(now - running_since, 1e-3)
                        if running_tokens > 1 else 0.0)
                row.update(state="running", generated_tokens=running_tokens,
                           tokens_per_second=round(live, 3))
            elif r.job.cancelled.is_set():
                row.update(state="cancelled", generated_tokens=0)
            else:
                # waiting in the queue, or drained with an error when the ranks failed
                row.update(state="queued" if serving else "failed", generated_tokens=0)
            if r.started is not None:
                row["waited_s"] = round(r.started - r.queued_at, 3)
            elif row["state"] == "queued":
                row["waited_s"] = round(now - r.queued_at, 3)
            out.append(row)
        return out


class StatusHistory:
    """One sample every `every_s` seconds, the last `keep_s` seconds of them, taken on a thread of
    its own from the worker's snapshot, its request rows and the memory probe."""

    def __init__(self, worker, memory: Callable[[], Any], *, every_s: float = SAMPLE_EVERY_S,
                 keep_s: float = KEEP_S):
        if not (every_s > 0 and keep_s >= every_s):
            raise ValueError(f"history: every_s {every_s} must be > 0 and at most keep_s {keep_s}")
        self.worker, self.memory = worker, memory
        self.every_s, self.keep_s = every_s, keep_s
        self.samples: deque[dict] = deque(maxlen=int(math.ceil(keep_s / every_s)))
        self.lock = threading.Lock()
        self._tiers: dict[str, int] | None = None
        self._at = time.time()
        self._stop = threading.Event()
        self._failed: set[type] = set()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="status-history", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        next_at = time.monotonic() + self.every_s
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.every_s
            if next_at < time.monotonic():      # fell behind (a suspended process): skip ahead
                next_at = time.monotonic() + self.every_s
            if self.worker.state == "stopping":
                return
            try:
                self.sample()
            except Exception as e:   # the charts go on from the next second; said once a kind
                if type(e) not in self._failed:
                    self._failed.add(type(e))
                    log.warning("status history: a sample failed (%s: %s); sampling goes on",
                                type(e).__name__, e)

    def sample(self) -> dict:
        snap = self.worker.snapshot()
        rows = self.worker.recent_requests()
        probe = self.memory()
        memory = probe.read(snap.get("rank_gauges")) if probe is not None else {}
        now = time.time()
        since, self._at = self._at, now
        # prompt tok/s: of the requests whose prompt was read and that finished in this interval
        read = ms = 0.0
        for r in rows:
            if r.get("finished") is not None and since < r["finished"] <= now and r.get("prompt_read"):
                tps = r.get("prompt_tokens_per_second") or 0.0
                if tps > 0:
                    read += r["prompt_read"]
                    ms += r["prompt_read"] / tps * 1e3
        # expert lookups by tier in this interval (the ranks' counters are totals since they started)
        counters: dict[str, int] = {}
        for c in snap.get("rank_counters", {}).values():
            for k, n in c.items():
                counters[k] = counters.get(k, 0) + int(n)
        tiers = tier_counts(counters)
        hit_rates = None
        if self._tiers is not None:
            delta = {t: n - self._tiers.get(t, 0) for t, n in tiers.items()}
            total = sum(delta.values())
            if total > 0 and min(delta.values()) >= 0:
                hit_rates = {t: round(n / total, 4) for t, n in sorted(delta.items())}
        self._tiers = tiers
        q = snap.get("queue") or {}
        sample = {
            "t": round(now, 3), "state": snap.get("state"),
            "tokens_per_second": snap.get("decode_tokens_per_second", 0.0),
            "prompt_tokens_per_second": round(read / ms * 1e3, 3) if ms > 0 else None,
            "waiting": q.get("waiting", 0), "running": q.get("running", 0),
            "hit_rates": hit_rates,
            "memory_used_bytes": {str(rank): m["used_bytes"] for rank, m in memory.items() if m},
        }
        with self.lock:
            self.samples.append(sample)
        return sample

    def since(self, t: float | None = None) -> list[dict]:
        with self.lock:
            if t is None:
                return list(self.samples)
            return [s for s in self.samples if s["t"] > t]

    def value(self, t: float | None = None) -> dict:
        return {"object": "strata.status_history", "every_s": self.every_s, "keep_s": self.keep_s,
                "samples": self.since(t)}


__all__ = ["RequestLog", "StatusHistory", "RECENT_REQUESTS", "SAMPLE_EVERY_S", "KEEP_S"]
