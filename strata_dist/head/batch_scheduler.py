"""Several requests at once through one pipeline (--parallel B): their decode steps batched.

Each running request has its own session on every stage (the head names it: one HeadSession per
slot). The scheduler, on the thread that owns the coordinator's sockets, sends:
- a batched decode step (protocol/batch.py) with an entry per request that has a token to read
  next (with --spec K, that token and the drafts the last stage sent with it: a verify window of
  its own in the step; a request with no drafts this step has one row), while fewer such steps
  than stages are in flight (each step a group of requests of its own: with K stages, K groups
  keep every stage busy; on any number of stages, as many groups as a graph replay's DECODE_ROWS
  rows need, so that one stage works on a group while the head reads another's tokens and sends
  it on): every stage runs all rows once, the last stage answers each request's
  Tokens, all of the step's in one StepTokens (it never starts the next batched step itself:
  `Sampling.head_steps`);
- prompt chunks of one request at a time between those steps: while any request decodes, at most
  `prompt_budget` tokens of prompt ride ahead of each decode step (a long prompt never stalls the
  running streams for more than a chunk a step); with nobody decoding, the window a lone request
  has (coordinator.PROMPT_WINDOW_PER_STAGE chunks per stage).

A request alone in the scheduler decodes as in the one-request path: the head sends its first
decode step as a plain one (no `batch`), and the last stage samples it and sends each next step
itself (`loop`), with no head round trip a token (measured on CPU ranks, that round trip -- the
head's process woken, its pump, the first stage woken again -- was what a lone request paid a
token over the one-request path; the batched step's own code cost about what the one-row step's
does). When a second request is admitted the head sends
the last stage a HandBack; its next Token says `handed_back` and from there the head steps it in
its batches (the second request's prompt goes meanwhile, as beside any running request).

A request is submitted from its own thread with `run_request` (the coordinator's signature): it
blocks there, receiving its events on that thread, while `pump` (on the sockets' thread) moves
everything along. Every wait is bounded."""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from protocol import Error, PromptProgress, ProtocolTimeout, StepTokens, Token, Tokens
from protocol.batch import MAX_BATCH_ROWS, MAX_WINDOW_ROWS, BatchRows
from protocol.conversations import ConversationStep
from protocol.messages import Sampling

from ..plan.pricing import DECODE_ROWS

from .coordinator import (PROMPT_WINDOW_PER_STAGE, RankFailure, RankLost, RequestError,
                          StreamEvent)

log = logging.getLogger("strata.batch")

WAIT_S = 0.05      # how often a waiting request looks at its cancel flag


@dataclass
class _Stream:
    """One request in the scheduler: where its prompt is, and the token it reads next."""
    session_id: int
    pos: int
    ids: list[int]
    sampling: Sampling
    prompt_chunk: int
    checkpoint_at: tuple | list
    conversation: ConversationStep | None
    step_timeout_s: float
    events: queue.Queue = field(default_factory=queue.Queue)   # to the request's own thread
    cancel: threading.Event = field(default_factory=threading.Event)
    request_id: int = 0
    sent: int = 0                   # prompt chunks sent
    read: int = 0                   # prompt chunks the last stage has read
    next_token: int | None = None   # sampled, not yet read by the stages
    next_pos: int = 0
    drafts: list[int] = field(default_factory=list)   # --spec: the next window's, after next_token
    window: list[int] = field(default_factory=list)   # the drafts of its window in flight
    window_got: int = 0             # that window's Tokens come back so far
    cancelled: bool = False         # Cancel sent to every stage
    # alone, its decode steps run on the last stage's own loop (the one-request path): the head
    # reads its Tokens until one says `handed_back` (after a HandBack, `handing_back`)
    looping: bool = False
    handing_back: bool = False
    tokens_handing_back: int = 0    # its Tokens since its HandBack went, the last stage looping on
    # when something of it last went out or came back: its clock runs only while the pipeline
    # owes it an answer (`_owed`), so a request queued behind another's prompt is never timed out
    last_event: float = field(default_factory=time.monotonic)

    @property
    def chunks(self) -> int:
        return max(1, -(-len(self.ids) // self.prompt_chunk))


@dataclass
class _Step:
    request_id: int
    waiting: set[int]               # rows' requests whose Token has not come back
    sent_at: float = field(default_factory=time.monotonic)


class BatchScheduler:
    def __init__(self, coordinator, parallel: int, prompt_budget: int):
        if not 1 <= parallel <= MAX_BATCH_ROWS:
            raise ValueError(f"parallel must be 1..{MAX_BATCH_ROWS}, got {parallel}")
        if prompt_budget < 1:
            raise ValueError(f"the prompt budget per decode step must be >= 1, got "
                             f"{prompt_budget}")
        self.coord, self.parallel, self.prompt_budget = coordinator, parallel, prompt_budget
        self._submitted: queue.Queue[_Stream] = queue.Queue()
        self.streams: dict[int, _Stream] = {}         # by request id
        self._prompts: deque[_Stream] = deque()       # waiting for their prompt, in order
        self._reading: _Stream | None = None          # the one whose chunks go out now
        # batched steps in flight, by their request id: up to one per stage, each a group of
        # requests of its own, so stage k works on one group while stage k+1 works on another
        self._steps: dict[int, _Step] = {}
        # when the pipeline last said anything (or work went out to an idle one): silent for a
        # step timeout with answers owed, it is stuck or dead
        self._heard_at = time.monotonic()
        self._pumped_at = time.monotonic()            # the last turn of `pump` (any thread reads it)
        self.most_in_flight = 0                       # the most steps in flight at once so far
        self.steps = 0                                # batched steps sent (for tests, status)
        self.requests = 0                             # requests in them, summed over the steps
        # rows in them: a request's verify window (--spec) is 1 + its drafts rows of a step
        self.rows = 0
        self.accepted = 0                             # their windows' drafts accepted
        self.loops = 0                                # lone requests' steps left to the last stage
        self.hand_backs = 0                           # ... and taken back for a batch
        # the most Tokens a request made from its HandBack to its Token `handed_back`, that one
        # included: the steps a looping request takes to join the batch
        self.most_hand_back_tokens = 0
        # what this turn of `pump` tells the requests' threads, held until the step it made due
        # has gone out (`_flush`): a thread woken by its token competes with this one for the
        # interpreter, and the next batched step waits for this thread (on CPU ranks, holding
        # them cut the time from a step's tokens read to the next step sent about fourfold)
        self._held: list[tuple[_Stream, tuple]] = []

    # ---- from a request's own thread -------------------------------------------------------------
    def run_request(self, session_id: int, pos: int, ids: list[int], sampling: Sampling,
                    prompt_chunk: int, on_event: Callable[[StreamEvent], None],
                    step_timeout_s: float = 120.0,
                    should_cancel: Callable[[], bool] | None = None,
                    checkpoint_at: tuple[int, ...] | list[int] = (),
                    conversation: ConversationStep | None = None) -> str:
        """As Coordinator.run_request, from any thread but the one that calls `pump`."""
        st = _Stream(session_id, pos, list(ids), dataclasses.replace(sampling, head_steps=True),
                     prompt_chunk, checkpoint_at, conversation, step_timeout_s)
        self._submitted.put(st)
        # the scheduler fails a silent pipeline after step_timeout_s; this bound only guards
        # against a scheduler that stopped pumping (a request queued behind a long prompt may
        # hear nothing for longer while the pump moves the others along)
        stalled_s = step_timeout_s + 30
        submitted_at = time.monotonic()
        while True:
            if should_cancel is not None and not st.cancel.is_set() and should_cancel():
                st.cancel.set()
            try:
                kind, payload = st.events.get(timeout=WAIT_S)
            except queue.Empty:
                if time.monotonic() - max(self._pumped_at, submitted_at) > stalled_s:
                    raise RankFailure(f"the scheduler has not run for {stalled_s:.0f} s") \
                        from None
                continue
            if kind == "event":
                on_event(payload)
            elif kind == "done":
                return payload
            else:
                raise payload

    def active(self) -> int:
        """Requests submitted and not finished (any thread: a snapshot)."""
        return len(self.streams) + self._submitted.qsize()

    # ---- on the sockets' thread -----------------------------------------------------------------
    def pump(self, wait_s: float) -> None:
        """Admit new requests, send what is due, handle what came back (waiting up to wait_s,
        for the pipeline or, with nothing running, for a request). The requests' threads hear
        what came back at the end of the turn, after the step it made due went out (`_post`)."""
        try:
            self._pump(wait_s)
        finally:
            self._flush()

    def _pump(self, wait_s: float) -> None:
        self._pumped_at = time.monotonic()
        self._admit(0.0 if self.streams else wait_s)
        self._cancels()
        self._take_back_loops()
        self._send_due_or_fail()
        self._flush()      # nothing held over the wait for the pipeline
        try:
            events = self.coord._pump(wait_s if self.streams else 0.0)
        except RankFailure as e:
            self._fail_all(e)
            raise
        if self.coord.lost:
            r, why = next(iter(self.coord.lost.items()))
            for st in list(self.streams.values()):
                self.coord._cancel_on_survivor(st.request_id)
            self._fail_all(RankLost(f"{why}; the request is lost, a replacement of rank {r} is "
                                    f"loading"))
            return
        for msg in events:
            if isinstance(msg, StepTokens):   # a batched step's Tokens, in one message
                for token in msg.tokens:
                    self._on_message(token)
            else:
                self._on_message(msg)
        self._send_due_or_fail()
        self._check_timeouts()

    def _admit(self, wait_s: float) -> None:
        while True:
            try:
                st = self._submitted.get(timeout=wait_s) if wait_s > 0 else \
                    self._submitted.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            if self.coord.lost:
                r, why = next(iter(self.coord.lost.items()))
                st.events.put(("error", RankLost(f"rank {r} is lost ({why}); a replacement is "
                                                 f"loading")))
                continue
            st.request_id = self.coord._last_request_id = next(self.coord._request_ids)
            self.streams[st.request_id] = st
            self._prompts.append(st)

    def _cancels(self) -> None:
        for st in list(self.streams.values()):
            if st.cancel.is_set() and not st.cancelled:
                st.cancelled = True
                if st.sent == 0:          # nothing of it reached a stage
                    self._finish(st, "cancelled")
                else:                     # the last stage answers a final Token "cancelled"
                    self.coord._cancel_everywhere(st.request_id)
                    st.last_event = time.monotonic()

    def _take_back_loops(self) -> None:
        """A request looping alone gives its steps back once another is admitted (HandBack): the
        head batches them from its Token that says `handed_back`, a step or so later."""
        if len(self.streams) < 2:
            return
        for st in self.streams.values():
            if st.looping and not st.handing_back and not st.cancelled:
                st.handing_back = True
                self.hand_backs += 1
                self.coord._hand_back(st.request_id)

    def _send_due_or_fail(self) -> None:
        """_send_due; a first stage that takes nothing fails every request (it says why)."""
        try:
            self._send_due()
        except RankLost as e:
            self._fail_all(e)
        except RequestError as e:
            for st in list(self.streams.values()):
                if st.sent:
                    self.coord._cancel_everywhere(st.request_id)
            self._fail_all(e)

    def _send_due(self) -> None:
        sender = None
        rows = [st for st in self.streams.values()
                if st.next_token is not None and not st.cancelled][:self.parallel]
        if rows and len(self.streams) == 1 and not self._steps:
            self._send_loop(sender := self._sender(), rows[0])
        elif rows:
            groups, per_step = self._decode_groups(len(rows))
            while rows and len(self._steps) < groups:
                sender = sender or self._sender()
                step, rows = rows[:per_step], rows[per_step:]
                self._send_step(sender, step)
        # prompt chunks: one request at a time, paced
        in_flight = sum(st.sent - st.read for st in self.streams.values())
        running = any(st.sent >= st.chunks and st.read >= st.chunks
                      for st in self.streams.values())
        while True:
            st = self._reading
            if st is None or st.sent >= st.chunks or st.cancelled:
                st = self._reading = self._next_prompt()
                if st is None:
                    return
            # the window is in chunks of the prompt being read (its own chunk size): computed
            # before one was picked, a prompt budget of N tokens let N chunks ride ahead
            window = (max(1, self.prompt_budget // st.prompt_chunk) if running
                      else PROMPT_WINDOW_PER_STAGE * max(1, len(self.coord._stages())))
            if in_flight >= window:
                return
            sender = sender or self._sender()
            i = st.sent
            self.coord._send_chunk(sender, st.request_id, st.session_id, st.pos + i * st.prompt_chunk,
                                   st.ids[i * st.prompt_chunk:(i + 1) * st.prompt_chunk], i, st.chunks,
                                   st.sampling, st.checkpoint_at,
                                   st.conversation if i == 0 else None)
            st.sent += 1
            st.last_event = time.monotonic()
            in_flight += 1

    def _decode_groups(self, ready: int) -> tuple[int, int]:
        """How many batched steps the decoding requests go in at once (the `ready` ones and those
        of the steps in flight), and the requests of each: one a stage at least (stage k on one
        group while stage k + 1 on another), and as many as they fill DECODE_ROWS-row graph
        replays, a request a row (a rank runs a larger step as several replays anyway, back to
        back; split into steps, one stage runs a group while the head reads another's tokens and
        sends it on, instead of idling through that round trip). With --spec a request's window
        is several rows but counts as one here: split by rows, whole windows would go in more,
        emptier steps than their rows need, so a group holds up to DECODE_ROWS windows."""
        requests = ready + sum(len(s.waiting) for s in self._steps.values())
        groups = max(1, len(self.coord._stages()), -(-requests // DECODE_ROWS))
        return groups, -(-requests // groups)

    def _next_prompt(self) -> _Stream | None:
        while self._prompts:
            st = self._prompts.popleft()
            if st.request_id in self.streams and not st.cancelled:
                return st
        return None

    def _sender(self):
        first = next(s for s in self.coord.ranks if s.assign is not None and s.assign.first)
        return self.coord._first_stage_sender(first)

    def _send_step(self, sender, rows: list[_Stream]) -> None:
        step_id = self.coord._last_request_id = next(self.coord._request_ids)
        each = [1 + len(st.drafts) for st in rows]
        batch = BatchRows(request_ids=[st.request_id for st in rows],
                          session_ids=[st.session_id for st in rows],
                          positions=[st.next_pos for st in rows],
                          window_rows=each if max(each) > 1 else [])
        ids = [i for st in rows for i in [st.next_token] + st.drafts]
        now = time.monotonic()
        for st in rows:
            st.next_token, st.last_event = None, now
            st.window, st.drafts, st.window_got = st.drafts, [], 0
        self._steps[step_id] = _Step(step_id, {st.request_id for st in rows})
        self.most_in_flight = max(self.most_in_flight, len(self._steps))
        self.steps += 1
        self.requests += len(rows)
        self.rows += sum(each)
        self._send_decode(sender, Tokens(request_id=step_id, session_id=0, pos=0, ids=ids,
                                         batch=batch))

    def _send_loop(self, sender, st: _Stream) -> None:
        """A request alone: its next step as a plain decode step (its token, and with --spec its
        drafts: a verify window), which the last stage follows with the next ones itself, as in
        the one-request path, until the request ends or the head takes it back."""
        ids = [st.next_token] + st.drafts
        st.next_token, st.drafts, st.window, st.window_got = None, [], [], 0
        st.looping, st.last_event = True, time.monotonic()
        self.loops += 1
        self._send_decode(sender, Tokens(request_id=st.request_id, session_id=st.session_id,
                                         pos=st.next_pos, ids=ids))

    @staticmethod
    def _send_decode(sender, step: Tokens) -> None:
        """A decode step (batched or a lone request's) to the first stage, bounded."""
        try:
            sender.send(step, timeout_ms=10_000)
        except ProtocolTimeout as e:   # its heartbeats tell whether it died
            raise RequestError(f"the first stage took no decode step: {e}") from None

    def _on_message(self, msg) -> None:
        rid = getattr(msg, "request_id", None)
        self._heard_at = time.monotonic()
        if isinstance(msg, Error) and rid in self._steps:
            # the whole step failed on a stage: every request in it fails (the ranks serve on)
            step = self._steps.pop(rid)
            for r in step.waiting:
                st = self.streams.get(r)
                if st is not None:
                    self.coord._cancel_everywhere(r)
                    self._fail(st, RequestError(msg.message))
            return
        st = self.streams.get(rid)
        if st is None:
            return      # a late message of a request that ended
        st.last_event = time.monotonic()
        if not isinstance(msg, Token) or st.cancelled:
            self._answered(rid)
        if isinstance(msg, Error):
            if not st.cancelled:
                self.coord._cancel_everywhere(rid)
            self._fail(st, RequestError(msg.message))
        elif isinstance(msg, PromptProgress):
            st.read = msg.chunk_index + 1
            self._post(st, ("event", StreamEvent("progress", msg)))
            if msg.chunk_index == msg.chunk_total - 1 and st.sampling.max_new <= 0:
                self._finish(st, "")
        elif isinstance(msg, Token):
            if msg.reason != "cancelled":
                self._post(st, ("event", StreamEvent("token", msg)))
            if msg.done:
                self._finish(st, msg.reason)
            elif st.cancelled:
                pass
            elif not st.looping:
                self._window_token(st, msg)
            else:
                st.tokens_handing_back += st.handing_back
                if msg.handed_back:   # the last stage stopped looping it: the head steps it now
                    self.most_hand_back_tokens = max(self.most_hand_back_tokens,
                                                     st.tokens_handing_back)
                    st.looping = st.handing_back = False
                    st.tokens_handing_back = 0
                    self._window_token(st, msg)

    def _window_token(self, st: _Stream, msg: Token) -> None:
        """A Token of st's step, not its last: a draft of its window that matched comes with the
        window's next Token after it; else the window ends here, and this token (with the drafts
        the last stage sent with it) is what st reads next."""
        j = st.window_got
        st.window_got += 1
        if j < len(st.window) and msg.token_id == st.window[j]:
            self.accepted += 1
            return
        st.next_token, st.next_pos = msg.token_id, msg.pos
        st.drafts, st.window = list(msg.drafts[:MAX_WINDOW_ROWS - 1]), []
        self._answered(st.request_id)

    def _owed(self, st: _Stream) -> bool:
        """The pipeline owes st an answer: prompt chunks sent and unread, a row of a step in
        flight, its next Token while the last stage loops it, or the final Token of a Cancel."""
        return (st.sent > st.read or st.cancelled or st.looping
                or any(st.request_id in step.waiting for step in self._steps.values()))

    def _check_timeouts(self) -> None:
        """A pipeline silent for a step timeout while it owes answers is stuck or dead: every
        request fails (RankFailure). One request it owes and has not answered for its step
        timeout, while it answers the others, fails alone (cancelled everywhere)."""
        now = time.monotonic()
        owed = [st for st in self.streams.values() if self._owed(st)]
        if not owed:
            self._heard_at = now       # the clock starts when work goes out to an idle pipeline
            return
        timeout_s = max(st.step_timeout_s for st in owed)
        if now - self._heard_at > timeout_s:
            what = ("a token" if all(st.read >= st.chunks for st in owed)
                    else "prompt progress")
            e = RankFailure(f"no {what} for {timeout_s:g} s from the pipeline")
            self._fail_all(e)
            raise e
        for st in owed:
            if now - st.last_event <= st.step_timeout_s:
                continue
            if st.cancelled:    # its final Token never came: it ended all the same
                self._finish(st, "cancelled")
                continue
            self.coord._cancel_everywhere(st.request_id)
            what = "a token" if st.read >= st.chunks else "prompt progress"
            self._fail(st, RequestError(f"no {what} for {st.step_timeout_s:g} s for this "
                                        f"request while the pipeline answered others"))

    def _post(self, st: _Stream, item: tuple) -> None:
        """An event, the end or the failure of st, for its thread at the end of this turn."""
        self._held.append((st, item))

    def _flush(self) -> None:
        """The turn's events to the requests' threads, in the order they happened."""
        held, self._held = self._held, []
        for st, item in held:
            st.events.put(item)

    def _finish(self, st: _Stream, reason: str) -> None:
        self._drop(st)
        self._post(st, ("done", reason))

    def _fail(self, st: _Stream, error: BaseException) -> None:
        self._drop(st)
        self._post(st, ("error", error))

    def _drop(self, st: _Stream) -> None:
        self.streams.pop(st.request_id, None)
        if self._reading is st:
            self._reading = None
        self._answered(st.request_id)

    def _answered(self, rid: int) -> None:
        """Request rid's row of its step in flight came back (or it ended): a step whose rows
        all came back is done."""
        for step_id, step in list(self._steps.items()):
            if rid in step.waiting:
                step.waiting.discard(rid)
                if not step.waiting:
                    del self._steps[step_id]

    def _fail_all(self, error: BaseException) -> None:
        for st in list(self.streams.values()):
            self._fail(st, error)
        self._prompts.clear()
        self._steps.clear()
