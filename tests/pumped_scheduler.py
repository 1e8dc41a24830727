"""A BatchScheduler (strata_dist/head/batch_scheduler.py) over real CPU ranks, pumped on a thread
of its own as the server's worker pumps it, with each request on a thread of its own: what the
batched-decode fault and lone-request tests drive directly (no HTTP in between)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from launcher.launch import Launch, LaunchConfig
from launcher.spawn import RankSpec
from protocol.messages import Sampling
from strata_dist.plan.params import PlanParams
from strata_dist.head.batch_scheduler import BatchScheduler
from strata_dist.head.coordinator import RankFailure


@contextmanager
def cpu_launch(model: str, ranks: int, split, max_context: int, sessions: int,
               prompt_chunk: int = 32):
    """`ranks` CPU stage ranks through the launcher (`split` as LaunchConfig takes it), each
    carving `sessions` sessions: (launch, plan), closed after."""
    cfg = LaunchConfig(model=model, ranks=[RankSpec(i, "cpu", None, "1G") for i in range(ranks)],
                       split=split, max_context=max_context, prompt_chunk=prompt_chunk,
                       params=PlanParams(sessions=sessions), load_timeout_s=60,
                       register_timeout_s=60)
    launch = Launch(cfg, echo=lambda line: None)
    try:
        yield launch, launch.start()
    finally:
        launch.close()


class Pumped:
    """The scheduler pumped on a thread of its own (as the server's worker does)."""

    def __init__(self, coord, prompt_chunk: int, parallel: int = 2):
        self.scheduler = BatchScheduler(coord, parallel, prompt_chunk)
        self.prompt_chunk = prompt_chunk
        self.failure: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                self.scheduler.pump(0.02)
        except RankFailure as e:
            self.failure.append(e)

    def request(self, session_id: int, ids: list[int], step_timeout_s: float, out: dict,
                name: str, max_new: int = 4, on_event=lambda e: None,
                cancel: threading.Event | None = None,
                sampling: Sampling | None = None) -> threading.Thread:
        """Request `name` on a thread of its own; out[name] is ("ok", reason, seconds) or
        ("error", the exception, seconds) when it ends. `sampling`: greedy, max_new, by default."""
        sampling = sampling or Sampling(max_new=max_new, temperature=0.0)

        def run():
            started = time.monotonic()
            try:
                reason = self.scheduler.run_request(
                    session_id, 0, ids, sampling, self.prompt_chunk, on_event,
                    step_timeout_s=step_timeout_s,
                    should_cancel=cancel.is_set if cancel is not None else None)
                out[name] = ("ok", reason, time.monotonic() - started)
            except Exception as e:   # noqa: BLE001 - the test looks at what it was
                out[name] = ("error", e, time.monotonic() - started)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def until(what, timeout_s: float = 30.0):
    """what()'s first truthy value, polled every 50 ms; AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s")
