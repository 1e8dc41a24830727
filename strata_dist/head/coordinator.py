"""The coordinator: admits ranks (HMAC handshake, model fingerprint), hands each its assignment,
checks what it loaded against what was priced, and drives requests through the pipeline.

It owns two sockets: a ROUTER for control (handshake, Register, Ready, Heartbeat, Error) and a
PULL where the last stage's PromptProgress/Token and any stage's request Error arrive. One thread
uses both. Every wait is bounded; a rank that dies or goes silent fails the request in flight with
a message naming it (`RankFailure`). Losing a rank and admitting its replacement (rejoin) is
rank_rejoin.py's part of it."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import zmq
from dataclasses import dataclass
from typing import Callable

from protocol import (Assign, Heartbeat, Cancel, Channel, Error, HandBack, Poller, PromptProgress,
                      ProtocolError, ProtocolTimeout, Ready, Register, Release, RouterChannel,
                      Shutdown, Token, Tokens)
from protocol.auth import Authenticator, StrangerLimits, admit
from protocol.seal import LinkSeal, link_key, new_nonce
from protocol.conversations import ConversationStep
from protocol.messages import ERR_VERSION, Sampling, Stats, StatsReply, VersionMismatch
from protocol.transport import peer_address, show_identity

from protocol.limits import FrameCaps

from ..checkpoints import chunk_positions
from .rank_rejoin import RankFailure, RankLost, RankRejoin, RankSlot, RequestError

log = logging.getLogger("strata.coordinator")

HEARTBEAT_LOST_S = 10.0
# One turn of the pump handles at most this many control messages, then the inbox: control traffic (a
# stranger's flood included) never keeps the pipeline's tokens waiting.
CONTROL_BATCH = 64
INBOX_BATCH = 1024
# Prompt chunks in flight (sent, not yet reported by the last stage) per pipeline stage: one
# computing and more queued behind it, so a stage never waits on the head's round trip (measured
# on two CPU stages with 8-token chunks, 2 per stage read a prompt ~25% slower than sending every
# chunk up front, 4 as fast). A cancel skips queued chunks unread, so the window costs it nothing.
PROMPT_WINDOW_PER_STAGE = 4


def _warn(message: str) -> None:
    log.warning("%s", message)


@dataclass
class StreamEvent:
    kind: str            # "progress" | "token" | "cancelled" (the final Token of a cancel)
    msg: object


class Coordinator(RankRejoin):
    def __init__(self, secret: bytes, fingerprint: str, control_bind: str, head_bind: str,
                 liveness: Callable[[], str | None] | None = None,
                 heartbeat_lost_s: float = HEARTBEAT_LOST_S,
                 on_refusal: Callable[[str], None] | None = None,
                 rejoin_timeout_s: float | None = None,
                 on_rejoin: Callable[[RankSlot], None] | None = None):
        """`liveness()` returns an error message when a locally spawned rank process has died.
        A rank silent for `heartbeat_lost_s` is dead; `on_refusal(message)` hears every refused rank.

        Rejoin (`rejoin_timeout_s` set): a lost rank no longer ends the launch. The request in
        flight fails (RankLost), and a replacement that registers with the lost rank's number (or
        host and device) on its host takes its assignment and endpoints while the others keep their
        weights, caches and sessions; `on_rejoin(slot)` checks what it loaded. The next request
        waits up to `rejoin_timeout_s` for it."""
        self.fingerprint = fingerprint
        self.rejoin_timeout_s = rejoin_timeout_s
        self.on_rejoin = on_rejoin or (lambda slot: None)
        self.lost: dict[int, str] = {}      # rank -> why, until its replacement is Ready
        self.rejoins = 0                    # replacements that finished loading (HeadSession)
        self.endpoints_of: dict[int, dict[str, str]] = {}   # each rank's first endpoints
        self._last_request_id = 0
        self.heartbeat_lost_s = heartbeat_lost_s
        self.on_refusal = on_refusal or (lambda message: log.warning("%s", message))
        self.auth = Authenticator(secret, server_id="strata-coordinator")
        self.strangers = StrangerLimits()   # what peers without the secret may cost (and log)
        # every frame a rank sends either socket is a small message (protocol/limits.py)
        self.control = RouterChannel(peer="ranks", max_msg_bytes=FrameCaps.CONTROL)
        self.control_endpoint = self.control.bind(control_bind)
        self.inbox = Channel("pull", peer="last stage", max_msg_bytes=FrameCaps.CONTROL)
        self.head_endpoint = self.inbox.bind(head_bind)
        # TCP data links carry only messages sealed under this launch's key for their own link
        # (protocol/seal.py); the ranks derive it from the secret and the nonce their Assign
        # carries. A replaced rank's endpoints move to a new epoch (link_epochs): frames sealed
        # for the process it replaces do not open there.
        self.link_nonce = new_nonce()
        self.link_epochs: dict[str, int] = {}
        self.seal = LinkSeal(link_key(secret, self.link_nonce))
        self.inbox.seal_tcp(self.seal)
        self._rekeying: set[int] = set()    # ranks told new link epochs that have not answered
        self.poller = Poller(self.control, self.inbox)
        self.liveness = liveness or (lambda: None)
        self.ranks: list[RankSlot] = []
        self._by_identity: dict[bytes, RankSlot] = {}
        self._request_ids = itertools.count(1)
        # messages from a registered rank, by type (Register and pulses are handled before)
        self._slot_handlers = {Ready: self._on_ready, StatsReply: self._on_stats_reply,
                               Error: self._on_rank_error}
        self._stats: dict[int, StatsReply] = {}
        self.routing: dict[int, tuple[int, list]] = {}   # rank -> (lb, routing totals)
        # rank -> its totals when it was last lost: its replacement counts from zero, so its own
        # totals are added to these (the profile keeps the history of every process of the rank)
        self._routing_base: dict[int, tuple[int, list]] = {}
        self._senders: dict[str, Channel] = {}
        self.optional: set[int] = set()   # ranks whose loss does not end the launch (helpers)

    # ---- admission -------------------------------------------------------------------------------
    def wait_for_ranks(self, n: int, timeout_s: float) -> list[RankSlot]:
        deadline = time.monotonic() + timeout_s
        while len(self._by_identity) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailure(f"only {len(self._by_identity)} of {n} ranks registered within "
                                  f"{timeout_s:.0f} s")
            self._pump(min(left, 0.5))
        # Rank numbers follow the registration hints (the launcher's spawn order), then host and
        # device (ranks started by hand or by units: the same numbering whatever the arrival order).
        slots = sorted(self._by_identity.values(),
                       key=lambda s: (s.register.rank is None, s.register.rank or 0, s.register.host,
                                      s.register.devices[0].index if s.register.devices else 0))
        for i, s in enumerate(slots):
            s.rank = i
            self.endpoints_of[i] = dict(s.register.endpoints)
        self.ranks = slots
        return slots

    def _on_control(self, identity: bytes, msg, frame, stranger: bool) -> None:
        reply = self.auth.guard(identity, msg)
        if reply is not None:
            self._send(identity, reply, stranger=stranger)
            if isinstance(reply, Error) and reply.fatal:
                self._refused(identity, frame, f"refused a rank: {reply.message}", stranger)
            return
        if isinstance(msg, Register):
            self._on_register(identity, msg)
            return
        slot = self._by_identity.get(identity)
        if slot is None:
            if isinstance(msg, Heartbeat):   # a rank's pulse: its own authenticated connection
                self._on_pulse(msg)
            return
        slot.last_seen = time.monotonic()
        handler = self._slot_handlers.get(type(msg))
        if handler is not None:
            handler(slot, msg)

    def _on_register(self, identity: bytes, msg: Register) -> None:
        refusal = admit(msg, self.fingerprint)
        if refusal is not None:
            self._send(identity, refusal)
            self.on_refusal(f"refused a rank: {refusal.message}")
            return
        if self.ranks:  # registration is closed once the ranks are numbered...
            refusal = self._replacement(identity, msg)   # ...but for a lost rank's replacement
            if refusal is not None:
                self._send(identity, Error(rank=None, request_id=None, fatal=True,
                                           message=refusal))
                if self.rejoin_timeout_s is not None:
                    self.on_refusal(f"refused a rank: {refusal}")
            return
        self._by_identity[identity] = RankSlot(identity, msg)

    def _on_pulse(self, msg: Heartbeat) -> None:
        beat = next((r for r in self.ranks if r.rank == msg.rank and
                     (not msg.pid or msg.pid == r.register.pid)), None)
        if beat is not None:
            beat.last_seen = time.monotonic()

    def _on_ready(self, slot: RankSlot, msg: Ready) -> None:
        if slot.ready is not None and slot.rank in self._rekeying:
            self._rekeying.discard(slot.rank)   # it keys its links by the new epochs now
            return
        slot.ready = msg
        if slot.rank in self.lost and self.ranks and self.ranks[slot.rank] is slot:
            self.on_rejoin(slot)
            del self.lost[slot.rank]
            self.rejoins += 1
            log.info("rank %d rejoined (pid %s)", slot.rank, slot.register.pid)

    def _on_stats_reply(self, slot: RankSlot, msg: StatsReply) -> None:
        self._stats[slot.rank] = msg
        if msg.routing:     # a stage's routing totals (--expert-profile-out): the latest kept
            rows = msg.routing
            base = self._routing_base.get(slot.rank)
            if base is not None and base[0] == msg.routing_lb:
                rows = [[a + b for a, b in zip(r, q)] for r, q in zip(rows, base[1])]
            self.routing[slot.rank] = (msg.routing_lb, rows)

    def _on_rank_error(self, slot: RankSlot, msg: Error) -> None:
        if msg.fatal:
            self.lose(slot.rank, f"rank {slot.rank} failed: {msg.message}")

    def _send(self, identity: bytes, msg, stranger: bool = False) -> None:
        """Answer a peer. A peer that has not proved the secret is answered only if its queue has room
        now: one that sends without reading its answers cannot make the pump wait on it."""
        try:
            self.control.send(identity, msg, timeout_ms=0 if stranger else 2000)
        except (ProtocolTimeout, ConnectionError) as e:
            if not stranger:
                log.warning("could not answer a peer: %s", e)

    def _refused(self, identity: bytes, frame, message: str, stranger: bool,
                 say: Callable[[str], None] | None = None) -> None:
        """Tell the operator of a refusal (`say`, default on_refusal): every one of a peer that proved
        the secret (a rank of another model), each of a stranger once per source a minute
        (StrangerLimits), the rest counted."""
        if stranger:
            source = (peer_address(frame) if frame is not None else None) or show_identity(identity)
            message = self.strangers.refusal(source, message)
        if message is not None:
            (say or self.on_refusal)(message)

    # ---- assignment --------------------------------------------------------------------------------
    def assign(self, assignments: list[Assign], timeout_s: float,
               on_ready: Callable[[RankSlot], None] | None = None) -> None:
        """Send each rank its Assign and wait until all report Ready."""
        for slot, a in zip(self.ranks, assignments):
            a.link_nonce = self.link_nonce
            a.link_epochs = dict(self.link_epochs)
            slot.assign = a
            self._send(slot.identity, a)
        deadline = time.monotonic() + timeout_s
        announced = set()
        while True:
            for s in self.ranks:
                if s.ready is not None and s.rank not in announced:
                    announced.add(s.rank)
                    if on_ready:
                        on_ready(s)
            if len(announced) == len(self.ranks):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [s.rank for s in self.ranks if s.ready is None]
                raise RankFailure(f"ranks {waiting} did not finish loading within {timeout_s:.0f} s")
            self._pump(min(left, 0.5))

    # ---- the event loop ----------------------------------------------------------------------------
    def _pump(self, wait_s: float) -> list:
        """Handle control traffic (waiting up to wait_s for something); return the data-plane messages that
        arrived. One call handles at most CONTROL_BATCH control messages, then the inbox."""
        problem = self.liveness()
        if problem:
            raise RankFailure(problem)
        events = []
        if self.poller.poll(int(wait_s * 1000)):
            for _ in range(CONTROL_BATCH):
                if not self._control_one():
                    break
            for _ in range(INBOX_BATCH):
                try:
                    msg, _ = self.inbox.recv(timeout_ms=0)
                except ProtocolTimeout:   # nothing waiting, or only frames that did not prove themselves
                    break
                except ProtocolError as e:  # garbage: dropped, never fatal
                    self._refused(b"the inbox", None, f"dropped an invalid message on the inbox: {e}",
                                  True, say=_warn)
                    continue
                events.append(msg)
        # after draining: heartbeats that queued while the head was busy elsewhere count
        self._check_heartbeats()
        summary = self.strangers.summary()
        if summary:
            self.on_refusal(summary)
        return events

    def _control_one(self) -> bool:
        """Read and handle one control message; False when none was waiting. A peer that has not proved
        the secret is held to its rate (StrangerLimits): the rest of its messages are dropped unread."""
        try:
            frames = self.control.recv_raw(timeout_ms=0)
        except ProtocolTimeout:
            return False
        identity = frames[0].bytes
        stranger = not self.auth.is_authenticated(identity)
        if stranger and not self.strangers.admit(identity):
            return True
        try:
            _, msg, _ = RouterChannel.parse(frames)
        except VersionMismatch as e:  # a rank of another build: say so, naming both versions
            self._send(identity, Error(rank=None, request_id=None, code=ERR_VERSION, fatal=True,
                                       message=str(e)), stranger=stranger)
            self._refused(identity, frames[0], f"refused a rank: {e}", stranger)
            return True
        except ProtocolError as e:  # garbage from a peer: dropped, never fatal
            self._refused(identity, frames[0], f"dropped an invalid message: {e}", stranger, say=_warn)
            return True
        self._on_control(identity, msg, frames[0], stranger)
        return True

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for s in self.ranks:
            if s.rank in self.optional or s.rank in self.lost:
                continue
            if s.ready is not None and now - s.last_seen > self.heartbeat_lost_s:
                self.lose(s.rank, f"rank {s.rank} ({s.register.host} pid {s.register.pid}) has "
                                  f"sent nothing for {now - s.last_seen:.0f} s")

    # ---- requests ----------------------------------------------------------------------------------
    def run_request(self, session_id: int, pos: int, ids: list[int], sampling: Sampling,
                    prompt_chunk: int, on_event: Callable[[StreamEvent], None],
                    step_timeout_s: float = 120.0,
                    should_cancel: Callable[[], bool] | None = None,
                    checkpoint_at: tuple[int, ...] | list[int] = (),
                    conversation: ConversationStep | None = None) -> str:
        """Send a prompt (tokens from position pos) through the pipeline and stream its events.
        Returns the stop reason ("stop", "length", "cancelled", or "" when max_new is 0).
        `checkpoint_at`: chunk boundaries where every stage checkpoints its part (checkpoints.py).
        `conversation`: what every stage keeps and restores first (conversation_table.py)."""
        self.await_ranks(should_cancel)
        request_id = self._last_request_id = next(self._request_ids)
        first = next(s for s in self.ranks if s.assign is not None and s.assign.first)
        sender = self._first_stage_sender(first)
        chunks = [ids[i:i + prompt_chunk] for i in range(0, len(ids), prompt_chunk)]
        # Paced prompt: at most `window` chunks are sent ahead of the last stage's progress, so the
        # stages still overlap, a cancel stops the sending, and a long prompt never fills the
        # first stage's queue (sent up front, 8,000 one-token chunks timed out there).
        window = PROMPT_WINDOW_PER_STAGE * max(1, len(self._stages()))
        sent = read = 0
        prompt_done = cancelled = False
        last_event = time.monotonic()
        while True:
            if not cancelled and should_cancel is not None and should_cancel():
                cancelled = True
                self._cancel_everywhere(request_id)
            while not cancelled and sent < len(chunks) and sent - read < window:
                self._send_chunk(sender, request_id, session_id, pos + sent * prompt_chunk, chunks[sent],
                                 sent, len(chunks), sampling, checkpoint_at,
                                 conversation if sent == 0 else None)
                sent += 1
            events = self._pump(0.05)
            if self.lost:
                r, why = next(iter(self.lost.items()))
                self._cancel_on_survivor(request_id)
                raise RankLost(f"{why}; the request is lost, a replacement of rank {r} is "
                               f"loading")
            for msg in events:
                if getattr(msg, "request_id", None) != request_id:
                    continue  # a late message of an earlier, failed request
                last_event = time.monotonic()
                if isinstance(msg, Error):
                    if not cancelled:   # the other stages end its prompt (their loans come back)
                        self._cancel_everywhere(request_id)
                    raise RequestError(msg.message)
                if isinstance(msg, PromptProgress):
                    read = msg.chunk_index + 1
                    on_event(StreamEvent("progress", msg))
                    if msg.chunk_index == msg.chunk_total - 1:
                        prompt_done = True
                        if sampling.max_new <= 0:
                            return ""
                elif isinstance(msg, Token):
                    # a cancelled request's final Token carries no token, only its draft counts
                    kind = "cancelled" if msg.reason == "cancelled" else "token"
                    on_event(StreamEvent(kind, msg))
                    if msg.done:
                        return msg.reason
            if time.monotonic() - last_event > step_timeout_s:
                what = "a token" if prompt_done else "prompt progress"
                raise RankFailure(f"no {what} for {step_timeout_s:.0f} s from the pipeline")

    def _send_chunk(self, sender: Channel, request_id: int, session_id: int, at_pos: int,
                    part: list[int], index: int, total: int, sampling: Sampling,
                    checkpoint_at, conversation: ConversationStep | None = None) -> None:
        at = chunk_positions(checkpoint_at, at_pos, len(part), first=index == 0)
        try:
            sender.send(Tokens(request_id=request_id, session_id=session_id, pos=at_pos, ids=part,
                               chunk_index=index, chunk_total=total,
                               sampling=chunk_sampling(sampling, at_pos, len(part), index, total),
                               checkpoint_at=at, conversation=conversation), timeout_ms=10_000)
        except ProtocolTimeout as e:
            # the first stage took nothing for that long: most likely it died (its heartbeats
            # say so now), else it is stuck
            self._pump(0)
            if self.lost:
                r, why = next(iter(self.lost.items()))
                raise RankLost(f"{why}; the request is lost, a replacement of rank {r} is "
                               f"loading") from None
            raise RequestError(f"the first stage took no prompt: {e}") from None

    def _cancel_everywhere(self, request_id: int) -> None:
        """Every stage drops the request: a stage between prompt chunks stops there and skips the
        chunks still queued for it; the last stage answers a final Token "cancelled" (PROTOCOL.md
        §4). Each Cancel travels on a link of its own, so it is read before the chunks queued
        on the data links."""
        for slot in self._stages():
            role = "last" if slot.assign.last else f"cancel {slot.rank}"
            try:
                self._sender(slot, role).send(Cancel(request_id=request_id), timeout_ms=10_000)
            except (ProtocolTimeout, ConnectionError) as e:   # its heartbeats tell the rest
                log.warning("could not cancel request %d on rank %d: %s", request_id, slot.rank, e)

    def _hand_back(self, request_id: int) -> None:
        """--parallel: the last stage stops stepping a lone request itself (PROTOCOL.md §4d). On
        the link a Cancel takes, so the two keep their order. A last stage that takes nothing
        for this long is dead or stuck: its heartbeats, or the request's step timeout, tell."""
        try:
            self._sender(self._last_stage(), "last").send(HandBack(request_id=request_id),
                                                         timeout_ms=10_000)
        except (ProtocolTimeout, ConnectionError) as e:
            log.warning("could not take back request %d's steps: %s", request_id, e)

    def _stages(self) -> list[RankSlot]:
        return [s for s in self.ranks if s.assign is not None and s.assign.stage >= 0]

    def _cancel_on_survivor(self, request_id: int) -> None:
        """The last stage, if it lives on, forgets a request lost with another rank."""
        last = self._last_stage()
        if last.rank in self.lost:
            return
        try:
            self._sender(last, "last").send(Cancel(request_id=request_id), timeout_ms=1000)
        except (ProtocolTimeout, ConnectionError) as e:
            log.warning("could not cancel request %d on the last stage: %s", request_id, e)

    def _sender(self, slot: RankSlot, role: str) -> Channel:
        """A PUSH channel to a stage's data socket (the first stage's, or the last's for Cancel)."""
        ch = self._senders.get(role)
        if ch is None:
            ch = self._senders[role] = Channel("push", peer=f"rank {slot.rank}")
            ch.connect(slot.data_endpoint).seal_tcp(self.seal)
        return ch

    def _first_stage_sender(self, first: RankSlot) -> Channel:
        return self._sender(first, "first")

    def _last_stage(self) -> RankSlot:
        return next(s for s in self.ranks if s.assign is not None and s.assign.last)

    def release(self, session_id: int) -> None:
        if self.ranks:
            self._first_stage_sender(self.ranks[0]).send(Release(session_id=session_id),
                                                         timeout_ms=5000)

    def stats(self, timeout_s: float = 5.0) -> dict[int, StatsReply]:
        """Every live rank's counters (a lost rank's are gone with it)."""
        self._stats.clear()
        live = [s for s in self.ranks if s.rank not in self.lost]
        for s in live:
            self._send(s.identity, Stats())
        deadline = time.monotonic() + timeout_s
        # a rank lost while the replies come in is not waited for
        while time.monotonic() < deadline and any(
                s.rank not in self._stats and s.rank not in self.lost for s in live):
            self._pump(0.1)
        return dict(self._stats)

    def ask_stats(self, fresh: bool = False) -> None:
        """Ask every live rank for its counters without waiting: the replies are taken as the pump
        meets them (`routing` among them). `fresh`: the replies earlier askings brought are
        forgotten first, so `stats_replies()` holds only this asking's."""
        if fresh:
            self._stats.clear()
        for s in self.ranks:
            if s.rank not in self.lost:
                self._send(s.identity, Stats())

    def stats_replies(self) -> dict[int, StatsReply]:
        """The counters that came back so far, by rank (a copy)."""
        return dict(self._stats)

    def idle(self, seconds: float) -> None:
        """Keep serving control traffic (heartbeats) while nothing else happens."""
        self._pump(seconds)

    def shutdown(self, reason: str = "", wait_s: float = 1.0) -> None:
        """Tell every registered rank to stop, and wait (at most wait_s) until their connections
        close: a process that exits right after queueing the Shutdowns would lose them, and ranks
        on other hosts would wait for their heartbeat timeout instead."""
        peers = list(self._by_identity.values())
        monitor = self.control.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED) if peers else None
        for s in peers:
            try:
                self.control.send(s.identity, Shutdown(reason=reason), timeout_ms=500)
            except (ProtocolTimeout, ConnectionError):
                pass
        for ch in list(self._senders.values()) + [self.inbox]:
            ch.close()
        if monitor is not None:
            gone, deadline = 0, time.monotonic() + wait_s
            while gone < len(peers) and deadline > time.monotonic():
                if monitor.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    monitor.recv_multipart()
                    gone += 1
            self.control.socket.disable_monitor()
            monitor.close(linger=0)
        self.control.close(linger_ms=1000)


def chunk_sampling(sampling: Sampling, pos: int, n: int, index: int, total: int) -> Sampling:
    """One prompt chunk's share of the request's Sampling, bounded by the chunk (PROTOCOL.md): of
    the prompt's ids its rows' and the next one's (the first chunk's from position 0: a reused
    prefix counts for a repetition penalty); the grammar only on the final chunk."""
    start = 0 if index == 0 else pos
    final = index == total - 1
    return dataclasses.replace(
        sampling, prompt_ids=sampling.prompt_ids[start:pos + n + 1],
        grammar_kind=sampling.grammar_kind if final else "",
        grammar=sampling.grammar if final else "")
