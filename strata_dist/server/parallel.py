"""--parallel B on the server: up to B jobs at once, their decode steps batched.

Each running job has a thread of its own and one of B head sessions (session ids 0..B-1 on every
stage, each its own KV); its generation goes through the BatchScheduler
(strata_dist/head/batch_scheduler.py), which the worker's thread pumps: that thread alone touches the
coordinator's sockets. A job waits in the worker's queue (admission and 429 as with one at a
time) until a session is free."""
from __future__ import annotations

import logging
import math
import queue
import threading
import time

from ..head.batch_scheduler import BatchScheduler
from ..head.conversation_table import SharedConversationTable
from ..head.coordinator import RankFailure
from ..head.session import HeadSession
from .job_queue import RETRY_AFTER_MAX_S
from .running import session_row

log = logging.getLogger("strata.server")

PUMP_S = 0.02        # the longest the scheduler waits for the pipeline in one turn
IDLE_WAIT_S = 0.05   # the longest an idle turn waits for a job
JOIN_S = 5.0         # a job thread's last words after the server stops


class ParallelRuns:
    def __init__(self, worker, sessions: list[HeadSession], prompt_budget: int,
                 stats_every_s: float, stats_timeout_s: float):
        """`stats_every_s`: how often the ranks' counters are asked while jobs run;
        `stats_timeout_s`: how long their replies are waited for (then what came is taken)."""
        self.worker = worker
        self.stats_every_s, self.stats_timeout_s = stats_every_s, stats_timeout_s
        self.scheduler = BatchScheduler(sessions[0].coord, len(sessions), prompt_budget)
        # --conversation-cache-mib: one table of kept conversations for every session, so a
        # request resumes from any conversation of its salt, whichever session served it
        table = sessions[0].conversations
        self.table = (SharedConversationTable(True, table.checkpoints_kept, sessions[0].coord)
                      if table.on else None)
        for s in sessions:
            s.runner = self.scheduler
            if self.table is not None:
                s.conversations = self.table
        self.free: list[HeadSession] = list(sessions)
        self.sessions = list(sessions)
        self.running: dict[int, tuple[threading.Thread, HeadSession, object]] = {}
        self.failure: RankFailure | None = None     # a job thread's, raised on the worker's
        self._used: dict[int, int] = {}               # session id -> when a job last took it
        self._uses = 0
        self._stats_asked_at: float | None = None   # the ranks' counters asked, not all back yet
        self.lock = threading.Lock()

    def turn(self) -> bool:
        """Start waiting jobs on free sessions and move the pipeline along once; False when
        nothing was running or waiting (the caller idles)."""
        self._reap()
        started = False
        while self.free:
            try:   # with nothing running, wait a moment for a job (the caller idles otherwise)
                job = (self.worker.jobs.get(timeout=IDLE_WAIT_S) if not self.running
                       and not started else self.worker.jobs.get_nowait())
            except queue.Empty:
                break
            self._start(job)
            started = True
        busy = bool(self.running)
        if busy:
            self.scheduler.pump(PUMP_S)
            self._stats_when_due()
        self._reap()
        if self.failure is not None:
            raise self.failure
        return busy or started

    def _stats_when_due(self) -> None:
        """The ranks' counters while jobs run. The waiting coord.stats() would read the inbox
        and drop the scheduler's Tokens, so they are asked without waiting; the scheduler's pump
        meets the replies (the coordinator keeps them) and they are taken once all came, or
        what came after stats_timeout_s."""
        coord, now = self.worker.coord, time.monotonic()
        if self._stats_asked_at is None:
            if now - self.worker.stats_at > self.stats_every_s:
                coord.ask_stats(fresh=True)   # what comes after this is from this asking
                self._stats_asked_at = now
            return
        replies = coord.stats_replies()
        live = [s.rank for s in coord.ranks if s.rank not in coord.lost]
        if (all(r in replies for r in live)
                or now - self._stats_asked_at > self.stats_timeout_s):
            if replies:      # none at all: asked again next turn, the age keeps growing
                self.worker.take_stats(replies)
            self._stats_asked_at = None

    def retry_after_s(self) -> int:
        """Retry-After with B requests at once: every running and waiting request's prompt and
        max tokens (a bound: the running ones have made some) at the rates measured over all
        streams (the window's aggregate tokens per second, the last prompt's read rate)."""
        w = self.worker
        with w.lock:
            last = dict(w.last)
        jobs = w.jobs.waiting() + self.jobs_running()
        decode_tps = w.decode_rate.rate() or last.get("decode_tokens_per_second") or 0.0
        if decode_tps <= 0:      # nothing measured yet: a second per round of B requests
            return int(min(RETRY_AFTER_MAX_S, max(1, math.ceil(len(jobs) / len(self.sessions)))))
        tokens = sum(j.spec.max_new * j.spec.n * len(j.spec.prompts) for j in jobs)
        prompt = sum(len(ids) for j in jobs for ids, _ in j.spec.prompts)
        prompt_tps = last.get("prompt_tokens_per_second") or 0.0
        seconds = tokens / decode_tps + (prompt / prompt_tps if prompt_tps > 0 else 0.0)
        return int(min(RETRY_AFTER_MAX_S, max(1, math.ceil(seconds))))

    def jobs_running(self) -> list:
        with self.lock:
            return [job for _, _, job in self.running.values()]

    def view(self, running: dict, now: float) -> dict:
        """What /v1/status shows of it (in `queue`): a row per session, with the job it serves
        (`running`: the worker's RunningJob by job number, read under the worker's lock), and the
        batched steps so far with the requests they carried (requests / steps: the mean batch)
        and their rows (a request's verify window, --spec, is 1 + its drafts rows), and how
        often a lone request's steps were left to the last stage's loop and taken back."""
        with self.lock:
            busy = {session.session_id: n for n, (_, session, _) in self.running.items()}
        return {"parallel": len(self.sessions), "batched_steps": self.scheduler.steps,
                "batched_requests": self.scheduler.requests,
                "batched_rows": self.scheduler.rows,
                "batched_accepted": self.scheduler.accepted,   # drafts accepted in those rows
                "most_steps_in_flight": self.scheduler.most_in_flight,
                # a request alone steps on the last stage's own loop, until a second comes
                "lone_loops": self.scheduler.loops, "hand_backs": self.scheduler.hand_backs,
                "most_hand_back_tokens": self.scheduler.most_hand_back_tokens,
                "sessions": [session_row(s, running.get(busy.get(s.session_id)), now)
                             for s in self.sessions]}

    def _start(self, job) -> None:
        session = self._session_for(job.spec)
        self.free.remove(session)
        t = threading.Thread(target=self._run, args=(job, session), daemon=True,
                             name=f"job-{job.number}")
        with self.lock:
            self.running[job.number] = (t, session, job)
        t.start()

    def _session_for(self, spec) -> HeadSession:
        """The free session whose whole conversation the job's prompt continues (of its salt;
        the longest), so B conversations each resume where they left off; else an empty one;
        else the least recently used. With kept conversations, the one it shares the longest
        usable prefix with (the rest of that session's conversation is kept before it is
        overwritten, conversation_table.py), and a kept conversation that serves further is
        restored into whichever session it gets."""
        ids = spec.prompt_ids

        def rank(s: HeadSession) -> tuple:
            held = len(s.tokens)
            mine = spec.cache_prompt and s.salt == spec.cache_salt and held > 0
            if self.table is not None:
                reused = s.reusable(ids) if mine else 0
            else:
                continues = mine and held < len(ids) and ids[:held] == s.tokens
                reused = held if continues else 0
            return (reused, not s.tokens, -self._used.get(s.session_id, 0))
        self._uses += 1
        best = max(self.free, key=rank)
        self._used[best.session_id] = self._uses
        return best

    def _run(self, job, session: HeadSession) -> None:
        try:
            self.worker._run_job(job, session=session, refresh=False)
        except RankFailure as e:
            self.failure = self.failure or e
        except BaseException:   # noqa: BLE001 - _run_job reported it to the client
            log.exception("job %s ended with an error", job.id)
        finally:
            if self.table is not None:   # a step of it never confirmed holds up no other job
                self.table.settle()

    def _reap(self) -> None:
        with self.lock:
            done = [n for n, (t, _, _) in self.running.items() if not t.is_alive()]
            for n in done:
                _, session, _ = self.running.pop(n)
                self.free.append(session)

    def stop(self) -> None:
        """The server stops: running jobs were told by the drain; their threads end."""
        for t, _, _ in list(self.running.values()):
            t.join(JOIN_S)
