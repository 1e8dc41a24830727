"""The worker's bounded job queue and its token-rate meter (strata_dist/server/worker.py uses both)."""
from __future__ import annotations

import queue
import threading
import time
from collections import deque

RATE_WINDOW_S = 3.0      # live tok/s is measured over this window
RETRY_AFTER_MAX_S = 3600  # a refused client is never told to wait longer than this


class JobQueue:
    """A bounded FIFO whose waiting jobs can leave (their client went away) and free their place."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: deque = deque()
        self.cond = threading.Condition()

    def put_nowait(self, job) -> None:
        with self.cond:
            if len(self.items) >= self.capacity:
                raise queue.Full
            self.items.append(job)
            self.cond.notify()

    def get(self, timeout: float) -> object:
        with self.cond:
            if not self.items:
                self.cond.wait(timeout)
            if not self.items:
                raise queue.Empty
            return self.items.popleft()

    def get_nowait(self) -> object:
        with self.cond:
            if not self.items:
                raise queue.Empty
            return self.items.popleft()

    def discard(self, job) -> bool:
        with self.cond:
            try:
                self.items.remove(job)
                return True
            except ValueError:
                return False

    def qsize(self) -> int:
        with self.cond:
            return len(self.items)

    def waiting(self) -> list:
        with self.cond:
            return list(self.items)


class RateMeter:
    """Tokens per second over a sliding window."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window = window_s
        self.marks: deque[tuple[float, int]] = deque()
        self.lock = threading.Lock()

    def add(self, n: int = 1, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self.lock:
            self.marks.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self.marks and now - self.marks[0][0] > self.window:
            self.marks.popleft()

    def rate(self, now: float | None = None) -> float:
        """Tokens in the last window, per second (0 once nothing arrived for a window)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            self._trim(now)
            return sum(m[1] for m in self.marks) / self.window
