"""Shared-secret admission: an HMAC-SHA256 challenge-response on every control connection.

    client → Hello(client_id, protocol_version, nonce_c)
    server → Challenge(nonce_s, protocol_version, server_id)      or Error(code="version")
    client → Auth(client_id, mac = HMAC(secret, nonce_s || client_id), challenge = nonce_s)
    server → AuthOk(mac = HMAC(secret, "strata-server" || nonce_c || nonce_s))   or Error(code="auth", fatal)

The server's answer proves it holds the secret too, so a rank never takes an assignment from an impostor.

The server keeps no state for a handshake in progress: its challenge is

    nonce_s = window (u64 LE) || nonce_c || HMAC(server-local key, window || connection identity || nonce_c
                                                 || client_id)[:16]

under a key that never leaves the server process, and the client sends it back with its Auth. The server
recomputes the tag, so a challenge is good only for the connection and client id it was issued to, within its
window or the next (CHALLENGE_WINDOW_S), once: a challenge answered with the secret is remembered until it
expires (only a process that proves the secret adds to that). Any number of strangers sending Hello therefore
cost the server an HMAC each and can never crowd out a rank's handshake. A recorded exchange cannot be
replayed: the challenge is spent, and bound to a connection identity that is random per connection.

`StrangerLimits` bounds what an unauthenticated peer can make the server do and log (coordinator.py).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import time
from collections import OrderedDict
from typing import Callable, Mapping

from .bounded_read import KEY_FILE_MAX, FileTooLarge, read_capped
from .messages import (ERR_AUTH, ERR_FINGERPRINT, ERR_VERSION, PROTOCOL_VERSION, Auth, AuthOk, Challenge, Error,
                       Hello, Message, ProtocolError, Register, VersionMismatch)
from .transport import CONNECT_TIMEOUT_MS, Channel

SECRET_ENV = "STRATA_TOKEN"
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16  # shorter secrets are refused: they can be guessed offline from one recorded exchange
_SERVER_TAG = b"strata-server\0"
_CHALLENGE_TAG = b"strata-challenge\0"
CHALLENGE_WINDOW_S = 30.0   # a challenge is answered within its window or the next: 30 to 60 s (replies wait 10 s)
_WINDOW = struct.Struct("<Q")
_CHALLENGE_MAC_BYTES = 16
CHALLENGE_BYTES = _WINDOW.size + NONCE_BYTES + _CHALLENGE_MAC_BYTES


class AuthError(ProtocolError):
    """Admission failed: no/short secret, wrong secret, or the peer broke the handshake. ``code`` as in Error."""

    def __init__(self, message: str, *, code: str = ERR_AUTH, peer: bytes | None = None):
        super().__init__(message, peer=peer)
        self.code = code


# ---------------------------------------------------------------- secrets


def new_secret() -> str:
    """A fresh random secret (64 hex chars) — what strata-launch generates per launch."""
    return secrets.token_hex(32)


def load_secret(token_file: str | None = None, environ: Mapping[str, str] | None = None) -> bytes:
    """The shared secret from ``token_file`` if given, else from $STRATA_TOKEN; surrounding whitespace stripped."""
    environ = os.environ if environ is None else environ
    if token_file:
        try:
            raw, source = read_capped(token_file, KEY_FILE_MAX, "--token-file"), f"token file {token_file}"
        except FileTooLarge as e:
            raise AuthError(str(e)) from None
        except OSError as e:
            raise AuthError(f"cannot read token file {token_file}: {e.strerror or e}") from None
    elif environ.get(SECRET_ENV):
        raw, source = environ[SECRET_ENV].encode(), f"${SECRET_ENV}"
    else:
        raise AuthError(f"no shared secret: pass --token-file PATH or set {SECRET_ENV}")
    secret = raw.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"the secret in {source} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed "
                        "(generate one with: python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def write_secret(path: str, secret: str | bytes) -> None:
    """Write a token file readable by its owner only (created 0600 before any byte is written)."""
    data = secret.encode() if isinstance(secret, str) else secret
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data + b"\n")
    finally:
        os.close(fd)


def client_mac(secret: bytes, nonce: bytes, client_id: str) -> bytes:
    return hmac.new(secret, nonce + client_id.encode(), hashlib.sha256).digest()


def server_mac(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    # Domain-separated from client_mac so a client's answer can never be replayed as the server's proof.
    return hmac.new(secret, _SERVER_TAG + client_nonce + server_nonce, hashlib.sha256).digest()


# ---------------------------------------------------------------- server side


class Authenticator:
    """Handshake state of one server: the peers (ROUTER identities) that proved the secret. Transport-free: feed
    it messages, send back what it returns.

        reply = auth.guard(identity, msg)
        if reply is not None: router.send(identity, reply); continue   # handshake step or refusal
        ... msg comes from an authenticated peer ...

    Call forget(peer) when a peer is declared dead. Identities must be unguessable (transport.random_identity,
    the DEALER default), since admission is bound to them. A handshake in progress holds nothing here (see the
    module's docstring); `clock` (monotonic seconds) is for tests.
    """

    def __init__(self, secret: bytes, server_id: str = "coordinator",
                 clock: Callable[[], float] = time.monotonic):
        self._secret, self.server_id, self._clock = secret, server_id, clock
        self._challenge_key = os.urandom(32)          # never leaves this process
        self._answered: dict[bytes, int] = {}         # challenge tag → window, for challenges answered with the secret
        self._authed: dict[bytes, str] = {}

    def is_authenticated(self, peer: bytes) -> bool:
        return peer in self._authed

    def client_id(self, peer: bytes) -> str | None:
        return self._authed.get(peer)

    def forget(self, peer: bytes) -> None:
        self._authed.pop(peer, None)

    def guard(self, peer: bytes, msg: Message) -> Message | None:
        """The reply for a handshake message or an unauthenticated peer; None when ``msg`` may be served."""
        reply = self.handle(peer, msg)
        if reply is not None:
            return reply
        if peer not in self._authed:
            return Error(rank=None, request_id=None, code=ERR_AUTH, fatal=True,
                         message=f"{msg.TYPE} refused: not authenticated (send Hello first)")
        return None

    def _window(self) -> int:
        return int(self._clock() // CHALLENGE_WINDOW_S)

    def _tag(self, window: int, peer: bytes, client_nonce: bytes, client_id: str) -> bytes:
        body = _CHALLENGE_TAG + _WINDOW.pack(window) + _WINDOW.pack(len(peer)) + peer + client_nonce
        return hmac.new(self._challenge_key, body + client_id.encode(), hashlib.sha256).digest()[:_CHALLENGE_MAC_BYTES]

    def handle(self, peer: bytes, msg: Message) -> Message | None:
        """Reply to Hello/Auth; None for any other message."""
        if isinstance(msg, Hello):
            self.forget(peer)  # a new Hello restarts the handshake (a reconnecting rank)
            if msg.protocol_version != PROTOCOL_VERSION:
                return Error(rank=None, request_id=None, code=ERR_VERSION, fatal=True,
                             message=str(VersionMismatch(msg.protocol_version, what=msg.client_id)))
            if len(msg.nonce) != NONCE_BYTES:
                return _refusal(f"Hello from {msg.client_id!r}: its nonce is {len(msg.nonce)} bytes, "
                                f"not {NONCE_BYTES}")
            window = self._window()
            nonce = _WINDOW.pack(window) + msg.nonce + self._tag(window, peer, msg.nonce, msg.client_id)
            return Challenge(nonce=nonce, protocol_version=PROTOCOL_VERSION, server_id=self.server_id)
        if isinstance(msg, Auth):
            return self._on_auth(peer, msg)
        return None

    def _on_auth(self, peer: bytes, msg: Auth) -> Message:
        nonce = msg.challenge
        if len(nonce) != CHALLENGE_BYTES:
            return _refusal("Auth without a Challenge of this server (send Hello first)")
        window = _WINDOW.unpack_from(nonce)[0]
        client_nonce, tag = nonce[_WINDOW.size:-_CHALLENGE_MAC_BYTES], nonce[-_CHALLENGE_MAC_BYTES:]
        if not hmac.compare_digest(tag, self._tag(window, peer, client_nonce, msg.client_id)):
            return _refusal(f"Auth for {msg.client_id!r} answers no Challenge this server issued to this connection "
                            "and client id (send Hello first)")
        now = self._window()
        if not now - 1 <= window <= now:
            return _refusal(f"Auth for {msg.client_id!r} answers a Challenge older than "
                            f"{CHALLENGE_WINDOW_S:.0f} s (send Hello again)")
        if tag in self._answered:
            return _refusal(f"Auth for {msg.client_id!r} answers a Challenge already answered (a replay)")
        if not hmac.compare_digest(msg.mac, client_mac(self._secret, nonce, msg.client_id)):
            return _refusal(f"authentication failed for {msg.client_id!r}: wrong shared secret "
                            f"(check --token-file / {SECRET_ENV} on both sides)")
        # spent: kept until it expires (entries come only from processes that proved the secret)
        self._answered = {t: w for t, w in self._answered.items() if w >= now - 1}
        self._answered[tag] = window
        self._authed[peer] = msg.client_id
        return AuthOk(mac=server_mac(self._secret, client_nonce, nonce))


def _refusal(message: str) -> Error:
    return Error(rank=None, request_id=None, code=ERR_AUTH, fatal=True, message=message)


class StrangerLimits:
    """What peers that have not proved the secret may cost a server: each (ROUTER identity) gets `rate` messages
    a second (bursts of `burst`), the rest are dropped unread; and each refusal they earn is logged once per
    source (network address, else identity) per `log_every_s`, at most `lines` a period, the rest counted and
    told in one summary line a period. Memory is bounded by `max_peers` (the least recently heard beyond it
    are forgotten: a forgotten peer only gets a fresh allowance). Authenticated peers are never limited here."""

    def __init__(self, rate: float = 5.0, burst: float = 20.0, log_every_s: float = 60.0, lines: int = 16,
                 max_peers: int = 4096, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.log_every_s, self.lines, self.max_peers = rate, burst, log_every_s, lines, max_peers
        self._clock = clock
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()   # peer → (tokens, when)
        self._logged: set[tuple[str, str]] = set()   # (source, refusal) logged this period
        self._period_start = clock()
        self.dropped = self.refused = 0       # totals: messages dropped unread, refusals not logged
        self._dropped_now = self._quiet_now = 0

    def admit(self, peer: bytes) -> bool:
        """Whether a message from unauthenticated `peer` may be read now (counted as dropped when not)."""
        now = self._clock()
        tokens, when = self._buckets.pop(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - when) * self.rate)
        ok = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        if not ok:
            self.dropped += 1
            self._dropped_now += 1
        return ok

    def refusal(self, source: str, message: str) -> str | None:
        """The line to log for a refusal from `source`, or None when it is only counted: each refusal of a
        source is said once a period (a host whose ranks are refused for two reasons shows both), at most
        `lines` a period in all (a stranger varying what it sends cannot fill the log)."""
        key = (source, message)
        if key not in self._logged and len(self._logged) < self.lines:
            self._logged.add(key)
            return f"{message} (from {source}; the same again is counted, said once a minute)"
        self.refused += 1
        self._quiet_now += 1
        return None

    def summary(self) -> str | None:
        """Once a period, what was dropped and not logged in it (None when nothing was, or before the period
        ends); opens the next period, in which every source may be logged again."""
        now = self._clock()
        if now - self._period_start < self.log_every_s:
            return None
        span, self._period_start = now - self._period_start, now
        quiet, dropped = self._quiet_now, self._dropped_now
        self._logged, self._quiet_now, self._dropped_now = set(), 0, 0
        if not quiet and not dropped:
            return None
        return (f"unauthenticated peers in the last {span:.0f} s: {quiet} refusal(s) not logged, {dropped} "
                f"message(s) over the rate of {self.rate:g}/s per peer dropped unread")


def admit(reg: Register, model_fingerprint: str) -> Error | None:
    """The refusal for a Register whose protocol version or model differs from the server's, naming both values."""
    if reg.protocol_version != PROTOCOL_VERSION:
        return Error(rank=reg.rank, request_id=None, code=ERR_VERSION, fatal=True,
                     message=str(VersionMismatch(reg.protocol_version, what=f"rank on {reg.host}")))
    if reg.model_fingerprint != model_fingerprint:
        return Error(rank=reg.rank, request_id=None, code=ERR_FINGERPRINT, fatal=True,
                     message=f"model fingerprint mismatch: rank on {reg.host} has {reg.model_fingerprint}, "
                             f"coordinator has {model_fingerprint}; every host must serve the same GGUF file")
    return None


# ---------------------------------------------------------------- client side


def client_handshake(channel: Channel, secret: bytes, client_id: str, *,
                     timeout_ms: int = CONNECT_TIMEOUT_MS) -> str:
    """Run the handshake on a connected DEALER; returns the server_id. Raises AuthError (refused or impostor),
    VersionMismatch, or ProtocolTimeout (no server answered)."""
    client_nonce = os.urandom(NONCE_BYTES)
    channel.send(Hello(client_id=client_id, protocol_version=PROTOCOL_VERSION, nonce=client_nonce),
                 timeout_ms=timeout_ms)
    challenge = _expect(channel, Challenge, timeout_ms)
    if challenge.protocol_version != PROTOCOL_VERSION:
        raise VersionMismatch(challenge.protocol_version, what=f"server {challenge.server_id}")
    channel.send(Auth(client_id=client_id, mac=client_mac(secret, challenge.nonce, client_id),
                      challenge=challenge.nonce), timeout_ms=timeout_ms)
    ok = _expect(channel, AuthOk, timeout_ms)
    if not hmac.compare_digest(ok.mac, server_mac(secret, client_nonce, challenge.nonce)):
        raise AuthError(f"server {challenge.server_id or channel.peer} failed to prove it holds the shared secret")
    return challenge.server_id


def _expect(channel: Channel, cls: type, timeout_ms: int):
    msg, _ = channel.recv(timeout_ms, what=cls.__name__)
    if isinstance(msg, Error):
        raise AuthError(f"refused by {channel.peer}: {msg.message}", code=msg.code or ERR_AUTH)
    if not isinstance(msg, cls):
        raise AuthError(f"handshake: expected {cls.__name__} from {channel.peer}, got {msg.TYPE}")
    return msg


__all__ = ["AuthError", "Authenticator", "StrangerLimits", "CHALLENGE_WINDOW_S", "SECRET_ENV", "new_secret",
           "load_secret", "write_secret", "client_mac", "server_mac", "admit", "client_handshake"]
