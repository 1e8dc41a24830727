"""The shell of one rank process: connect to the coordinator, prove the shared secret, register
the device, receive an assignment, load, report Ready, then pass messages to their handlers until
told to stop.

The shell owns every socket and the liveness (heartbeats, the parent and the coordinator watched);
what a stage computes is `StageStep` (strata_dist/rank/stage_step.py), which takes one data message and
returns what to send where; a helper tier's answers are `HelperServer` (strata_dist/experts/helper_server.py).
Data plane (docs/ARCHITECTURE.md, "A decode step"): the head sends prompt chunks (Tokens) to the
first stage; each stage runs its layers and pushes Hidden rows to the next; the last stage samples,
sends the Token to the head and the next step's Tokens straight back to the first stage, so decode
never waits on the head. Every wait is bounded; a rank whose coordinator or parent is gone exits."""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass

import zmq

from protocol import (PROTOCOL_VERSION, Assign, Cancel, Channel, Error, HandBack, Heartbeat, Hidden,
                      IpcHandle, Poller, ProtocolError, ProtocolTimeout, Ready, Register, Release,
                      RouterChannel, Settle, Shutdown, SlotFree, Stats, StatsReply, Tokens, advertise)
from protocol.transport import Endpoints
from protocol.auth import client_handshake
from protocol.seal import LinkSeal, link_key
from protocol.transport import is_loopback_endpoint, local_address_toward
from protocol.messages import DeviceInfo
from protocol.limits import FrameCaps

from ..compute_options import compute_options, install
from .draft_model import DraftModel
from ..sampling.mtp_draft import MtpDrafter
from ..sampling.sampler import warm_up
from ..gguf_file.reader import GGUFModel
from .handoff import HandoffReceiver, HandoffSender
from ..experts.helper_server import HelperServer
from ..models import architecture_for
from .pulse import HEARTBEAT_S, Pulse
from .stage import Stage, StageConfig
from .stage_step import Outbound, StageStep, To, one_message_a_step

log = logging.getLogger("strata.rank")

COORDINATOR_LOST_S = 15.0     # heartbeats failing this long: the coordinator is gone
HANDOFF_TIMEOUT_MS = 30_000   # a next stage that takes no rows this long is considered dead
LAST_MESSAGE_GRACE_MS = 500   # a queued last message may trail the disconnect event by this much


@dataclass
class RankOptions:
    coordinator: str
    model: str
    device: DeviceInfo
    device_name: str            # "cpu" or "cuda:N" as the backend opens it
    secret: bytes
    data_bind: str              # endpoint this rank binds its data socket on
    host_id: str = ""
    rank_hint: int | None = None
    parent_pid: int | None = None
    assign_timeout_s: float = 300.0
    advertise_host: str = ""        # address peers reach this rank at (default: the route to the coordinator)
    helper_bind: str = ""           # endpoint of the helper socket (default: next to data_bind, any port)
    connect_timeout_s: float = 15.0  # each handshake reply
    coordinator_lost_s: float = COORDINATOR_LOST_S  # heartbeats undeliverable this long: the coordinator is gone


class CoordinatorLost(RuntimeError):
    """The coordinator went away or no longer knows this rank (it restarted): register again or exit."""


class RankProcess:
    def __init__(self, opts: RankOptions):
        self.opts = opts
        # ZMTP pings on a network link: a cut cable drops the connection instead of leaving it silent
        self.control = Channel("dealer", peer="coordinator", max_msg_bytes=FrameCaps.ASSIGN,
                               heartbeat_ms=None if is_loopback_endpoint(opts.coordinator) else 1000)
        self.data = Channel("pull", peer="upstream")
        self.helper_socket = RouterChannel(peer="stages")   # this card's helper tier, if any
        self.helper: HelperServer | None = None
        self.next = self.head = self.first = None
        # a stage that is both first and last hands its next decode step to itself here, not
        # through its own socket (an encode, a send, a poll and a decode less per token)
        self.loopback: deque | None = None
        self.sender: HandoffSender | None = None
        self.receiver: HandoffReceiver | None = None
        self.stage: Stage | None = None
        self.step: StageStep | None = None   # what this rank does with data (stage ranks only)
        self.assign: Assign | None = None
        self.link_seal: LinkSeal | None = None   # set from the Assign (TCP data links)
        self.send_us = 0   # time handing rows and tokens on (the step counts its compute time)
        self._control_handlers = {Shutdown: self._on_shutdown, Error: self._on_coordinator_error,
                                  Stats: self._on_stats, Assign: self._on_link_epochs}
        self._allocated: dict[str, int] = {}   # what the Ready said (repeated after a re-key)
        # transport messages go to the hand-off ends; the rest is the step's
        self._data_handlers = {IpcHandle: self._on_ipc_handle, SlotFree: self._on_slot_reply,
                               Error: self._on_slot_reply, Tokens: self._on_step,
                               Hidden: self._on_step, Release: self._on_step, Cancel: self._on_step,
                               Settle: self._on_step, HandBack: self._on_step}
        self._last_beat_ok = time.monotonic()
        self._beat_seq = 0

    # ---- life cycle ------------------------------------------------------------------------------
    def run(self) -> int:
        o = self.opts
        t0 = time.perf_counter()
        # "auto": this host's address toward the coordinator (resolved per registration: a unit
        # started before the network retries). A socket bound on a wildcard (tcp://0.0.0.0:P) is
        # registered under that address; --advertise-host names the address outright (NAT).
        bind, route = o.data_bind, ""
        if bind == "auto" or bind.startswith("tcp://"):
            route = local_address_toward(o.coordinator)
        if bind == "auto":
            bind = f"tcp://{route}:*"
        # bound on TCP, they take control-sized frames only until the Assign names the prompt chunk
        # (protocol/limits.py); _cap_frames then sets the plan's caps
        early = FrameCaps.before_assign()
        data_ep = self._registered(self.data.bind(bind, tcp_max_msg_bytes=early.data), route)
        helper_ep = self._registered(self.helper_socket.bind(
            o.helper_bind or _sibling(bind, "helper"), tcp_max_msg_bytes=early.helper), route)
        # the control connection closing means the coordinator process is gone (a Shutdown, if
        # any, arrives before it): no need to wait out an assignment or heartbeat timeout
        self._control_events = self.control.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.control.connect(o.coordinator)
        client_handshake(self.control, o.secret, f"rank-{os.getpid()}",
                         timeout_ms=int(o.connect_timeout_s * 1000))
        fingerprint = GGUFModel(o.model).fingerprint
        self.control.send(Register(rank=o.rank_hint, host=o.host_id or socket.gethostname(),
                                   pid=os.getpid(), devices=[o.device],
                                   model_fingerprint=fingerprint,
                                   protocol_version=PROTOCOL_VERSION,
                                   endpoints={"data": data_ep, "helper": helper_ep}))
        assign = self._wait_assign()
        if not isinstance(assign, Assign):
            return assign
        self.assign = assign
        rank = assign.rank
        # the launch's compute switches, never this host's environment (compute_options.py)
        install(assign.compute)
        if assign.bind_endpoint or assign.helper_bind:
            self._take_over_endpoints(assign)
        self._cap_frames(assign)
        # TCP data links: sealed under the launch's key (the secret and the Assign's nonce), one
        # key per link, named by its bound end's endpoint as the peers know it (a replacement's:
        # those of the rank it replaces), in that endpoint's epoch
        self.link_seal = (LinkSeal(link_key(o.secret, assign.link_nonce), assign.link_epochs)
                          if assign.link_nonce else None)
        self.data.seal_tcp(self.link_seal, link=assign.bind_endpoint or data_ep)
        self.helper_socket.seal_tcp(self.link_seal, link=assign.helper_bind or helper_ep)
        log.info("rank %d: %s [%d, %d) on %s; compute options %s", rank, assign.role, assign.lb,
                 assign.le, o.device_name, compute_options().describe())
        # device memory free before and after each carve, for the startup report (None: host)
        probe = _backend(o.device_name).memory_info
        free = {"free_before": probe()}
        if assign.role in ("stage", "stage+helper"):
            self.stage = Stage(StageConfig(
                model_path=o.model, device=o.device_name, lb=assign.lb, le=assign.le,
                first=assign.first, last=assign.last, max_context=assign.max_context,
                weight_slice=assign.weight_slice,
                cache_pairs=[tuple(p) for p in assign.cache_pairs],
                loan_slots=assign.loan_slots,
                # this card's own helper tier is computed in place, never asked over a socket
                helpers=[(h.rank, h.endpoint, h.pairs,
                          use_cuda_ipc(assign, peer_host=h.host, peer_kind="cuda"))
                         for h in assign.helpers if h.rank != rank],
                link_seal=self.link_seal, kv_type=assign.kv_type or None,
                kv_resident=_kv_resident(assign),
                prompt_chunk=assign.prompt_chunk,
                local_helper_pairs=[tuple(p) for p in assign.helper_pairs],
                adapt_every=assign.adapt_every, adapt_swaps=assign.adapt_swaps,
                count_routing=assign.count_routing,
                **_conversation_budget(assign)))
            for sid in range(_sessions(assign)):   # carved up front, as the plan priced them
                self.stage.session(sid)
            # --draft-model: the last stage drafts with it, beside its own layers (priced there)
            draft = (DraftModel(assign.draft_model, o.device_name, assign.max_context,
                                assign.kv_type or None)
                     if assign.last and assign.draft_model else None)
            if assign.last and assign.draft_mtp:   # --draft mtp: the file's own MTP block
                draft = MtpDrafter(o.model, o.device_name, assign.max_context, self.stage.model,
                                   assign.kv_type or None)
                self.stage.hidden_sink = draft.take_hidden
            self.step = StageStep(self.stage, rank, last=assign.last,
                                  min_request_id=assign.min_request_id, draft_model=draft)
            free["free_after_stage"] = probe()
            if assign.last and self.stage.backend.on_gpu:   # compiled now, not at a request
                warm_up(self.stage.backend.xp.zeros(self.stage.model.g.n_vocab, "float32"))
        # the helper tier last: it is the part that fails soft, so it must not starve the stage
        if assign.helper_pairs:
            self._open_helper(assign)
            if self.stage is not None:   # this card's own tier is computed in place
                self.stage.attach_local_helper(self.helper.arena)
                self.stage.local_tier = self.helper   # its counts re-rank the tier directly
                # a GPU stage's decode graph reads this card's tier at its addresses: no swaps
                self.helper.read_in_place |= self.stage.backend.on_gpu
            free["free_after_helper"] = probe()
        # a head listening on a wildcard is reached at the address this rank reached the coordinator at
        self.head = Channel("push", peer="head").connect(
            advertise(assign.head_endpoint, _endpoint_host(o.coordinator))).seal_tcp(
                self.link_seal, link=assign.head_endpoint)
        if self.stage:
            self._connect_neighbours(assign)
        allocated = {"weights": self.stage.weights_bytes, "session": self.stage.session_bytes(),
                     "cache": self.stage.cache.nbytes} if self.stage else {}
        if self.stage is not None and self.stage.kv_host_bytes():
            allocated["kv_host"] = self.stage.kv_host_bytes()    # --kv-resident's host copies
        drafter = self.step.draft_model if self.step is not None else None
        if isinstance(drafter, MtpDrafter):
            allocated["draft_mtp"] = drafter.weights_bytes + drafter.session_bytes()
        elif drafter is not None:
            allocated["draft_model"] = drafter.weights_bytes + drafter.stage.session_bytes()
        if assign.helper_pairs:
            allocated["helper"] = self.helper.nbytes
            if self.helper.error:
                allocated["helper_failed"] = 1
        # IPC buffers (hidden rows to the next stage, expert links): taken from the stage's reserve
        ipc_bytes = (self.sender.nbytes if self.sender else 0) + sum(
            h.nbytes for h in (self.stage.tiers.helpers if self.stage else []))
        if ipc_bytes:
            allocated["handoff"] = ipc_bytes
        if self.stage is not None and self.stage.own_prompt_bytes:
            # a stage that does not lend: its prompt layout, allocated once (plan: own prompt)
            allocated["own_prompt"] = self.stage.own_prompt_bytes
        if self.stage is not None and self.stage.tiers.pinned is not None:
            allocated["host_pinned"] = self.stage.tiers.pinned.nbytes   # host memory, not device
        if self.stage is not None and self.stage.pin_error:
            allocated["host_pin_failed"] = 1
        if self.stage and self.stage.checkpoint_bound_bytes():
            # allocated on demand: the bound for one session (strata_dist/checkpoints.py)
            allocated["checkpoints"] = self.stage.checkpoint_bound_bytes()
        if self.stage is not None and self.stage.conversations.budget_bytes:
            # allocated on demand up to this bound, as the plan priced it (conversation_cache.py)
            allocated["conversations"] = self.stage.conversations.budget_bytes
        allocated.update({k: v[0] for k, v in free.items() if v is not None})
        self._allocated = allocated
        self.control.send(Ready(rank=rank, allocated=allocated,
                                elapsed_ms=(time.perf_counter() - t0) * 1e3))
        return self._run_data_plane()

    def _open_helper(self, a: Assign) -> None:
        """This card's helper tier (fail-soft: see HelperServer)."""
        gguf = GGUFModel(self.opts.model)
        g = architecture_for(gguf).read_geometry(gguf)
        self.helper = HelperServer.open(a.rank, _backend(self.opts.device_name), gguf,
                                        a.helper_pairs, g.n_layers, g.n_expert,
                                        adapt_swaps=a.adapt_swaps if a.adapt_every > 0 else 0)

    def _connect_neighbours(self, a: Assign) -> None:
        """Data channels to the next stage (rows), the previous one (slot acknowledgements) and,
        on the last stage, the first (the next decode step)."""
        be = self.stage.backend
        if not a.last:
            self.next = Channel("push", peer=f"stage after rank {a.rank}").connect(
                a.next_endpoint).seal_tcp(self.link_seal)
            use_ipc = use_cuda_ipc(a)
            g = self.stage.model.g
            self.sender = HandoffSender(self.next, be, a.host, use_ipc,
                                        max_rows=max(a.prompt_chunk, 1), hidden=g.n_embd,
                                        timeout_ms=HANDOFF_TIMEOUT_MS)
        if not a.first:
            prev = a.prev_endpoint
            up = (Channel("push", peer=f"stage before rank {a.rank}").connect(prev)
                  .seal_tcp(self.link_seal) if prev else None)
            self.receiver = HandoffReceiver(be, up, HANDOFF_TIMEOUT_MS)
        if a.last and a.first:
            self.loopback = deque()
        elif a.last:
            self.first = Channel("push", peer="first stage").connect(
                a.first_endpoint).seal_tcp(self.link_seal)

    def _take_over_endpoints(self, a: Assign) -> None:
        """A replacement of a lost rank (rejoin) binds the endpoints of the rank it replaces that
        it did not bind itself (Assign.bind_endpoint / helper_bind): the other ranks keep sending
        there."""
        log.info("taking over the endpoints of the rank this one replaces: %s",
                 ", ".join(f"{k} {ep}" for k, ep in (("data", a.bind_endpoint),
                                                      ("helper", a.helper_bind)) if ep))
        if a.bind_endpoint:
            self.data.close()
            self.data = Channel("pull", peer="upstream")
            self.data.bind(a.bind_endpoint)
        if a.helper_bind:
            self.helper_socket.close()
            self.helper_socket = RouterChannel(peer="stages")
            self.helper_socket.bind(a.helper_bind)

    def _cap_frames(self, a: Assign) -> None:
        """The data and helper sockets, where bound on TCP, take frames up to the plan's largest legal
        one (a prompt chunk's rows, an expert request): a peer announcing more is disconnected unread.
        (ipc:// sockets are in a directory only this user can open.)"""
        gguf = GGUFModel(self.opts.model)
        g = architecture_for(gguf).read_geometry(gguf)
        caps = FrameCaps.for_stage(g.n_embd, g.n_expert_used, a.prompt_chunk)
        self.data.cap_frames(caps.data)
        self.helper_socket.cap_frames(caps.helper)

    def _registered(self, bound: str, route: str) -> str:
        """The address peers are given for a bound socket: --advertise-host if set, else the
        route toward the coordinator in place of a wildcard."""
        if self.opts.advertise_host and bound.startswith("tcp://"):
            return Endpoints.tcp(self.opts.advertise_host, int(bound.rsplit(":", 1)[1]))
        return advertise(bound, route)

    def close(self) -> None:
        """Close every socket (a rank that registers again binds the same endpoints anew)."""
        events = getattr(self, "_control_events", None)
        if events is not None:
            self.control.socket.disable_monitor()
            events.close(linger=0)
        helpers = self.stage.tiers.helpers if self.stage is not None and hasattr(self.stage, "tiers") else []
        for ch in [self.control, self.data, self.helper_socket, self.next, self.head, self.first,
                   getattr(self.receiver, "up", None)] + [getattr(h, "ch", None) for h in helpers]:
            if ch is not None:
                ch.close()

    def _check_connection(self, when: str) -> None:
        events = getattr(self, "_control_events", None)
        # The disconnect event and the coordinator's last message (a Shutdown) travel apart: the
        # event can be seen first, so the message gets a moment to arrive; a shutdown must never
        # read as a lost coordinator (exit 1).
        if events is not None and events.poll(0) and not self.control.poll(LAST_MESSAGE_GRACE_MS):
            events.recv_multipart()
            raise CoordinatorLost(f"the coordinator closed the connection {when}")

    def _wait_assign(self) -> Assign | int:
        """The Assign; or the exit status: 2 when refused, 0 when told to shut down."""
        deadline = time.monotonic() + self.opts.assign_timeout_s
        while time.monotonic() < deadline:
            self._watch_parent()
            try:
                msg, _ = self.control.recv(timeout_ms=1000, what="an assignment")
            except ProtocolTimeout:
                self._check_connection("before assigning this rank")
                continue
            if isinstance(msg, Assign):
                return msg
            if isinstance(msg, Error):
                print(f"error: the coordinator refused this rank: {msg.message}", file=sys.stderr)
                return 2
            if isinstance(msg, Shutdown):
                return 0
        raise ProtocolTimeout("coordinator", "an assignment", self.opts.assign_timeout_s * 1e3)

    def _run_data_plane(self) -> int:
        pulse = Pulse(self.opts.coordinator, self.opts.secret, self.assign.rank,
                      int(self.opts.connect_timeout_s * 1000), parent_pid=self.opts.parent_pid)
        pulse.start()
        try:
            return self._loop()
        finally:
            pulse.stopped.set()

    def _loop(self) -> int:
        """Until a Shutdown: heartbeats, and each message to its handler. The exit status is
        returned; a lost coordinator or parent raises."""
        poller = Poller(self.control, self.data, self.helper_socket)
        if self.sender is not None:
            self.sender.offer()
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self._heartbeat()
                next_beat = now + HEARTBEAT_S
            self._watch_parent()
            # a step of its own waiting: look at the sockets without blocking, then run it
            ready = poller.poll(0 if self.loopback else int(HEARTBEAT_S * 1000))
            if self.control not in ready:
                self._check_connection("while this rank served")
            for ch in ready:
                if ch is self.helper_socket:
                    self._answer_helper_request()
                    continue
                try:
                    msg, arrays = ch.recv(timeout_ms=100)
                except ProtocolTimeout:
                    continue
                except ProtocolError as e:   # garbage on a socket: drop the message, keep serving
                    log.warning("dropped an invalid message: %s", e)
                    continue
                handlers = self._control_handlers if ch is self.control else self._data_handlers
                handler = handlers.get(type(msg))
                status = handler(msg, arrays) if handler is not None else None
                if status is not None:
                    return status
            if self.loopback:
                self._on_step(self.loopback.popleft(), None)

    # ---- control messages ------------------------------------------------------------------------
    def _on_shutdown(self, msg: Shutdown, arrays) -> int:
        return 0

    def _on_coordinator_error(self, msg: Error, arrays) -> None:
        if msg.fatal:   # e.g. a restarted coordinator, or this rank was replaced
            raise CoordinatorLost(f"the coordinator dropped this rank: {msg.message}")

    def _on_link_epochs(self, msg: Assign, arrays) -> None:
        """The coordinator admitted a replacement: this rank's Assign again, with the new epochs
        of the links to the replacement. Every later message on them is keyed by those; the
        answer is this rank's Ready again (PROTOCOL.md §9)."""
        if msg.rank != self.assign.rank or msg.link_nonce != self.assign.link_nonce:
            log.warning("ignored an Assign for rank %d of another launch", msg.rank)
            return
        if self.link_seal is not None:
            self.link_seal.set_epochs(msg.link_epochs)
        self.assign.link_epochs = dict(msg.link_epochs)
        self.control.send(Ready(rank=self.assign.rank, allocated=self._allocated, elapsed_ms=0.0))

    def _on_stats(self, msg: Stats, arrays) -> None:
        routing = {}
        if self.stage is not None and self.assign.count_routing:   # a live profile's counts
            lb, le = self.assign.lb, self.assign.le
            routing = dict(routing_lb=lb, routing=self.stage.routing.total[lb:le].tolist())
        self.control.send(StatsReply(rank=self.assign.rank, counters=self._counters(),
                                     request_id=msg.request_id, gauges=self._gauges(), **routing))

    # ---- the helper tier -------------------------------------------------------------------------
    def _answer_helper_request(self) -> None:
        try:
            identity, msg, arrays = self.helper_socket.recv(timeout_ms=100)
        except (ProtocolTimeout, ProtocolError) as e:
            log.warning("helper socket: %s", e)
            return
        helper = self.helper or HelperServer(self.assign.rank, None)
        reply = helper.answer(identity, msg, arrays)
        if reply is not None:
            self.helper_socket.send(identity, reply[0], reply[1], timeout_ms=2000)

    def _gauges(self) -> dict[str, float]:
        """Point-in-time values: the bytes this stage's checkpoints hold now."""
        if not self.stage:
            return {}
        return {"checkpoint_bytes": float(self.stage.checkpoint_bytes()),
                "conversation_bytes": float(self.stage.conversations.nbytes)}

    def _counters(self) -> dict[str, int]:
        c = {"chunks": 0, "rows": 0, "tokens": 0, "errors": 0, "compute_us": 0,
             "stale_dropped": 0} if self.step is None else dict(self.step.counters)
        c["send_us"] = self.send_us
        if self.helper is not None:
            c["helper_requests"] = self.helper.requests
            if self.helper.adapt_swaps:
                c.update(self.helper.counters)   # its re-ranking (helper_server.py)
        if self.stage is not None:
            c.update(self.stage.tiers.counters)
            c.update(self.stage.checkpoint_counters())
            c.update(self.stage.conversations.counters)
        if self.sender is not None:
            c.update(handoff_ipc=self.sender.sent_ipc, handoff_frames=self.sender.sent_frames)
        if self.stage is not None and self.stage.tiers.helpers:
            c.update(remote_ipc=sum(h.sent_ipc for h in self.stage.tiers.helpers),
                     remote_frames=sum(h.sent_frames for h in self.stage.tiers.helpers))
        if self.link_seal is not None:
            c["forged_dropped"] = self.link_seal.rejected   # messages that did not prove themselves
            # sealed for the process this rank replaced: stale, like rows of older requests
            c["link_stale_dropped"] = self.link_seal.stale
            c["stale_dropped"] = c.get("stale_dropped", 0) + self.link_seal.stale
        return c

    def _heartbeat(self) -> None:
        self._beat_seq += 1
        try:
            self.control.send(Heartbeat(rank=self.assign.rank, seq=self._beat_seq, pid=os.getpid()),
                              timeout_ms=500)
            self._last_beat_ok = time.monotonic()
        except ProtocolTimeout:
            if time.monotonic() - self._last_beat_ok > self.opts.coordinator_lost_s:
                raise CoordinatorLost("the coordinator is gone (no heartbeat delivered for "
                                      f"{self.opts.coordinator_lost_s:.0f} s)")

    def _watch_parent(self) -> None:
        if self.opts.parent_pid and os.getppid() != self.opts.parent_pid:
            raise SystemExit("the launcher that started this rank is gone")

    # ---- the data plane ----------------------------------------------------------------------------
    def _on_ipc_handle(self, msg: IpcHandle, arrays) -> None:
        if self.receiver is not None:   # the previous stage offers its hand-off buffer
            self.receiver.on_handle(msg)

    def _on_slot_reply(self, msg: SlotFree | Error, arrays) -> None:
        if self.sender is not None:     # the next stage freed a slot, or refused the buffer
            self.sender.on_reply(msg)

    def _on_step(self, msg, arrays) -> None:
        """One data message through the stage's step, and what it causes sent on."""
        if self.step is None:
            return
        try:
            rows = self.receiver.rows(msg, arrays) if isinstance(msg, Hidden) else None
            outbound = self.step.step(msg, rows)
            if self.step.last and getattr(msg, "batch", None) is not None:
                outbound = one_message_a_step(msg.request_id, outbound)
            t0 = time.perf_counter()
            try:
                for out in outbound:
                    self._send(out)
            finally:
                self.send_us += int((time.perf_counter() - t0) * 1e6)
        except (ProtocolTimeout, ProtocolError) as e:
            self._send_error(self.step.error(
                msg.request_id, f"rank {self.assign.rank}: hand-off failed: {e}"))
        except Exception as e:   # e.g. rows in an IPC slot whose buffer was never opened
            log.error("request %s failed:\n%s", msg.request_id, traceback.format_exc())
            self.stage.end_prompt()   # a failed prompt still gives its loan back
            self._send_error(self.step.error(
                msg.request_id, f"rank {self.assign.rank}: {type(e).__name__}: {e}"))
        finally:
            if self.receiver is not None and isinstance(msg, Hidden):
                try:
                    self.receiver.release()   # the upstream slot is free, whatever happened
                except ProtocolTimeout as e:
                    log.error("could not free an upstream slot: %s", e)

    def _send(self, out: Outbound) -> None:
        if out.to is To.HEAD:
            if isinstance(out.msg, Error):
                self._send_error(out)
            else:
                self.head.send(out.msg)
        elif out.to is To.FIRST:
            if self.loopback is not None:
                self.loopback.append(out.msg)
            else:
                self.first.send(out.msg, timeout_ms=HANDOFF_TIMEOUT_MS)
        elif out.rows is not None:
            self.sender.send_hidden(out.msg, out.rows)
        else:
            self.next.send(out.msg, timeout_ms=HANDOFF_TIMEOUT_MS)

    def _send_error(self, out: Outbound) -> None:
        try:
            self.head.send(out.msg, timeout_ms=2000)
        except ProtocolTimeout:
            log.error("could not report to the head: %s", out.msg.message)


def use_cuda_ipc(a: Assign, peer_host: str | None = None, peer_kind: str | None = None) -> bool:
    """Rows go to a peer (the next stage by default) through CUDA IPC only when it reports this
    rank's host identity and computes on a GPU (and the launch's compute options keep cuda_ipc,
    STRATA_IPC, on); every other hand-off is a TCP/ipc frame. A helper's kind is not in the assignment: the link offers IPC and a CPU
    helper refuses it (PROTOCOL.md §6). A launch with rejoin on says `ipc=False`: a replacement
    could not take over buffers its neighbours opened from the process it replaces."""
    host = a.next_host if peer_host is None else peer_host
    kind = a.next_kind if peer_kind is None else peer_kind
    same_host = bool(a.host) and host == a.host
    return same_host and kind == "cuda" and a.ipc and a.compute.cuda_ipc


def _endpoint_host(endpoint: str) -> str:
    """tcp://host:port -> host (brackets kept for IPv6); "" for other transports."""
    if not endpoint.startswith("tcp://"):
        return ""
    return endpoint[len("tcp://"):].rsplit(":", 1)[0]


def _sibling(endpoint: str, name: str) -> str:
    """Another endpoint next to a bound one: ipc://dir/rank0.sock -> ipc://dir/rank0-helper.sock;
    tcp://host:port -> tcp://host:* (a port of its own)."""
    if endpoint.startswith("ipc://"):
        base = endpoint[:-5] if endpoint.endswith(".sock") else endpoint
        return f"{base}-{name}.sock"
    host = endpoint.rsplit(":", 1)[0]
    return f"{host}:*"


def _backend(device: str):
    from ..backends import get_backend
    return get_backend(device)


def _sessions(assign: Assign) -> int:
    """The sessions the plan priced for every stage (--parallel; plan/params.py)."""
    return int(assign.plan.get("params", {}).get("sessions", 1))


def _kv_resident(assign: Assign) -> int:
    """Cells of each K/V the plan keeps on this stage's device (--kv-resident, resolved per
    stage; 0: every cell)."""
    st = assign.plan.get("stages", [])[assign.stage] if assign.stage >= 0 else {}
    return int(st.get("kv_resident", 0))


def _conversation_budget(assign: Assign) -> dict:
    """The stage's kept-conversation budget and place, as its part of the plan prices them."""
    st = assign.plan.get("stages", [])[assign.stage] if assign.stage >= 0 else {}
    return {"conversation_bytes": int(st.get("conversation_bytes", 0)),
            "conversation_host": st.get("conversation_in", "device") == "host"}
