"""Transport over real ZeroMQ sockets: ipc:// and tcp://, timeouts, zero-copy receive, garbage-resistant serving."""

import os
import random
import threading
import time

import numpy as np
import pytest
import zmq

from protocol import messages as m
from protocol.codec import decode, encode
from protocol.transport import (Channel, CurveKeys, Endpoints, PeerGone, Poller, ProtocolTimeout, RouterChannel,
                                advertise, new_curve_keypair)


@pytest.fixture
def eps():
    with Endpoints() as e:
        yield e


def _addr(eps, kind, name):
    return eps.ipc(name) if kind == "ipc" else Endpoints.tcp("127.0.0.1")


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_push_pull_hidden_rows_zero_copy(eps, kind):
    with Channel("pull", peer="stage0") as pull, Channel("push", peer="stage1") as push:
        ep = pull.bind(_addr(eps, kind, "s1"))
        assert ep.startswith(f"{kind}://") and not ep.endswith(":*")
        push.connect(ep)
        rows = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
        hdr = m.Hidden(request_id=7, session_id=1, pos=100, n=512, dtype="float32", shape=[512, 1024])
        push.send(hdr, [rows])
        frames = pull.recv_frames(5000)
        msg, (got,) = decode(frames)
        assert msg == hdr and np.array_equal(got, rows)
        # the array is a view of the received zmq frame, not a copy
        assert np.shares_memory(got, np.frombuffer(frames[1].buffer, np.uint8))
        push.send(m.Token(request_id=7, session_id=1, token_id=5, pos=612, done=True, reason="stop"))
        msg, arrays = pull.recv(5000)
        assert isinstance(msg, m.Token) and msg.done and arrays == []


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_router_dealer_request_reply(eps, kind):
    with RouterChannel(peer="ranks") as router, Channel("dealer", peer="coordinator", identity=b"rank-3") as d, \
            Channel("dealer", peer="coordinator", identity=b"rank-3") as thief, Channel("dealer") as anon:
        ep = router.bind(_addr(eps, kind, "ctl"))
        d.connect(ep)
        d.send(m.Heartbeat(rank=3, seq=1))
        ident, msg, _ = router.recv(5000)
        assert ident == b"rank-3" and msg == m.Heartbeat(rank=3, seq=1)
        thief.connect(ep)  # same identity while rank-3 is connected: refused by the ROUTER, never delivered
        anon.connect(ep)
        anon.send(m.Heartbeat(rank=4, seq=1))
        ident4, msg, _ = router.recv(5000)
        assert msg.rank == 4 and ident4 != ident and len(ident4) > 20  # default identities are random
        try:
            thief.send(m.Heartbeat(rank=9, seq=1), timeout_ms=300)
        except ProtocolTimeout:
            pass
        assert not router.poll(300)
        router.send(ident, m.Shutdown(reason="bye"))
        assert d.recv(5000)[0] == m.Shutdown(reason="bye")
        with pytest.raises(PeerGone, match="ghost"):
            router.send(b"ghost", m.Shutdown())


def test_recv_timeout_within_bounds_and_names_peer(eps):
    with Channel("pull", peer="rank 2 (stage [12, 24))") as pull:
        pull.bind(eps.ipc("quiet"))
        t0 = time.monotonic()
        with pytest.raises(ProtocolTimeout) as ei:
            pull.recv(150, what="hidden rows")
        dt = time.monotonic() - t0
        assert 0.14 <= dt < 1.0
        assert isinstance(ei.value, TimeoutError)
        assert "rank 2 (stage [12, 24))" in str(ei.value) and "hidden rows" in str(ei.value) and "150" in str(ei.value)
        with pytest.raises(ValueError):
            pull.recv(None)


def test_send_timeout_when_nobody_listens():
    with Channel("push", peer="next stage", send_timeout_ms=100) as push:
        push.connect("tcp://127.0.0.1:1")  # nothing there: the queue has no pipe to fill
        t0 = time.monotonic()
        with pytest.raises(ProtocolTimeout, match="sending heartbeat to next stage"):
            push.send(m.Heartbeat(rank=0, seq=0))
        assert time.monotonic() - t0 < 1.0


def test_close_is_idempotent_and_poller(eps):
    a, b = Channel("pull", peer="a"), Channel("pull", peer="b")
    ea, eb = a.bind(eps.ipc("a")), b.bind(eps.ipc("b"))
    with Channel("push", peer="x") as pa, Channel("push", peer="y") as pb:
        pa.connect(ea)
        pb.connect(eb)
        poller = Poller(a, b)
        assert poller.poll(50) == []
        with pytest.raises(ProtocolTimeout, match="a, b"):
            poller.wait(50, what="anything")
        pb.send(m.Heartbeat(rank=1, seq=1))
        assert poller.wait(2000) == [b]
        assert b.recv(100)[0].rank == 1
        poller.remove(b)
        assert poller.poll(10) == []
    for ch in (a, b):
        ch.close()
        ch.close()
        assert ch.closed


def test_endpoints_private_dir_and_helpers():
    e = Endpoints()
    try:
        assert os.stat(e.run_dir).st_mode & 0o777 == 0o700
        assert e.ipc("rank0").startswith("ipc://" + e.run_dir)
        with pytest.raises(ValueError, match="OS limit"):
            e.ipc("x" * 200)
        with pytest.raises(ValueError):
            e.ipc("a/b")
    finally:
        e.cleanup()
    assert not os.path.exists(e.run_dir)
    assert Endpoints.tcp("10.0.0.2", 5555) == "tcp://10.0.0.2:5555"
    assert Endpoints.tcp("::1") == "tcp://[::1]:*"
    assert advertise("tcp://0.0.0.0:4321", "hostA") == "tcp://hostA:4321"
    assert advertise("ipc:///x", "hostA") == "ipc:///x"


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_encrypted_link():
    spub, ssec = new_curve_keypair()
    cpub, csec = new_curve_keypair()
    with RouterChannel(curve=CurveKeys(spub, ssec)) as server, \
            Channel("dealer", peer="coord", curve=CurveKeys(cpub, csec, server_public=spub)) as client, \
            Channel("dealer", peer="coord", curve=CurveKeys(cpub, csec, server_public=cpub)) as wrong:
        ep = server.bind(Endpoints.tcp())
        client.connect(ep)
        wrong.connect(ep)  # wrong server key: the CURVE handshake fails, the link never comes up
        client.send(m.Heartbeat(rank=1, seq=1))
        _, msg, _ = server.recv(5000)
        assert msg.rank == 1
        with pytest.raises(ProtocolTimeout, match="sending heartbeat to coord"):
            wrong.send(m.Heartbeat(rank=2, seq=1), timeout_ms=300)
        assert not server.poll(100)


def _serve(router: RouterChannel, stop: threading.Event, counts: dict):
    """A server loop the way the coordinator is written: every request gets one reply, garbage included."""
    while not stop.is_set():
        try:
            ident, msg, _ = router.recv(50)
        except ProtocolTimeout:
            continue
        except m.ProtocolError as e:
            counts["garbage"] += 1
            router.send(e.peer, m.Error(rank=None, request_id=None, code=m.ERR_PROTOCOL, message=str(e)))
            continue
        if isinstance(msg, m.Stats):
            counts["served"] += 1
            router.send(ident, m.StatsReply(rank=0, counters={"n": counts["served"]}, request_id=msg.request_id))
        else:
            router.send(ident, m.Error(rank=None, request_id=None, code=m.ERR_PROTOCOL,
                                       message=f"unexpected {msg.TYPE}"))


def test_server_keeps_serving_after_garbage_frames(eps):
    rng = random.Random(7)
    valid = [encode(msg, arrays) for msg, arrays in _examples()]
    counts = {"garbage": 0, "served": 0}
    stop = threading.Event()
    router = RouterChannel(peer="clients", max_msg_bytes=1 << 20)
    client = Channel("dealer", peer="server")
    client.connect(router.bind(eps.ipc("fuzz")))
    th = threading.Thread(target=_serve, args=(router, stop, counts), daemon=True)
    th.start()
    try:
        for i in range(1200):
            frames = [bytearray(bytes(f)) for f in rng.choice(valid)]
            if i % 3 == 0:
                frames = [bytearray(rng.randbytes(rng.randrange(1, 100)))]
            else:
                j = rng.randrange(len(frames))
                if frames[j]:
                    frames[j] = frames[j][: rng.randrange(len(frames[j]) + 1)]
                    if frames[j]:
                        frames[j][rng.randrange(len(frames[j]))] ^= 0xFF
            client.send_frames(frames)
            reply, _ = client.recv(5000)  # garbage is answered, never a hang
            assert isinstance(reply, (m.Error, m.StatsReply))
            if i % 10 == 0:  # a valid request in between is served normally
                client.send(m.Stats(request_id=i))
                reply, _ = client.recv(5000)
                assert isinstance(reply, m.StatsReply) and reply.request_id == i
        assert counts["garbage"] > 600
    finally:
        stop.set()
        th.join(5)
        client.close()
        router.close()


def _examples():
    rows = np.ones((2, 4), np.float32)
    return [
        (m.Stats(request_id=1), []),
        (m.Heartbeat(rank=1, seq=2), []),
        (m.Register(rank=None, host="h", pid=1, model_fingerprint="f", protocol_version=m.PROTOCOL_VERSION,
                    devices=[m.DeviceInfo(name="cpu", kind="cpu", index=0, total_bytes=1, free_bytes=1)]), []),
        (m.Hidden(request_id=1, session_id=1, pos=0, n=2, dtype="float32", shape=[2, 4]), [rows]),
        (m.ExpertRequest(seq=1, layer=2, n=2), [rows, np.zeros((2, 2), np.int32), np.zeros((2, 2), np.float32)]),
    ]
