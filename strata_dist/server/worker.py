"""The one thread that talks to the coordinator.

ZeroMQ sockets belong to one thread, so every call into the coordinator — loading, generation,
idle heartbeat checks, stats — happens on the thread that runs `Worker.run()`. HTTP handlers
never touch it: they put a `Job` on a bounded FIFO (`submit`, which refuses when full) and read
the job's events from an asyncio queue the worker feeds with `loop.call_soon_threadsafe`.

Per job the worker turns token ids into text (incremental detokenizer), applies stop strings (the
text is cut before the match and the generation is cancelled), and records throughput."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..head.coordinator import RankFailure, RankLost, RequestError
from ..head.session import HeadSession, LogprobRequest
from ..sampling.sampler import SamplingParams, TokenLogprob
from ..gguf_file.tokenizer import GGUFTokenizer
from .history import RequestLog
from .job_queue import RETRY_AFTER_MAX_S, JobQueue, RateMeter
from .metrics import LatencyHistograms
from .running import RunningJob, session_row

log = logging.getLogger("strata.server")

# A rank's StatsReply counters: PROTOCOL.md calls them deltas since the previous reply, but the ranks
# (strata_dist/rank/shell.py) and `--serve STATS` treat them as totals since the rank started. The server
# follows the ranks; flip this if they come to send deltas.
COUNTERS_ARE_TOTALS = True
STATS_EVERY_S = 2.0      # how often an idle worker asks the ranks for their counters
STATS_TIMEOUT_S = 2.0


class QueueFull(Exception):
    pass


class NotReady(Exception):
    pass


@dataclass
class GenSpec:
    """One generation, already validated and tokenized."""
    prompt_ids: list[int]
    max_new: int
    params: SamplingParams
    stop_ids: tuple[int, ...]
    stop_strings: tuple[str, ...] = ()
    detok_context: tuple[int, ...] = ()
    cache_prompt: bool = True        # False: read the whole prompt, reuse nothing
    # Prompt state is reused only from a request of the same salt (its API key and `cache_salt`):
    # a reuse shows in the reply (cached_tokens, timings), so across salts it would tell one
    # client how much of its prompt matches another's.
    cache_salt: str = ""
    n: int = 1                       # choices, one after another on the prompt's cached state
    logprobs: LogprobRequest = LogprobRequest()
    # a batch (completions given a list of prompts): the prompts after prompt_ids, each with its
    # detokenizer context; each gets its own n choices, indexed after the earlier prompts'
    later_prompts: list[tuple[list[int], tuple[int, ...]]] = field(default_factory=list)

    @property
    def prompts(self) -> list[tuple[list[int], tuple[int, ...]]]:
        """Every prompt of the request with its detokenizer context, in order."""
        return [(self.prompt_ids, self.detok_context)] + self.later_prompts


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str           # stop | length
    logprobs: list[TokenLogprob] | None = None   # one per token id, when asked
    prompt: int = 0              # which prompt of the request it answers (a batch's)
    # asked for (echo): its prompt's tokens from position 1 with their logprobs
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Result:
    choices: list[Choice]
    prompt_tokens: int           # of every prompt
    completion_tokens: int       # of every choice
    reused: int                  # prompt tokens the session held (each prompt's first choice)
    prompt_read: int             # prompt tokens the stages read (each later choice reads one or more)
    prompt_ms: float
    decode_ms: float
    drafted: int = 0             # speculative decoding (--spec): draft tokens verified
    accepted: int = 0            # ... and those accepted

    def timings(self) -> dict:
        first_tokens = len(self.choices)     # each choice's first token comes with its prompt
        decode_tps = (self.completion_tokens - first_tokens) / self.decode_ms * 1e3 \
            if self.completion_tokens > first_tokens and self.decode_ms > 0 else 0.0
        read = self.prompt_read
        return {"prompt_reused": self.reused, "prompt_read": read,
                "prompt_ms": round(self.prompt_ms, 3), "decode_ms": round(self.decode_ms, 3),
                "prompt_tokens_per_second": round(read / self.prompt_ms * 1e3, 3)
                if self.prompt_ms > 0 else 0.0,
                "decode_tokens_per_second": round(decode_tps, 3),
                "draft_tokens": self.drafted, "draft_tokens_accepted": self.accepted}


@dataclass
class Event:
    kind: str                    # prompt (its logprobs, for echo) | delta | done | error
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    index: int = 0               # the choice a delta is of
    logprobs: list[TokenLogprob] | None = None   # a delta's, one per token id, when asked
    result: Result | None = None
    status: int = 0              # for errors: the HTTP status
    message: str = ""
    code: str = ""


class Job:
    _seq = itertools.count(1)

    def __init__(self, spec: GenSpec, loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
        self.spec = spec
        self.id = uuid.uuid4().hex[:24]
        self.number = next(self._seq)
        self.loop, self.events = loop, events
        self.cancelled = threading.Event()     # the client went away
        self.created = time.time()
        self.queued_at = time.monotonic()
        self.on_cancel: Callable[["Job"], None] | None = None

    def cancel(self) -> None:
        """The client went away: a waiting job leaves the queue now, a running one is cancelled."""
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)

    def post(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:   # the event loop is closed (server stopping): nobody listens
            pass


class TextStream:
    """Detokenizes one job's tokens and applies its stop strings."""

    def __init__(self, tok: GGUFTokenizer, spec: GenSpec,
                 detok_context: tuple[int, ...] | None = None):
        self.tok = tok
        self.stops = [s for s in spec.stop_strings if s]
        self.stop_ids = set(spec.stop_ids)
        self.detok = tok.incremental(spec.detok_context if detok_context is None else detok_context)
        self.text = ""
        self.emitted = 0
        self.tokens: list[int] = []
        self.pending_ids: list[int] = []
        self.index = 0               # the choice this stream is of
        self.logprobs: list[TokenLogprob] | None = [] if spec.logprobs.tokens else None
        self.pending_logprobs: list[TokenLogprob] = []
        self.stop_hit = False
        self._searched = 0

    def push(self, token_id: int, logprob: TokenLogprob | None = None) -> Event | None:
        if self.stop_hit:
            return None
        self.tokens.append(token_id)
        self.pending_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
            self.pending_logprobs.append(logprob)
        if token_id not in self.stop_ids:
            self.text += self.detok.push(token_id)
        return self._emit(final=False)

    def finish(self) -> Event | None:
        if not self.stop_hit:
            self.text += self.detok.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> Event | None:
        if self.stops and not self.stop_hit:
            longest = max(len(s) for s in self.stops)
            start = max(0, self._searched - longest + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            self._searched = len(self.text)
            if hits:
                self.text = self.text[:min(hits)]
                self.stop_hit = True
        if self.stop_hit or final:
            safe = len(self.text)
        else:
            safe = len(self.text) - _partial_stop(self.text, self.stops)
        if safe <= self.emitted and not (final and self.pending_ids):
            return None
        ev = Event("delta", text=self.text[self.emitted:safe], token_ids=self.pending_ids,
                   index=self.index,
                   logprobs=self.pending_logprobs if self.logprobs is not None else None)
        self.emitted = max(self.emitted, safe)
        self.pending_ids, self.pending_logprobs = [], []
        return ev


def _partial_stop(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that begins some stop string (held back)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            # the first character rules out most tails before a comparison of k characters
            if text[-k] == s[0] and s.startswith(text[-k:]):
                best = k
                break
    return best



def _most_tokens(spec: GenSpec) -> int:
    """The most tokens a request generates: max_new for each choice of each prompt."""
    return spec.max_new * spec.n * len(spec.prompts)


def _prompt_tokens(spec: GenSpec) -> int:
    return sum(len(ids) for ids, _ in spec.prompts)


class Worker:
    """Owns the head session; `run()` is the coordinator's thread."""

    def __init__(self, tokenizer: GGUFTokenizer, ctx: int, n_vocab: int, queue_size: int):
        if queue_size < 1:
            raise ValueError(f"queue size must be >= 1, got {queue_size}")
        self.tok, self.ctx, self.n_vocab = tokenizer, ctx, n_vocab
        self.queue_size = queue_size
        self.jobs = JobQueue(queue_size)
        self.state = "loading"             # loading | ready | failed | stopping
        self.error: str | None = None
        self.session: HeadSession | None = None
        self.coord = None
        # the jobs generating now, by job number (several with --parallel), each with its tokens
        # so far and when its first token came
        self.running: dict[int, RunningJob] = {}
        self.parallel = None               # --parallel B > 1: server/parallel.py ParallelRuns
        self.lock = threading.Lock()
        self.decode_rate = RateMeter()
        self.totals = {"prompt_tokens": 0, "prompt_tokens_read": 0, "generated_tokens": 0,
                       "requests_ok": 0, "requests_error": 0, "requests_cancelled": 0,
                       "requests_rejected": 0, "requests_unavailable": 0,
                       "draft_tokens": 0, "draft_tokens_accepted": 0}
        self.last: dict[str, Any] = {}
        self.rank_counters: dict[int, dict[str, int]] = {}
        self.rank_gauges: dict[int, dict[str, float]] = {}
        self.stats_at = 0.0
        self.lost: dict[int, str] = {}     # stage ranks lost, until their replacements load
        self.latency = LatencyHistograms()
        self.requests = RequestLog()       # the Monitor's request list
        self._stop = threading.Event()

    # ---- from HTTP handlers (any thread) ----------------------------------------------------------
    def submit(self, job: Job) -> None:
        if self.state != "ready":
            with self.lock:      # refused with 503: counted, so that every request shows in /metrics
                self.totals["requests_unavailable"] += 1
            raise NotReady(self.error or f"the server is {self.state}")
        job.on_cancel = self._left
        self.requests.queued(job)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.requests.finished(job, "requests_rejected")
            with self.lock:
                self.totals["requests_rejected"] += 1
            raise QueueFull(f"the queue is full ({self.queue_size} waiting)") from None

    def refused_before_queue(self, status: int) -> None:
        """A request refused while it was read (the chat renderers were full: 429, or could not
        run: 503) is counted as one the queue refused, so /metrics' outcomes add up to the
        requests received. Bad input (4xx other than 429) is not a request served or refused."""
        key = {429: "requests_rejected", 503: "requests_unavailable"}.get(status)
        if key is not None:
            with self.lock:
                self.totals[key] += 1

    def retry_after_s(self) -> int:
        """What a refused client is told to wait (Retry-After, whole seconds, at least 1): the time
        the work ahead of it takes at the measured rates — what the running request has left to
        generate plus each waiting one's prompt and max tokens. Requests that stop before their
        max tokens free the queue sooner, so this is a bound rather than a promise."""
        if self.parallel is not None:    # requests at once: the work ahead at the aggregate rate
            return self.parallel.retry_after_s()
        with self.lock:
            now_running = next(iter(self.running.values()), None)
            last = dict(self.last)
        running, made, since = ((now_running.job, now_running.tokens, now_running.since)
                                if now_running is not None else (None, 0, 0.0))
        # requests run one at a time, so the running one's decode rate (else the last one's) is
        # what each waiting one will see
        live = (made - 1) / max(time.monotonic() - since, 1e-3) if made > 1 else 0.0
        decode_tps = live or last.get("decode_tokens_per_second") or self.decode_rate.rate()
        prompt_tps = last.get("prompt_tokens_per_second") or 0.0
        waiting = self.jobs.waiting()
        if decode_tps <= 0:      # nothing measured yet: a second per request ahead
            return int(min(RETRY_AFTER_MAX_S, max(1, len(waiting) + (running is not None))))
        # a request makes n choices for each of its prompts, one after another
        tokens = sum(_most_tokens(j.spec) for j in waiting)
        prompt = sum(_prompt_tokens(j.spec) for j in waiting)
        if running is not None:
            tokens += max(_most_tokens(running.spec) - made, 0)   # made: of every choice so far
            if made == 0:
                prompt += _prompt_tokens(running.spec)
        seconds = tokens / decode_tps + (prompt / prompt_tps if prompt_tps > 0 else 0.0)
        return int(min(RETRY_AFTER_MAX_S, max(1, math.ceil(seconds))))

    def _left(self, job: Job) -> None:
        if self.jobs.discard(job):      # it was still waiting: it never runs
            with self.lock:
                self.totals["requests_cancelled"] += 1

    def snapshot(self) -> dict:
        """A consistent copy of the counters for /v1/status and /metrics."""
        with self.lock:
            now = time.monotonic()
            running = [r.row(now) for r in self.running.values()]
            sessions = (self.parallel.view(self.running, now) if self.parallel
                        else self._session_rows(now))
            return {
                "state": self.state, "error": self.error, "lost": dict(self.lost),
                "queue": {"waiting": self.jobs.qsize(), "capacity": self.queue_size,
                          "running": len(self.parallel.jobs_running()) if self.parallel
                          else len(running), **sessions},
                "totals": dict(self.totals),
                "decode_tokens_per_second": round(self.decode_rate.rate(), 3),
                # the first started of the running jobs (the only one without --parallel)
                "running": running[0] if running else None,
                "last": dict(self.last),
                "rank_counters": {r: dict(c) for r, c in self.rank_counters.items()},
                "rank_gauges": {r: dict(g) for r, g in self.rank_gauges.items()},
                "stats_age_s": round(time.monotonic() - self.stats_at, 3) if self.stats_at else None,
            }

    def _session_rows(self, now: float) -> dict:
        """One at a time: the one session's row (as --parallel shows each of its sessions')."""
        if self.session is None:
            return {}
        run = next(iter(self.running.values()), None)
        return {"sessions": [session_row(self.session, run, now)]}

    def recent_requests(self) -> list[dict]:
        """The request list of /v1/status and the Monitor, newest first."""
        with self.lock:
            running = {n: (r.tokens, r.since) for n, r in self.running.items()}
        return self.requests.view(running=running, serving=self.state == "ready")

    def stop(self) -> None:
        self._stop.set()

    # ---- on the coordinator's thread ------------------------------------------------------------
    def attach(self, session: HeadSession, more: list[HeadSession] = (),
               prompt_budget: int = 0) -> None:
        """`more`: the other sessions of --parallel (jobs then run at once, batched)."""
        from .parallel import ParallelRuns
        self.session = session
        self.coord = session.coord
        self.parallel = (ParallelRuns(self, [session, *more], prompt_budget or 1,
                                      STATS_EVERY_S, STATS_TIMEOUT_S) if more else None)
        self.lost = {}
        self.state, self.error = "ready", None

    def _note_lost(self) -> None:
        """What /health reports: the stage ranks lost (rejoin) as the coordinator last saw them."""
        lost = getattr(self.coord, "lost", None) or {}
        if lost != self.lost:
            with self.lock:
                self.lost = dict(lost)

    def reload(self) -> None:
        """After a failure, while fresh ranks load: requests get 503, /health shows the loading
        progress and the error that caused the restart."""
        self.state = "loading"
        self.session = self.coord = None

    def fail(self, message: str) -> None:
        self.state, self.error = "failed", message
        self._drain(503, message, "unavailable")

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Serve jobs until stop(); a dead rank raises RankFailure (after failing every job)."""
        try:
            while not self._stop.is_set() and not should_stop():
                try:
                    if self.parallel is not None:   # jobs at once (--parallel)
                        if self.parallel.turn():
                            self._note_lost()
                            continue
                        raise queue.Empty
                    job = self.jobs.get(timeout=0.05)
                except queue.Empty:
                    self.coord.idle(0.0)
                    self._note_lost()
                    if time.monotonic() - self.stats_at > STATS_EVERY_S:
                        self._refresh_stats()
                    continue
                self._run_job(job)
                self._note_lost()
        except RankFailure as e:
            self.fail(str(e))
            raise
        finally:
            if self.state == "ready":
                self.state = "stopping"
                self._drain(503, "the server is stopping", "unavailable")

    def _drain(self, status: int, message: str, code: str) -> None:
        with self.lock:
            running = [r.job for r in self.running.values()]
        for job in self.parallel.jobs_running() if self.parallel else running:
            job.post(Event("error", status=status, message=message, code=code))
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            job.post(Event("error", status=status, message=message, code=code))
            with self.lock:      # admitted, then failed unrun: an error like the running one's
                self.totals["requests_error"] += 1
            self.requests.finished(job, "requests_error")

    def _refresh_stats(self) -> None:
        self.take_stats(self.coord.stats(timeout_s=STATS_TIMEOUT_S))

    def take_stats(self, replies: dict) -> None:
        """The ranks' counters that came back (asked and waited for here, or with --parallel
        asked without waiting and met by the scheduler's pump)."""
        with self.lock:
            for rank, rep in replies.items():
                acc = self.rank_counters.setdefault(rank, {})
                for k, v in rep.counters.items():
                    acc[k] = int(v) if COUNTERS_ARE_TOTALS else acc.get(k, 0) + int(v)
                self.rank_gauges[rank] = dict(rep.gauges)
            self.stats_at = time.monotonic()

    def _resumed(self, run: RunningJob, reused: int, own: int) -> None:
        with self.lock:
            run.cached_tokens = run.position = reused
            run.conversation = "none" if not reused else "held" if reused <= own else "kept"

    def _read_to(self, run: RunningJob, pos: int) -> None:
        with self.lock:
            run.position = pos

    def _run_job(self, job: Job, session: HeadSession | None = None, refresh: bool = True) -> None:
        """Run one job on `session` (the worker's own by default); `refresh`: then ask the ranks
        for their counters (only on the coordinator's thread)."""
        session = session or self.session
        if job.cancelled.is_set():     # its client left while it waited
            with self.lock:
                self.totals["requests_cancelled"] += 1
            return
        spec = job.spec
        started = time.monotonic()
        self.latency.queue_wait.observe(started - job.queued_at)
        run = RunningJob(job, since=started, session=session.session_id)
        with self.lock:
            self.running[job.number] = run
        self.requests.started(job)

        failure: list[BaseException] = []
        last_token_at: list[float] = []
        stream = TextStream(self.tok, spec)
        pending_logprob: list[TokenLogprob] = []

        def on_token(t: int) -> None:
            try:
                now = time.monotonic()
                if last_token_at:
                    self.latency.inter_token.observe(now - last_token_at[0])
                    last_token_at[0] = now
                else:
                    self.latency.time_to_first_token.observe(now - job.queued_at)
                    last_token_at.append(now)
                self.decode_rate.add(1, now)
                with self.lock:
                    if run.tokens == 0:
                        run.since = now
                    run.tokens += 1
                    run.position += 1
                ev = stream.push(t, pending_logprob.pop() if pending_logprob else None)
                if ev is not None:
                    job.post(ev)
            except Exception as e:  # noqa: BLE001 - a bug here cancels this request, not the run
                if not failure:
                    log.exception("request %s: turning token %d into text failed", job.id, t)
                    failure.append(e)

        outcome = "requests_error"
        result: Result | None = None
        choices: list[Choice] = []
        reused = read = 0
        prompt_ms = decode_ms = 0.0
        prompt_logprobs = None
        drafted = accepted = 0
        runs = [(p, j, ids, context) for p, (ids, context) in enumerate(spec.prompts)
                for j in range(spec.n)]
        try:
            for index, (p, j, ids, context) in enumerate(runs):
                if index:
                    stream = TextStream(self.tok, spec, context)
                stream.index = index
                # what the session itself could resume from: more came from a kept conversation
                own = session.reusable(ids) if ids and session.salt == spec.cache_salt else 0
                out = session.generate(
                    ids, spec.max_new, _choice_params(spec.params, j),
                    stop_ids=spec.stop_ids, on_token=on_token, on_logprob=pending_logprob.append,
                    on_resume=lambda n, own=own: self._resumed(run, n, own),
                    on_progress=lambda pos, *_: self._read_to(run, pos),
                    on_prompt_logprobs=lambda lps: job.post(Event("prompt", index=index,
                                                                  logprobs=lps)),
                    logprobs=LogprobRequest(spec.logprobs.tokens, spec.logprobs.top,
                                            spec.logprobs.prompt and j == 0),
                    should_cancel=lambda: job.cancelled.is_set() or stream.stop_hit or bool(failure),
                    # cache_prompt false: nothing from before the request (its own runs reuse)
                    cache_salt=spec.cache_salt, reuse=spec.cache_prompt or index > 0)
                if failure:
                    raise failure[0]
                if job.cancelled.is_set() and not stream.stop_hit:
                    outcome = "requests_cancelled"
                    return
                ev = stream.finish()
                if ev is not None:
                    job.post(ev)
                reason = "stop" if stream.stop_hit or out.reason == "stop" else "length"
                if j == 0:    # the later choices of this prompt read it from the cache
                    reused += out.reused
                    prompt_logprobs = out.prompt_logprobs if spec.logprobs.prompt else None
                choices.append(Choice(index, stream.text, list(stream.tokens), reason,
                                      stream.logprobs, prompt=p, prompt_logprobs=prompt_logprobs))
                read += out.read
                drafted, accepted = drafted + out.drafted, accepted + out.accepted
                prompt_ms += out.prompt_ms
                decode_ms += out.decode_ms
            completion = sum(len(c.token_ids) for c in choices)
            prompt_tokens = sum(len(ids) for ids, _ in spec.prompts)
            result = Result(choices=choices, prompt_tokens=prompt_tokens,
                            completion_tokens=completion, reused=reused, prompt_read=read,
                            prompt_ms=prompt_ms, decode_ms=decode_ms, drafted=drafted,
                            accepted=accepted)
            job.post(Event("done", result=result))
            outcome = "requests_ok"
            self.latency.request.observe(time.monotonic() - job.queued_at)
            with self.lock:
                self.totals["prompt_tokens"] += prompt_tokens
                self.totals["prompt_tokens_read"] += read
                self.totals["generated_tokens"] += completion
                self.totals["draft_tokens"] += drafted
                self.totals["draft_tokens_accepted"] += accepted
                self.last = dict(result.timings(), completion_tokens=completion,
                                 finished=time.time())
        except ValueError as e:          # the head refused the prompt (checked earlier, normally)
            job.post(Event("error", status=400, message=str(e), code="invalid_request"))
        except RankLost as e:            # a rank died; its replacement is loading (--rejoin)
            log.error("request %s failed: %s", job.id, e)
            job.post(Event("error", status=503, message=str(e), code="unavailable"))
        except RequestError as e:        # a rank failed this request; the ranks are still up
            log.error("request %s failed: %s", job.id, e)
            job.post(Event("error", status=500, message=str(e), code="request_failed"))
        except RankFailure as e:         # the run is over: this request learns why
            job.post(Event("error", status=503, message=str(e), code="unavailable"))
            raise
        except Exception as e:           # a bug must fail this request only
            log.exception("request %s failed", job.id)
            session.tokens = []
            job.post(Event("error", status=500, message=f"internal error: {type(e).__name__}: {e}",
                           code="internal"))
        except BaseException:            # Ctrl-C / SIGTERM: the stream ends with a message
            job.post(Event("error", status=503, message="the server is stopping", code="unavailable"))
            raise
        finally:
            with self.lock:
                self.running.pop(job.number, None)
                self.totals[outcome] += 1
            self.requests.finished(job, outcome, result if outcome == "requests_ok" else None,
                                   len(stream.tokens))
        if refresh and time.monotonic() - self.stats_at > STATS_EVERY_S / 4:
            self._refresh_stats()


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: its own seed (the request's + index) when the request has one."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2 ** 64)
