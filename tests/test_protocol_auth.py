"""HMAC admission: secrets loading, and the handshake between two real processes over ZeroMQ."""

import os
import stat
import subprocess
import sys
import threading

import pytest

from protocol import messages as m
from protocol.auth import (CHALLENGE_WINDOW_S, SECRET_ENV, AuthError, Authenticator, StrangerLimits, admit,
                           client_handshake, client_mac, load_secret, new_secret, server_mac, write_secret)
from protocol.transport import Channel, Endpoints, ProtocolTimeout, RouterChannel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = b"0123456789abcdef0123456789abcdef"
FINGERPRINT = "sha256:model-a"

# A rank, reduced to its admission: handshake, Register, wait for Assign. Prints one line, exits 0 on success.
CLIENT = r"""
import sys
from protocol import messages as m
from protocol.auth import AuthError, client_handshake
from protocol.transport import Channel
ep, secret, fingerprint, version = sys.argv[1], sys.argv[2].encode(), sys.argv[3], int(sys.argv[4])
with Channel("dealer", peer="coordinator") as ch:
    ch.connect(ep)
    try:
        if version != m.PROTOCOL_VERSION:  # an old/new build: its Hello carries its own version
            ch.send(m.Hello(client_id="r", protocol_version=version, nonce=b"n" * 32))
            reply, _ = ch.recv(5000)
            print("ERR", reply.code, reply.message)
            sys.exit(3)
        server = client_handshake(ch, secret, "rank-1", timeout_ms=5000)
        ch.send(m.Register(rank=None, host="h", pid=1, devices=[], model_fingerprint=fingerprint,
                           protocol_version=m.PROTOCOL_VERSION))
        reply, _ = ch.recv(5000)
    except AuthError as e:
        print("ERR", e.code, e)
        sys.exit(3)
    if isinstance(reply, m.Error):
        print("ERR", reply.code, reply.message)
        sys.exit(3)
    print("OK", server, reply.TYPE, reply.rank)
"""


class Coordinator:
    """The admission part of a coordinator, serving from a thread of the test process."""

    def __init__(self, endpoint: str, secret: bytes = SECRET):
        self.router = RouterChannel(peer="ranks")
        self.endpoint = self.router.bind(endpoint)
        self.auth = Authenticator(secret, server_id="coord-test")
        self.refused: list[m.Error] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                ident, msg, _ = self.router.recv(50)
            except ProtocolTimeout:
                continue
            reply = self.auth.guard(ident, msg)
            if reply is None and isinstance(msg, m.Register):
                reply = admit(msg, FINGERPRINT) or m.Assign(rank=1, role="stage", lb=0, le=2, first=True,
                                                            last=True, device="cpu", plan={})
            if isinstance(reply, m.Error):
                self.refused.append(reply)
            if reply is not None:
                self.router.send(ident, reply)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.router.close()


@pytest.fixture
def coord():
    with Endpoints() as eps:
        c = Coordinator(eps.ipc("coord"))
        yield c
        c.close()


def _rank(endpoint, secret, fingerprint=FINGERPRINT, version=m.PROTOCOL_VERSION):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", CLIENT, endpoint, secret, fingerprint, str(version)],
                       capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
    return p.returncode, p.stdout.strip() + p.stderr.strip()


def test_right_secret_is_admitted(coord):
    rc, out = _rank(coord.endpoint, SECRET.decode())
    assert rc == 0, out
    assert out == "OK coord-test assign 1"


def test_wrong_secret_is_refused(coord):
    rc, out = _rank(coord.endpoint, "not-the-secret-not-the-secret")
    assert rc == 3, out
    assert out.startswith("ERR auth") and "wrong shared secret" in out
    assert coord.refused and coord.refused[0].code == m.ERR_AUTH and coord.refused[0].fatal


def test_wrong_fingerprint_and_version_are_refused_naming_both(coord):
    rc, out = _rank(coord.endpoint, SECRET.decode(), fingerprint="sha256:model-b")
    assert rc == 3 and "ERR fingerprint" in out and "sha256:model-b" in out and FINGERPRINT in out, out
    rc, out = _rank(coord.endpoint, SECRET.decode(), version=m.PROTOCOL_VERSION + 1)
    assert rc == 3 and "ERR version" in out, out
    assert f"v{m.PROTOCOL_VERSION + 1}" in out and f"v{m.PROTOCOL_VERSION}" in out


def test_unauthenticated_requests_are_refused(coord):
    with Channel("dealer", peer="coordinator") as ch:
        ch.connect(coord.endpoint)
        ch.send(m.Register(rank=0, host="h", pid=1, devices=[], model_fingerprint=FINGERPRINT,
                           protocol_version=m.PROTOCOL_VERSION))
        reply, _ = ch.recv(5000)
        assert isinstance(reply, m.Error) and reply.code == m.ERR_AUTH and "not authenticated" in reply.message
        ch.send(m.Auth(client_id="x", mac=bytes(32)))  # Auth without Hello
        reply, _ = ch.recv(5000)
        assert isinstance(reply, m.Error) and "without a Challenge" in reply.message and "send Hello" in reply.message


def test_client_detects_an_impostor_server():
    """A server that does not know the secret cannot produce AuthOk's proof, so the rank refuses it."""
    with Endpoints() as eps, RouterChannel() as fake, Channel("dealer", peer="coordinator") as ch:
        ch.connect(fake.bind(eps.ipc("fake")))
        result = {}

        def run():
            try:
                client_handshake(ch, SECRET, "rank-1", timeout_ms=3000)
            except AuthError as e:
                result["err"] = e

        t = threading.Thread(target=run)
        t.start()
        ident, hello, _ = fake.recv(3000)
        fake.send(ident, m.Challenge(nonce=b"x" * 32, protocol_version=m.PROTOCOL_VERSION, server_id="evil"))
        fake.recv(3000)
        fake.send(ident, m.AuthOk(mac=bytes(32)))
        t.join(5)
        assert "failed to prove" in str(result["err"])


def test_authenticator_state_machine():
    now = [1000.0]
    a = Authenticator(SECRET, clock=lambda: now[0])
    nonce_c = os.urandom(32)

    def hello(peer, client_id="r"):
        return a.handle(peer, m.Hello(client_id=client_id, protocol_version=m.PROTOCOL_VERSION, nonce=nonce_c))

    def auth(peer, challenge, client_id="r", secret=SECRET):
        return a.handle(peer, m.Auth(client_id=client_id, mac=client_mac(secret, challenge, client_id),
                                     challenge=challenge))

    ch = hello(b"p")
    assert isinstance(ch, m.Challenge) and nonce_c in ch.nonce
    assert a.handle(b"p", m.Heartbeat(rank=0, seq=0)) is None and not a.is_authenticated(b"p")
    ok = auth(b"p", ch.nonce)
    assert isinstance(ok, m.AuthOk) and ok.mac == server_mac(SECRET, nonce_c, ch.nonce)
    assert a.is_authenticated(b"p") and a.client_id(b"p") == "r" and a.guard(b"p", m.Stats()) is None
    # a recorded answer is useless: on another connection, and on its own once spent
    assert "issued to this connection" in auth(b"q", ch.nonce).message
    assert "already answered" in auth(b"p", ch.nonce).message
    # the client id must be the Hello's, the secret the server's
    ch2 = hello(b"s")
    assert "issued to this connection and client id" in auth(b"s", ch2.nonce, client_id="z").message
    assert "wrong shared secret" in auth(b"s", ch2.nonce, secret=b"x" * 32).message
    # a challenge expires (its window or the next), and a forged one is refused
    ch3 = hello(b"t")
    now[0] += 2 * CHALLENGE_WINDOW_S
    assert "older than" in auth(b"t", ch3.nonce).message
    assert "without a Challenge" in auth(b"t", b"x" * 12).message
    # strangers' Hellos leave nothing behind: a handshake in progress survives any number of them
    ch4 = hello(b"u")
    for i in range(5000):
        hello(b"stranger-%d" % i)
    assert isinstance(auth(b"u", ch4.nonce), m.AuthOk)
    assert len(a._answered) == 1 and set(a._authed) == {b"p", b"u"}   # p's spent challenge expired
    a.forget(b"p")
    assert not a.is_authenticated(b"p")


def test_stranger_limits_rate_and_log_once_a_minute():
    now = [0.0]
    s = StrangerLimits(rate=5, burst=10, log_every_s=60, lines=2, max_peers=3, clock=lambda: now[0])
    assert sum(s.admit(b"a") for _ in range(100)) == 10 and s.dropped == 90
    now[0] += 1.0
    assert sum(s.admit(b"a") for _ in range(100)) == 5           # refilled at its rate
    assert all(s.admit(b"b") for _ in range(10))                  # each peer its own allowance
    lines = [s.refusal("10.0.0.1", "refused a rank: x") for _ in range(1000)]
    assert sum(line is not None for line in lines) == 1 and "from 10.0.0.1" in lines[0]
    assert s.refusal("10.0.0.1", "refused a rank: y") is not None       # another reason of the same source
    assert s.refusal("10.0.0.2", "refused") is None                       # lines: 2 a period
    assert s.summary() is None                                      # the minute is not over
    now[0] += 60
    summary = s.summary()
    assert "1000 refusal(s) not logged" in summary and "185 message(s)" in summary, summary
    assert s.refusal("10.0.0.1", "refused a rank: x") is not None   # a new minute: said again
    for i in range(100):
        s.admit(b"peer-%d" % i)
    assert len(s._buckets) == 3


def test_load_secret(tmp_path):
    f = tmp_path / "token"
    f.write_text("  " + SECRET.decode() + "\n\n")
    assert load_secret(str(f), {}) == SECRET
    assert load_secret(str(f), {SECRET_ENV: "other-secret-other-secret"}) == SECRET  # the file wins
    assert load_secret(None, {SECRET_ENV: " " + SECRET.decode() + "\n"}) == SECRET
    with pytest.raises(AuthError, match="--token-file PATH or set STRATA_TOKEN"):
        load_secret(None, {})
    with pytest.raises(AuthError, match="cannot read token file"):
        load_secret(str(tmp_path / "missing"), {})
    with pytest.raises(AuthError, match="at least 16"):
        load_secret(None, {SECRET_ENV: "short"})


def test_new_and_write_secret(tmp_path):
    s1, s2 = new_secret(), new_secret()
    assert s1 != s2 and len(s1) == 64
    p = tmp_path / "tok"
    write_secret(str(p), s1)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert load_secret(str(p), {}) == s1.encode()
