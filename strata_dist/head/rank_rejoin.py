"""A rank as the coordinator knows it (RankSlot), the errors a rank's failure raises, and rejoin:
a lost stage rank waits for a replacement, which takes its assignment and endpoints while the
other ranks keep their weights, caches and sessions. The Coordinator (coordinator.py) is a
RankRejoin; callers import every name here from coordinator.py."""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from protocol import Assign, Error, Ready, Register

log = logging.getLogger("strata.coordinator")   # the coordinator's log: rejoin is part of it


class RankFailure(RuntimeError):
    """A rank died, went silent or reported a fatal error; the message names it."""


class RequestError(RuntimeError):
    """A rank refused or failed one request; the ranks are still up."""


class RankLost(RequestError):
    """A stage rank died during the request; with rejoin on, a replacement is on its way and the
    next request waits for it."""


@dataclass
class RankSlot:
    identity: bytes
    register: Register
    rank: int = -1
    assign: Assign | None = None
    ready: Ready | None = None
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def data_endpoint(self) -> str:
        return self.register.endpoints["data"]


class RankRejoin:
    """The Coordinator's rejoin, kept in a module of its own; never used alone: Coordinator.__init__
    sets up what it reads (ranks, lost, optional, endpoints_of, link_epochs, seal, routing, the
    senders) and coordinator.py defines the _send and _pump it calls."""

    def lose(self, rank: int, message: str) -> None:
        """A stage rank is gone. Without rejoin the launch ends (RankFailure); with it, the rank
        waits for a replacement. Its process is told so (a rank that was only silent — a cable, a
        stopped process — then leaves, or registers again with --reconnect) and its connection is
        forgotten; the head's own links to the stages are dropped with whatever they still queue
        for it. A replacement that dies before it is Ready is lost the same way."""
        if self.rejoin_timeout_s is None:
            raise RankFailure(message)
        old = self.ranks[rank]
        self._rekeying.discard(rank)
        if rank in self.routing:   # what it counted (with its predecessors'), its successor's base
            self._routing_base[rank] = self.routing[rank]
        if self._by_identity.pop(old.identity, None) is not None:
            self._send(old.identity, Error(rank=rank, request_id=None, fatal=True,
                                           message=f"this rank was replaced: {message}"))
        if rank in self.lost:
            self.lost[rank] = message       # the latest reason: why its replacement failed
            return
        self.lost[rank] = message
        for ch in self._senders.values():
            ch.close(linger_ms=0)
        self._senders.clear()
        log.info("%s; waiting for a replacement of rank %d", message, rank)

    def _replacement(self, identity: bytes, msg: Register) -> str | None:
        """Admit `msg` as a lost rank's replacement (sending it that rank's Assign), or say why not.
        A rank that registers with the number (or host and device) of one still counted live is
        its restart, come before its loss was noticed (a unit restarts faster than heartbeats
        expire): that rank is lost now, and this one replaces it."""
        if self.rejoin_timeout_s is None:
            return "this launch already has all its ranks"

        def matches(r: int) -> bool:
            old = self.ranks[r].register
            if msg.rank is not None:
                return msg.rank == r
            return (msg.host == old.host and bool(msg.devices) and bool(old.devices)
                    and msg.devices[0].index == old.devices[0].index)
        for s in self.ranks:
            if (s.rank not in self.lost and s.rank not in self.optional and matches(s.rank)
                    and s.register.pid != msg.pid):
                self.lose(s.rank, f"rank {s.rank} (pid {s.register.pid}) was started again "
                                  f"(pid {msg.pid})")
        for r in self.lost:
            if not matches(r):
                continue
            old = self.ranks[r]
            want = self.endpoints_of[r]
            assign = old.assign
            # the other ranks keep sending to the first endpoints: the replacement takes over
            # each one it did not bind itself (a fixed --data-bind keeps the data port, say, while
            # the helper port is new), which it can only do on the same host
            moved = [k for k in ("data", "helper")
                     if want.get(k) and msg.endpoints.get(k) != want.get(k)]
            if moved:
                if msg.host != old.register.host:
                    return (f"a replacement for rank {r} must run on host {old.register.host} "
                            f"(the other ranks send to {want.get(moved[0])}), not {msg.host}")
                assign = copy.copy(assign)
                assign.bind_endpoint = want.get("data") if "data" in moved else None
                assign.helper_bind = want.get("helper") if "helper" in moved else None
            if assign is old.assign:
                assign = copy.copy(assign)
            # what the other ranks still send for requests up to now belongs to the lost one
            assign.min_request_id = self._last_request_id + 1
            # links to the replacement get a new epoch: what was sealed for the lost process
            # (captured, or still on its way) does not open there
            self._new_epoch(want)
            assign.link_epochs = dict(self.link_epochs)
            register = copy.copy(msg)
            register.endpoints = dict(want)          # where the replacement is reached: the same
            slot = RankSlot(identity, register, rank=r, assign=assign)
            self.ranks[r] = slot
            self._by_identity[identity] = slot
            self._send(identity, assign)
            log.info("rank %d: a replacement registered (pid %s); loading", r, msg.pid)
            return None
        if not self.lost:
            return "this launch already has all its ranks"
        return f"no lost rank matches this one (lost: {sorted(self.lost)})"

    def _new_epoch(self, endpoints: dict[str, str]) -> None:
        """A replacement takes over `endpoints`: the links to them move to their next epoch, here
        and (told by their Assign again, answering Ready) on every other registered rank."""
        for ep in endpoints.values():
            self.link_epochs[ep] = self.link_epochs.get(ep, 0) + 1
        self.seal.set_epochs(self.link_epochs)
        for s in list(self._by_identity.values()):
            if s.assign is None:
                continue
            s.assign = copy.copy(s.assign)
            s.assign.link_epochs = dict(self.link_epochs)
            self._rekeying.add(s.rank)
            self._send(s.identity, s.assign)

    def _rekey_pending(self) -> set[int]:
        return {r for r in self._rekeying if r not in self.lost and r not in self.optional}

    def await_ranks(self, should_cancel: Callable[[], bool] | None = None) -> None:
        """Before a request: wait (bounded, and cancelled with the request) until every lost
        rank's replacement is Ready and every other rank keys its links to it by its new epoch."""
        if not self.lost and not self._rekey_pending():
            return
        deadline = time.monotonic() + self.rejoin_timeout_s
        while self.lost or self._rekey_pending():
            if should_cancel is not None and should_cancel():
                raise RequestError("cancelled while a rank was being replaced")
            left = deadline - time.monotonic()
            if left <= 0:
                if not self.lost:
                    raise RankLost(f"ranks {sorted(self._rekey_pending())} did not take the new "
                                   f"link epochs within {self.rejoin_timeout_s:.0f} s")
                r, why = next(iter(self.lost.items()))
                raise RankLost(f"rank {r} is lost ({why}) and no replacement has loaded "
                               f"within {self.rejoin_timeout_s:.0f} s")
            self._pump(min(left, 0.1))
