"""Thin ZeroMQ wrappers: typed send/recv over the codec, a timeout on every wait, linger 0, idempotent close.

Socket patterns used by strata-dist:
  * control: the coordinator binds a ROUTER (``RouterChannel``), each rank connects a DEALER (``Channel("dealer")``);
  * data plane: a stage binds a PULL, its upstream peers connect a PUSH (``Channel("push")``/``Channel("pull")``);
  * helper requests: the helper binds a ROUTER, stages connect DEALERs.
Same host → ``ipc://`` endpoints in a private per-launch directory; across hosts → ``tcp://``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import zmq

from .bounded_read import KEY_FILE_MAX, read_capped
from .codec import decode, encode
from .messages import Message, ProtocolError
from .seal import LinkEnd, LinkSeal

# Defaults for every wait (milliseconds). Callers pass their own where the plan knows better.
CONNECT_TIMEOUT_MS = 10_000    # handshake replies (Challenge, AuthOk)
RECV_TIMEOUT_MS = 10_000       # a reply that should come promptly
SEND_TIMEOUT_MS = 10_000       # a send blocked by a full queue or a peer that never connected
HEARTBEAT_INTERVAL_MS = 1_000  # Heartbeat messages, rank → coordinator
HEARTBEAT_TIMEOUT_MS = 10_000  # a rank silent this long is declared dead

IPC_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes including the NUL

_KINDS = {"dealer": zmq.DEALER, "router": zmq.ROUTER, "push": zmq.PUSH, "pull": zmq.PULL, "pair": zmq.PAIR}


class ProtocolTimeout(TimeoutError):
    """A wait ran out. ``peer`` names who we waited for, ``what`` for what, ``timeout_ms`` how long."""

    def __init__(self, peer: str, what: str, timeout_ms: float, *, sending: bool = False):
        if sending:
            text = f"timed out after {timeout_ms:g} ms sending {what} to {peer} (not connected, or its queue is full)"
        else:
            text = f"timed out after {timeout_ms:g} ms waiting for {what} from {peer}"
        super().__init__(text)
        self.peer, self.what, self.timeout_ms, self.sending = peer, what, timeout_ms, sending


class PeerGone(ConnectionError):
    """A ROUTER was asked to send to an identity that is not (or no longer) connected."""

    def __init__(self, peer: str, what: str):
        super().__init__(f"cannot send {what}: peer {peer} is not connected")
        self.peer = peer


@dataclass(frozen=True)
class CurveKeys:
    """ZeroMQ CURVE keys (Z85 bytes). ``server_public`` None → this socket is the CURVE server.

    CURVE encrypts the link; it does not replace the HMAC handshake, which decides who may register.
    """

    public: bytes
    secret: bytes
    server_public: bytes | None = None

    @property
    def is_server(self) -> bool:
        return self.server_public is None


# The process's deployment CURVE key (a server keypair), set by use_curve(): every Channel created without its own
# ``curve=`` then binds as a CURVE server with it and connects as a CURVE client of its public key.
_deployment_curve: CurveKeys | None = None

CURVE_SECRET_FILE = "server.key_secret"   # zmq.auth certificate format (public + secret); keep it 0600
CURVE_PUBLIC_FILE = "server.key"          # the public half only


def use_curve(keys: CurveKeys | None) -> None:
    """Encrypt every link this process opens from now on with the deployment's CURVE keypair (None: plain).

    One keypair per deployment, present on every host: each rank binds server sockets (its data PULL, its helper
    ROUTER) and connects client sockets, so every process holds the server half. A socket that connects uses a
    fresh client keypair of its own. A peer without the deployment's public key cannot complete the CURVE
    handshake, so it never gets as far as the HMAC admission (which still decides who may register)."""
    global _deployment_curve
    if keys is not None and not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support; install a pyzmq wheel built with libsodium")
    _deployment_curve = CurveKeys(keys.public, keys.secret) if keys is not None else None


def deployment_curve() -> CurveKeys | None:
    return _deployment_curve


def write_curve_keys(directory: str, keys: CurveKeys | None = None) -> CurveKeys:
    """The deployment keypair (a fresh one unless ``keys``) written to ``directory`` (created 0700):
    server.key_secret (0600) and server.key (the public half)."""
    public, secret = (keys.public, keys.secret) if keys is not None else new_curve_keypair()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    for name, body, mode in ((CURVE_SECRET_FILE, f'    public-key = "{public.decode()}"\n'
                              f'    secret-key = "{secret.decode()}"\n', 0o600),
                             (CURVE_PUBLIC_FILE, f'    public-key = "{public.decode()}"\n', 0o644)):
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.fchmod(fd, mode)
            os.write(fd, ("#   strata-dist deployment CURVE key (zmq.auth certificate format)\n"
                          "metadata\ncurve\n" + body).encode())
        finally:
            os.close(fd)
    return CurveKeys(public, secret)


def load_curve_keys(directory: str) -> CurveKeys:
    """The deployment keypair from ``directory``/server.key_secret. Raises ValueError naming the file."""
    path = os.path.join(directory, CURVE_SECRET_FILE)
    keys: dict[str, bytes] = {}
    try:
        text = read_capped(path, KEY_FILE_MAX, "--curve-keys").decode("utf-8", errors="replace")
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key.strip() in ("public-key", "secret-key"):
                keys[key.strip()] = value.strip().strip('"').encode()
    except OSError as e:
        raise ValueError(f"cannot read the CURVE key {path}: {e.strerror or e} "
                         "(strata-dist deploy systemd --curve writes it)") from None
    if len(keys.get("public-key", b"")) != 40 or len(keys.get("secret-key", b"")) != 40:
        raise ValueError(f"{path} is not a CURVE key file (wants public-key and secret-key, 40 Z85 characters each)")
    return CurveKeys(keys["public-key"], keys["secret-key"])


def new_curve_keypair() -> tuple[bytes, bytes]:
    """(public, secret) in Z85. Needs libzmq built with CURVE (``zmq.has('curve')``)."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support; install a pyzmq wheel built with libsodium")
    return zmq.curve_keypair()


class Endpoints:
    """Makes addresses for one launch. ipc:// sockets live in a private (0700) temp directory removed by cleanup()."""

    def __init__(self, run_dir: str | None = None):
        self._owned = run_dir is None
        if run_dir is None:
            base = os.environ.get("XDG_RUNTIME_DIR")
            base = base if base and os.path.isdir(base) and os.access(base, os.W_OK) else None
            run_dir = tempfile.mkdtemp(prefix="strata-", dir=base)
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        self.run_dir = run_dir

    def ipc(self, name: str) -> str:
        if not name or "/" in name:
            raise ValueError(f"ipc endpoint name must be a plain file name, got {name!r}")
        path = os.path.join(self.run_dir, f"{name}.sock")
        if len(path.encode()) > IPC_PATH_MAX:
            raise ValueError(f"ipc path {path!r} is {len(path.encode())} bytes, the OS limit is {IPC_PATH_MAX}")
        return f"ipc://{path}"

    @staticmethod
    def tcp(host: str = "127.0.0.1", port: int | None = None) -> str:
        """A tcp:// address; port None binds an ephemeral port (``Channel.bind`` returns the real one)."""
        h = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"tcp://{h}:{'*' if port is None else int(port)}"

    def cleanup(self) -> None:
        if self._owned:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "Endpoints":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


def advertise(endpoint: str, host: str) -> str:
    """The address peers should connect to for a socket bound on a wildcard (tcp://0.0.0.0:P → tcp://host:P)."""
    for wild in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if endpoint.startswith(wild):
            return Endpoints.tcp(host, int(endpoint[len(wild):]))
    return endpoint


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc:// and inproc:// endpoints and tcp:// on 127.0.0.0/8, ::1 or localhost."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def local_address_toward(endpoint: str) -> str:
    """This host's address on the route to ``endpoint`` (what peers there can reach us at). No packet is sent:
    a UDP socket's connect only asks the kernel for the route. ipc:// and loopback peers → 127.0.0.1.
    Raises ConnectionError when the name does not resolve or no route exists (yet)."""
    import socket
    if is_loopback_endpoint(endpoint):
        return "127.0.0.1"
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port) if port.isdigit() else 9, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError as e:
        # a ConnectionError: the network may come up later (a unit started early retries)
        raise ConnectionError(f"cannot find a route to {endpoint}: {e.strerror or e}") from None


def random_identity(prefix: str = "peer") -> bytes:
    """A readable but unguessable routing identity for a DEALER, e.g. b"rank-1.3f9c…" (96 random bits)."""
    return f"{prefix}.{secrets.token_hex(12)}".encode()


class Channel:
    """One ZeroMQ socket speaking the codec. Kinds: dealer, push, pull, pair (router: use RouterChannel).

    ``peer`` is a human name for whoever is on the other side; it is what timeouts and errors report.
    Like every ZeroMQ socket, a channel belongs to one thread.
    """

    def __init__(self, kind: str, *, peer: str = "peer", ctx: zmq.Context | None = None,
                 identity: bytes | None = None, curve: CurveKeys | None = None,
                 send_timeout_ms: int = SEND_TIMEOUT_MS, max_msg_bytes: int | None = None,
                 heartbeat_ms: int | None = None):
        if kind not in _KINDS or (kind == "router") != isinstance(self, RouterChannel):
            raise ValueError(f"unknown channel kind {kind!r} for {type(self).__name__}")
        self.kind, self.peer, self.send_timeout_ms = kind, peer, send_timeout_ms
        self.endpoints: list[str] = []
        self._closed = False
        self._rcvtimeo = self._sndtimeo = -1  # libzmq defaults: block forever (never used as such)
        self._sock = (ctx or zmq.Context.instance()).socket(_KINDS[kind])
        s = self._sock
        s.linger = 0  # never block process exit on undelivered messages
        s.immediate = True  # queue only to live connections: a send to a peer that is gone times out, not piles up
        if kind == "dealer":
            # Admission is bound to the routing identity, so it must be unguessable (else a stranger could
            # connect under an authenticated rank's name once that rank's connection drops).
            s.identity = identity if identity is not None else random_identity()
        self._max_msg_bytes = -1 if max_msg_bytes is None else max_msg_bytes   # for every endpoint
        if max_msg_bytes is not None:
            s.maxmsgsize = max_msg_bytes  # a peer sending more is disconnected by libzmq
        if heartbeat_ms:  # ZMTP pings: a silently dead TCP peer (cut cable) is noticed and dropped
            s.heartbeat_ivl = heartbeat_ms
            s.heartbeat_timeout = 3 * heartbeat_ms
            s.heartbeat_ttl = 3 * heartbeat_ms
        if curve is not None:
            self._apply_curve(curve)
        # the deployment's keys (use_curve) apply when this socket binds (server) or connects (client)
        self._auto_curve = _deployment_curve if curve is None else None
        self._bound = False                      # bound (PULL, ROUTER) rather than connected
        self._link: LinkEnd | None = None        # this channel's end of a sealed TCP data link

    def seal_tcp(self, seal: LinkSeal | None, link: str | None = None) -> "Channel":
        """Seal what this channel sends, and take only messages sealed for this link, when it is a
        TCP link (bound or connected on tcp://; local ipc:// links stay as they are). `link` names
        the link: the endpoint of its bound end as the peers were told it (Register, Assign);
        default: the endpoint this channel bound or connected. Returns self."""
        if seal is not None and any(ep.startswith("tcp://") for ep in self.endpoints):
            ident = self._sock.identity if self.kind == "dealer" else b""
            self._link = seal.end(link or self.endpoints[0], bound=self._bound, identity=ident)
        return self

    @property
    def sealed(self) -> bool:
        return self._link is not None

    def _apply_curve(self, curve: CurveKeys) -> None:
        s = self._sock
        s.curve_publickey, s.curve_secretkey = curve.public, curve.secret
        if curve.is_server:
            s.curve_server = True
        else:
            s.curve_serverkey = curve.server_public

    def _auto_curve_as(self, server: bool) -> None:
        keys, self._auto_curve = self._auto_curve, None
        if keys is not None:
            self._apply_curve(keys if server else CurveKeys(*zmq.curve_keypair(), server_public=keys.public))

    # ------------------------------------------------------------ plumbing

    @property
    def socket(self) -> zmq.Socket:
        """The raw socket (for tests and polling); do not change linger or close it directly."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    def bind(self, endpoint: str, *, tcp_max_msg_bytes: int | None = None) -> str:
        """Bind and return the concrete endpoint (the real port for ``tcp://host:*``). ``tcp_max_msg_bytes``: where
        the endpoint is TCP, the largest frame it takes (see cap_frames)."""
        self._auto_curve_as(server=True)
        tcp = tcp_max_msg_bytes is not None and endpoint.startswith("tcp://")
        self._sock.maxmsgsize = tcp_max_msg_bytes if tcp else self._max_msg_bytes
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:   # a port in use, an address not of this host
            raise ProtocolError(f"cannot listen on {endpoint}: {e.strerror}") from None
        actual = self._sock.last_endpoint.decode()
        self.endpoints.append(actual)
        self._bound = True
        return actual

    def cap_frames(self, max_msg_bytes: int, timeout_s: float = 5.0) -> None:
        """From now on a peer announcing a frame over ``max_msg_bytes`` on one of this channel's TCP endpoints is
        disconnected by libzmq before the frame is read (protocol/limits.py). libzmq takes the option when a socket
        binds, so each TCP endpoint is listened on anew (the port stays; connected peers reconnect by themselves);
        ProtocolError when one cannot be bound again within ``timeout_s``. Local ipc:// endpoints keep theirs: only
        this user can open their directory, and libzmq, closing an ipc listener later in its I/O thread, would
        unlink the path its replacement had just bound."""
        for endpoint in [ep for ep in self.endpoints if ep.startswith("tcp://")]:
            self._sock.unbind(endpoint)
            self._sock.maxmsgsize = max_msg_bytes
            deadline = time.monotonic() + timeout_s
            while True:   # the old listener is closed by libzmq's I/O thread: the port frees a moment later
                try:
                    self._sock.bind(endpoint)
                    break
                except zmq.ZMQError as e:
                    if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                        raise ProtocolError(f"cannot listen on {endpoint} again: {e.strerror}") from None
                    time.sleep(0.005)
        self._sock.maxmsgsize = self._max_msg_bytes   # what any later bind of another kind takes

    def connect(self, endpoint: str) -> "Channel":
        self._auto_curve_as(server=False)
        self._sock.connect(endpoint)
        self.endpoints.append(endpoint)
        return self

    def close(self, linger_ms: int = 0) -> None:
        """Close now. ``linger_ms`` > 0 lets messages already queued (a last Shutdown) leave for that long."""
        if not self._closed:
            self._closed = True
            self._sock.close(linger=linger_ms)

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} peer={self.peer!r} {self.endpoints} closed={self._closed}>"

    def poll(self, timeout_ms: int) -> bool:
        """True if a message is waiting (waits at most timeout_ms)."""
        return bool(self._sock.poll(timeout_ms, zmq.POLLIN))

    # ------------------------------------------------------------ frames

    # The wait bounds are socket options (RCVTIMEO/SNDTIMEO) set only when they change: one blocking libzmq call
    # per message, with no poller object or exception on the hot path (a hand-off budget is ~100 µs).

    def send_frames(self, frames: Sequence[Any], *, copy: bool = False, timeout_ms: int | None = None,
                    what: str = "a message") -> None:
        """Send raw frames with a bounded wait for queue space / a connected peer."""
        t = self.send_timeout_ms if timeout_ms is None else timeout_ms
        if t != self._sndtimeo:
            self._sock.sndtimeo = self._sndtimeo = t
        try:
            self._sock.send_multipart(frames, copy=copy)
        except zmq.Again:
            raise ProtocolTimeout(self.peer, what, t, sending=True) from None
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise PeerGone(self.peer, what) from None
            raise

    def recv_frames(self, timeout_ms: int = RECV_TIMEOUT_MS, *, what: str = "a message") -> list[zmq.Frame]:
        """Raw frames of the next message (zero-copy zmq.Frame objects); ProtocolTimeout after timeout_ms."""
        if timeout_ms is None or timeout_ms < 0:
            raise ValueError("every wait needs a finite timeout (loop over recv to wait longer)")
        if timeout_ms != self._rcvtimeo:
            self._sock.rcvtimeo = self._rcvtimeo = timeout_ms
        try:
            return self._sock.recv_multipart(copy=False)
        except zmq.Again:
            raise ProtocolTimeout(self.peer, what, timeout_ms) from None

    # ------------------------------------------------------------ messages

    def send(self, msg: Message, arrays: Sequence[np.ndarray] = (), *, copy: bool = False,
             timeout_ms: int | None = None) -> None:
        """Send a message. With copy=False (default) large arrays go out without a copy: do not write into them
        until the peer has them (pass copy=True, or a fresh array, when the buffer is reused right away)."""
        frames = encode(msg, arrays)
        if self._link is not None:
            frames = self._link.seal(frames)
        self.send_frames(frames, copy=copy, timeout_ms=timeout_ms, what=msg.TYPE)

    def _recv_opened(self, timeout_ms: int, what: str, skip: int) -> list:
        """The next message's frames; on a sealed link, the next one that proves itself (the
        first `skip` frames, a ROUTER's identity, are outside the seal). Messages that do not are
        dropped and counted by the seal, and the wait goes on until timeout_ms."""
        if self._link is None:
            return self.recv_frames(timeout_ms, what=what)
        deadline, left = time.monotonic() + timeout_ms / 1000, timeout_ms
        while True:
            frames = self.recv_frames(left, what=what)
            opened = self._link.open(frames[skip:])
            if opened is not None:
                return frames[:skip] + opened
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0:
                raise ProtocolTimeout(self.peer, what, timeout_ms)

    def recv(self, timeout_ms: int = RECV_TIMEOUT_MS, *, what: str = "a message") -> tuple[Message, list[np.ndarray]]:
        """(message, arrays). Arrays are views of the received frames (no copy; treat as read-only). Raises
        ProtocolTimeout, or ProtocolError when the message was invalid (the channel stays usable)."""
        frames = self._recv_opened(timeout_ms, what, 0)
        return _decode_from(frames, self.peer, None)


class RouterChannel(Channel):
    """ROUTER side: many peers, each addressed by its identity (bytes). Sending to a gone peer raises PeerGone."""

    def __init__(self, *, peer: str = "peers", **kw: Any):
        super().__init__("router", peer=peer, **kw)
        # Unroutable → error, not a silent drop. No ROUTER_HANDOVER: a live peer's identity cannot be taken over;
        # a restarted rank simply comes back with a new random identity and authenticates again.
        self._sock.router_mandatory = True

    def send(self, identity: bytes, msg: Message, arrays: Sequence[np.ndarray] = (), *,  # type: ignore[override]
             copy: bool = False, timeout_ms: int | None = None) -> None:
        body = encode(msg, arrays)
        frames = [identity] + (self._link.seal(body, peer=identity) if self._link is not None else body)
        try:
            self.send_frames(frames, copy=copy, timeout_ms=timeout_ms, what=msg.TYPE)
        except PeerGone:
            raise PeerGone(show_identity(identity), msg.TYPE) from None

    def recv(self, timeout_ms: int = RECV_TIMEOUT_MS, *,  # type: ignore[override]
             what: str = "a message") -> tuple[bytes, Message, list[np.ndarray]]:
        """(identity, message, arrays). A ProtocolError carries ``.peer`` = identity so the caller can answer."""
        return self.parse(self.recv_raw(timeout_ms, what=what))

    def recv_raw(self, timeout_ms: int = RECV_TIMEOUT_MS, *, what: str = "a message") -> list:
        """The next message's frames, identity first, not yet decoded: a server can look at who sent it (the
        identity, `peer_address`) before it spends a decode on it."""
        return self._recv_opened(timeout_ms, what, 1)

    @staticmethod
    def parse(frames: list) -> tuple[bytes, Message, list[np.ndarray]]:
        """(identity, message, arrays) of frames from recv_raw; ProtocolError as recv."""
        identity = frames[0].bytes
        msg, arrays = _decode_from(frames[1:], show_identity(identity), identity)
        return identity, msg, arrays


def peer_address(frame) -> str | None:
    """The network address a received frame came from (TCP: the peer's IP), or None where the transport has none."""
    try:
        return frame.get("Peer-Address") or None
    except (zmq.ZMQError, AttributeError, TypeError):
        return None


def show_identity(identity: bytes) -> str:
    """A routing identity as text (printable as is, else hex)."""
    try:
        s = identity.decode()
        if s.isprintable():
            return s
    except UnicodeDecodeError:
        pass
    return identity.hex()


def _decode_from(frames: list, peer: str, identity: bytes | None) -> tuple[Message, list[np.ndarray]]:
    try:
        return decode(frames)
    except ProtocolError as e:
        e.peer = identity
        e.args = (f"from {peer}: {e.args[0] if e.args else e}",)
        raise


class Poller:
    """Wait on several channels at once."""

    def __init__(self, *channels: Channel):
        self._poller = zmq.Poller()
        self._by_sock: dict[zmq.Socket, Channel] = {}
        for ch in channels:
            self.add(ch)

    def add(self, ch: Channel) -> None:
        self._poller.register(ch.socket, zmq.POLLIN)
        self._by_sock[ch.socket] = ch

    def remove(self, ch: Channel) -> None:
        if self._by_sock.pop(ch.socket, None) is not None:
            self._poller.unregister(ch.socket)

    def poll(self, timeout_ms: int) -> list[Channel]:
        """Channels with a message waiting, in registration order; [] when timeout_ms passes first."""
        ready = dict(self._poller.poll(timeout_ms))
        return [ch for s, ch in self._by_sock.items() if s in ready]

    def wait(self, timeout_ms: int, what: str = "a message") -> list[Channel]:
        """Like poll, but raises ProtocolTimeout naming every channel's peer when nothing arrives."""
        ready = self.poll(timeout_ms)
        if not ready:
            peers = ", ".join(ch.peer for ch in self._by_sock.values()) or "no channel"
            raise ProtocolTimeout(peers, what, timeout_ms)
        return ready


__all__ = [
    "Channel", "RouterChannel", "Poller", "Endpoints", "CurveKeys", "ProtocolTimeout", "PeerGone",
    "new_curve_keypair", "advertise", "random_identity", "use_curve", "deployment_curve", "write_curve_keys",
    "load_curve_keys", "is_loopback_endpoint", "peer_address", "show_identity", "local_address_toward",
    "CONNECT_TIMEOUT_MS", "RECV_TIMEOUT_MS", "SEND_TIMEOUT_MS",
    "HEARTBEAT_INTERVAL_MS", "HEARTBEAT_TIMEOUT_MS",
]
