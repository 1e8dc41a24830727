"""Shared-secret admission: an HMAC-SHA256 challenge-response on every control connection.

    client → Hello(client_id, protocol_version, nonce_c)
    server → Challenge(nonce_s, protocol_version, server_id)      or Error(code="version")
    client → Auth(client_id, mac = HMAC(secret, nonce_s || client_id))
    server → AuthOk(mac = HMAC(secret, "strata-server" || nonce_c || nonce_s))   or Error(code="auth", fatal)

The server's answer proves it holds the secret too, so a rank never takes an assignment from an impostor.
Nonces are fresh per connection attempt, so a recorded exchange cannot be replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections import OrderedDict
from typing import Mapping

from .bounded_read import KIB, FileTooLarge, read_capped
from .messages import (ERR_AUTH, ERR_FINGERPRINT, ERR_VERSION, PROTOCOL_VERSION, Auth, AuthOk, Challenge, Error,
                       Hello, Message, ProtocolError, Register, VersionMismatch)
from .transport import CONNECT_TIMEOUT_MS, Channel

SECRET_ENV = "STRATA_TOKEN"
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16  # shorter secrets are refused: they can be guessed offline from one recorded exchange
SECRET_FILE_MAX = 64 * KIB  # a token file past this is not a token (/dev/zero, a log): refused unread
_SERVER_TAG = b"strata-server\0"


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
            raw, source = read_capped(token_file, SECRET_FILE_MAX, "--token-file"), f"token file {token_file}"
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
    """Per-server handshake state, keyed by peer identity (the ROUTER identity). Transport-free: feed it messages,
    send back what it returns.

        reply = auth.guard(identity, msg)
        if reply is not None: router.send(identity, reply); continue   # handshake step or refusal
        ... msg comes from an authenticated peer ...

    Call forget(peer) when a peer is declared dead. Identities must be unguessable (transport.random_identity,
    the DEALER default), since admission is bound to them.
    """

    def __init__(self, secret: bytes, server_id: str = "coordinator", max_pending: int = 1024):
        self._secret, self.server_id, self._max_pending = secret, server_id, max_pending
        self._pending: OrderedDict[bytes, tuple[str, bytes, bytes]] = OrderedDict()  # peer → (id, nonce_c, nonce_s)
        self._authed: dict[bytes, str] = {}

    def is_authenticated(self, peer: bytes) -> bool:
        return peer in self._authed

    def client_id(self, peer: bytes) -> str | None:
        return self._authed.get(peer)

    def forget(self, peer: bytes) -> None:
        self._pending.pop(peer, None)
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

    def handle(self, peer: bytes, msg: Message) -> Message | None:
        """Reply to Hello/Auth; None for any other message."""
        if isinstance(msg, Hello):
            self.forget(peer)  # a new Hello restarts the handshake (a reconnecting rank)
            if msg.protocol_version != PROTOCOL_VERSION:
                return Error(rank=None, request_id=None, code=ERR_VERSION, fatal=True,
                             message=str(VersionMismatch(msg.protocol_version, what=msg.client_id)))
            nonce = os.urandom(NONCE_BYTES)
            self._pending[peer] = (msg.client_id, msg.nonce, nonce)
            while len(self._pending) > self._max_pending:  # bounded: half-open handshakes cannot eat memory
                self._pending.popitem(last=False)
            return Challenge(nonce=nonce, protocol_version=PROTOCOL_VERSION, server_id=self.server_id)
        if isinstance(msg, Auth):
            state = self._pending.pop(peer, None)
            if state is None:
                return Error(rank=None, request_id=None, code=ERR_AUTH, fatal=True,
                             message="Auth without a pending Challenge (send Hello first)")
            client_id, client_nonce, nonce = state
            if msg.client_id != client_id:
                return Error(rank=None, request_id=None, code=ERR_AUTH, fatal=True,
                             message=f"Auth for {msg.client_id!r} after Hello from {client_id!r}")
            if not hmac.compare_digest(msg.mac, client_mac(self._secret, nonce, client_id)):
                return Error(rank=None, request_id=None, code=ERR_AUTH, fatal=True,
                             message=f"authentication failed for {client_id!r}: wrong shared secret "
                                     f"(check --token-file / {SECRET_ENV} on both sides)")
            self._authed[peer] = client_id
            return AuthOk(mac=server_mac(self._secret, client_nonce, nonce))
        return None


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
    channel.send(Auth(client_id=client_id, mac=client_mac(secret, challenge.nonce, client_id)),
                 timeout_ms=timeout_ms)
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


__all__ = ["AuthError", "Authenticator", "SECRET_ENV", "new_secret", "load_secret", "write_secret", "client_mac",
           "server_mac", "admit", "client_handshake"]
