"""A rank's pulse: heartbeats on a connection of their own, and the stop check a step cannot make
(`Pulse`). strata_dist/rank/shell.py starts one for its data plane."""
from __future__ import annotations

import logging
import os
import sys
import threading

import zmq

from protocol import Channel, Heartbeat, ProtocolTimeout
from protocol.auth import client_handshake
from protocol.limits import FrameCaps

log = logging.getLogger("strata.rank")

HEARTBEAT_S = 1.0
# A launcher's rank still inside one step this long after its launcher stopped or went away ends
# at once (Pulse): at depth one prompt chunk can run for minutes, holding the device meanwhile,
# while an idle rank reads its Shutdown within a poll and leaves cleanly well inside this.
BUSY_STOP_GRACE_S = 0.5
EXIT_COORDINATOR_GONE = 1     # what a rank whose coordinator is gone exits with (rank/main.py)


class Pulse(threading.Thread):
    """Heartbeats on a connection of their own (authenticated like the control one), so a rank
    busy with a long prompt chunk is not taken for dead; a rank that is stuck for good is caught
    by the request's own step timeout instead.

    For a rank its launcher started (`parent_pid`), the pulse is also the stop check that a step
    cannot make: the main thread reads a Shutdown only between messages, so a rank deep in a long
    prompt chunk would keep computing, and holding its device, until the chunk ends. When the
    coordinator closes this connection (the launcher stopping: Ctrl-C, SIGTERM, or gone, even
    killed) or the launcher process is gone, and the main loop has not ended within
    BUSY_STOP_GRACE_S, the process ends here."""

    def __init__(self, endpoint: str, secret: bytes, rank: int, timeout_ms: int,
                 parent_pid: int | None = None):
        super().__init__(name="pulse", daemon=True)
        self.endpoint, self.secret, self.rank, self.timeout_ms = endpoint, secret, rank, timeout_ms
        self.parent_pid = parent_pid
        self.stopped = threading.Event()

    def run(self) -> None:
        ch = Channel("dealer", peer="coordinator (pulse)", max_msg_bytes=FrameCaps.CONTROL)
        # its own socket, so its own monitor: this thread may watch it while the main one computes.
        # Only a coordinator on this host: there a dropped connection means it closed; across a
        # network it may be a blip ZeroMQ reconnects through (the heartbeats decide there).
        events = (ch.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                  if self.parent_pid and on_this_host(self.endpoint) else None)
        ch.connect(self.endpoint)
        try:
            client_handshake(ch, self.secret, f"rank-{os.getpid()}-pulse", timeout_ms=self.timeout_ms)
            while events is not None and events.poll(0):   # a retry before the handshake held
                events.recv_multipart()
            seq = 0
            while not self._wait_beat(events):
                if self.parent_pid and os.getppid() != self.parent_pid:
                    self._end_if_busy("the launcher that started this rank is gone")
                    return
                seq += 1
                try:
                    ch.send(Heartbeat(rank=self.rank, seq=seq, pid=os.getpid()), timeout_ms=500)
                except ProtocolTimeout:
                    pass   # the main loop's own heartbeat decides when the coordinator is gone
        except _CoordinatorClosed:
            self._end_if_busy("the launcher closed its coordinator (it is stopping, or gone)")
        except Exception as e:  # no pulse: the main loop's heartbeats still run between messages
            log.warning("heartbeat connection failed: %s", e)
        finally:
            if events is not None:
                ch.socket.disable_monitor()
                events.close(linger=0)
            ch.close()

    def _wait_beat(self, events) -> bool:
        """Until the next heartbeat is due: True once the main loop has ended; raises
        _CoordinatorClosed when the coordinator closed this connection meanwhile."""
        if events is None:
            return self.stopped.wait(HEARTBEAT_S)
        if events.poll(int(HEARTBEAT_S * 1000)):
            events.recv_multipart()
            raise _CoordinatorClosed
        return self.stopped.is_set()

    def _end_if_busy(self, why: str) -> None:
        """The main loop ends by itself when it is between messages (a Shutdown: exit 0; a lost
        coordinator or launcher: exit 1); one still inside a step after the grace is ended here."""
        if self.stopped.wait(BUSY_STOP_GRACE_S):
            return
        log.warning("%s while this rank is inside a step: exiting now", why)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(EXIT_COORDINATOR_GONE)


def on_this_host(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint is on this host: ipc://, or tcp:// to a loopback address."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


class _CoordinatorClosed(Exception):
    """The pulse connection saw the coordinator's end close."""
