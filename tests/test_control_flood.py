"""What a peer without the secret can cost: a launch listening on TCP (real launcher, real rank process,
real sockets) keeps serving through a flood of unauthenticated Heartbeats and logs the refusals once; strangers'
Hellos cannot crowd out a rank's handshake; a huge frame on any exposed port is refused unread (the receiver's
peak memory stays flat); `strata-dist calibrate --serve` listens on loopback by default and survives garbage."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import LineProcess
from protocol import Channel, encode
from protocol.auth import client_mac, write_secret
from protocol.messages import PROTOCOL_VERSION, Auth, AuthOk, Challenge, Heartbeat, Hello, Register, Release
from strata_dist.head.coordinator import Coordinator
from strata_dist.gguf_file.reader import GGUFModel
from test_cluster import free_ports
from test_sealed_links import listening_ports

CHUNK = 16
PROMPT = [int(x) for x in np.random.default_rng(7).integers(0, 320, 40)]
SECRET = "s" * 48
HUGE = 200 << 20          # a frame far over every cap of this model's plan (a few MiB at most)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("flood")
    model = write_gguf(tiny_qwen3moe(13, hidden=64, top_k=2, n_layers=4), d / "m.gguf", "f32")
    write_secret(str(d / "token"), SECRET)
    return {"model": str(model), "token": str(d / "token")}


def launch(files, port: int, *rank_flags: str) -> tuple[LineProcess, subprocess.Popen]:
    """`strata-launch --serve --listen 127.0.0.1:PORT` and one rank started by hand, serving."""
    head = LineProcess(subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "--model", files["model"], "--serve", "--listen", str(port),
         "--expect-ranks", "1", "--token-file", files["token"], "--prefill", str(CHUNK), "--max-context", "256"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1))
    rank = subprocess.Popen([sys.executable, "-m", "strata_dist.rank.main", "--coordinator",
                             f"tcp://127.0.0.1:{port}", "--model", files["model"], "--vram-budget", "1G",
                             "--token-file", files["token"], "--connect-timeout", "10", *rank_flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    head.wait_ready(60)
    return head, rank


def stop(head: LineProcess, rank: subprocess.Popen) -> None:
    try:
        head.send("QUIT")
        assert head.proc.wait(timeout=20) == 0, head.err()[-2000:]
        assert rank.wait(timeout=20) == 0
    finally:
        for p in (head.proc, rank):
            if p.poll() is None:
                p.kill()


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) << 10
    raise KeyError(key)


def peak_growth(pid: int, action) -> int:
    """How far `pid`'s resident memory peaked above where it was while `action` ran (bytes)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")                      # the peak (VmHWM) starts again from the current size
    before = _status(pid, "VmRSS")
    action()
    return _status(pid, "VmHWM") - before


class Flood(threading.Thread):
    """Unauthenticated Heartbeats as fast as `n` connections take them (their answers never read)."""

    def __init__(self, endpoint: str, n: int = 4):
        super().__init__(daemon=True)
        self.endpoint, self.n, self.sent = endpoint, n, 0
        self.stopped = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context.instance()
        socks = []
        for _ in range(self.n):
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.connect(self.endpoint)
            socks.append(s)
        frames = encode(Heartbeat(rank=0, seq=1, pid=1))
        frames = [bytes(f) for f in frames]
        try:
            while not self.stopped.is_set():
                for s in socks:
                    for _ in range(200):
                        try:
                            s.send_multipart(frames, zmq.NOBLOCK)
                            self.sent += 1
                        except zmq.Again:
                            break
                time.sleep(0)
        finally:
            for s in socks:
                s.close()


def test_a_heartbeat_flood_from_strangers_neither_stalls_serving_nor_floods_the_log(files):
    port = free_ports(1)[0]
    head, rank = launch(files, port)
    try:
        want = head.gen(PROMPT, 16)["tokens"]
        served: list = []
        flood = Flood(f"tcp://127.0.0.1:{port}")
        flood.start()
        try:
            time.sleep(0.5)                 # the control socket is busy before the request comes
            t0 = time.monotonic()
            grew = peak_growth(head.proc.pid, lambda: served.append(head.gen(PROMPT, 16, timeout=10)))
            took = time.monotonic() - t0
        finally:
            flood.stopped.set()
            flood.join(5)
        out = served[0]
        assert out["err"] is None and out["tokens"] == want
        assert took < 5, f"a 16-token request took {took:.1f} s under the flood"
        assert flood.sent > 20_000, flood.sent      # it was a flood
        assert grew < 100 << 20, grew
        time.sleep(0.5)
        refusals = [line for line in head.err().splitlines() if "refused a rank" in line]
        assert 1 <= len(refusals) <= 2, refusals[:5]   # said once for the source, the rest counted
        assert "not authenticated" in refusals[0] and "from 127.0.0.1" in refusals[0]
        assert head.gen(PROMPT, 16)["tokens"] == want
    finally:
        stop(head, rank)


def _strangers_say_hello(endpoint: str, n: int, batch: int = 100) -> None:
    """`n` connections (identities) each send Hello and wait for their Challenge."""
    ctx = zmq.Context.instance()
    hello = [bytes(f) for f in encode(Hello(client_id="stranger", protocol_version=PROTOCOL_VERSION,
                                            nonce=os.urandom(32)))]
    for start in range(0, n, batch):
        socks = []
        for _ in range(min(batch, n - start)):
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.connect(endpoint)
            s.send_multipart(hello)
            socks.append(s)
        for s in socks:
            assert s.poll(5000), "a stranger's Hello was not answered"
            s.recv_multipart()
            s.close()


def test_strangers_hellos_cannot_crowd_out_a_ranks_handshake(files):
    secret = SECRET.encode()
    fingerprint = GGUFModel(files["model"]).fingerprint
    coord = Coordinator(secret, fingerprint, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    result: dict = {}

    def rank_side():
        with Channel("dealer", peer="coordinator") as ch:
            ch.connect(coord.control_endpoint)
            ch.send(Hello(client_id="rank-x", protocol_version=PROTOCOL_VERSION, nonce=os.urandom(32)),
                    timeout_ms=5000)
            challenge, _ = ch.recv(5000)
            assert isinstance(challenge, Challenge)
            _strangers_say_hello(coord.control_endpoint, 1500)   # between this rank's Hello and its Auth
            ch.send(Auth(client_id="rank-x", mac=client_mac(secret, challenge.nonce, "rank-x"),
                         challenge=challenge.nonce), timeout_ms=5000)
            result["auth"], _ = ch.recv(5000)
            if isinstance(result["auth"], AuthOk):
                ch.send(Register(rank=0, host="h", pid=os.getpid(), devices=[], model_fingerprint=fingerprint,
                                 protocol_version=PROTOCOL_VERSION), timeout_ms=5000)
                time.sleep(1)

    t = threading.Thread(target=rank_side, daemon=True)
    t0 = time.monotonic()
    t.start()
    rank = None
    try:
        deadline = time.monotonic() + 20
        while "auth" not in result and t.is_alive() and time.monotonic() < deadline:
            coord.idle(0.05)
        assert isinstance(result.get("auth"), AuthOk), result.get("auth")
        # and a real rank process starting while strangers keep saying Hello gets in as well
        hellos = threading.Thread(target=_strangers_say_hello, args=(coord.control_endpoint, 1500), daemon=True)
        hellos.start()
        rank = subprocess.Popen([sys.executable, "-m", "strata_dist.rank.main", "--coordinator",
                                 coord.control_endpoint, "--model", files["model"], "--vram-budget", "1G",
                                 "--token-file", files["token"], "--host-id", "real", "--connect-timeout", "10",
                                 "--assign-timeout", "5"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        slots = coord.wait_for_ranks(2, timeout_s=20)
        assert sorted(s.register.host for s in slots) == ["h", "real"]
        hellos.join(20)
        assert time.monotonic() - t0 < 20
    finally:
        t.join(5)
        coord.shutdown()
        if rank is not None:
            try:
                rank.wait(timeout=20)
            finally:
                if rank.poll() is None:
                    rank.kill()


def _send_huge(endpoint: str, kind: int, payload: memoryview) -> None:
    """One HUGE-byte frame to `endpoint`; returns once the receiver dropped the connection or 3 s passed."""
    s = zmq.Context.instance().socket(kind)
    s.linger = 0
    monitor = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    s.connect(endpoint)
    s.send(payload, copy=False)
    monitor.poll(3000)
    time.sleep(0.2)                       # whatever the receiver does with it, it has done by now
    s.disable_monitor()
    monitor.close(linger=0)
    s.close()


def test_a_huge_frame_is_refused_unread_on_every_exposed_port(files):
    port, data, helper = free_ports(3)
    head, rank = launch(files, port, "--data-bind", f"tcp://127.0.0.1:{data}",
                        "--helper-bind", f"tcp://127.0.0.1:{helper}")
    payload = memoryview(bytearray(HUGE))
    try:
        want = head.gen(PROMPT, 8)["tokens"]
        (inbox,) = listening_ports(head.proc.pid) - {port}
        targets = [("control", head.proc.pid, port, zmq.DEALER), ("inbox", head.proc.pid, inbox, zmq.PUSH),
                   ("data", rank.pid, data, zmq.PUSH), ("helper", rank.pid, helper, zmq.DEALER)]
        for name, pid, p, kind in targets:
            t0 = time.monotonic()
            grew = peak_growth(pid, lambda: _send_huge(f"tcp://127.0.0.1:{p}", kind, payload))
            assert grew < 100 << 20, f"{name}: a {HUGE >> 20} MiB frame raised the receiver's peak by {grew >> 20} MiB"
            assert time.monotonic() - t0 < 3, name
        assert head.gen(PROMPT, 8)["tokens"] == want         # all still serving
    finally:
        stop(head, rank)


def test_calibrate_serve_listens_on_loopback_by_default_and_survives_garbage():
    port = free_ports(1)[0]
    peer = LineProcess(subprocess.Popen([sys.executable, "-m", "strata_dist.tools.cli", "calibrate", "--serve", str(port),
                                         "--idle", "30"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
    try:
        assert peer.err_has(f"calibration peer on tcp://127.0.0.1:{port}", 20), peer.err()
        assert "only this host can probe it" in peer.err()
        s = zmq.Context.instance().socket(zmq.PAIR)
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send(b"\xc1 not msgpack")
        s.send_multipart([bytes(f) for f in encode(Release(session_id=3))])
        s.send(memoryview(bytearray(64 << 20)), copy=False)      # over a probe's cap: disconnected unread
        time.sleep(0.5)
        s.close(linger=0)
        assert peer.err_has("dropped a message that is not a probe", 10), peer.err()
        time.sleep(0.5)
        assert peer.proc.poll() is None, peer.err()
        done = subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", "calibrate", "--peer",
                               f"127.0.0.1:{port}", "--rounds", "20"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert peer.proc.wait(timeout=20) == 0 and "the prober is done" in peer.err()
        assert peer.err().count("dropped a message") == 2, peer.err()
    finally:
        if peer.proc.poll() is None:
            peer.proc.kill()
    for args, says in ((["--serve", "127.0.0.1:5555", "--bind", "0.0.0.0"], "--bind 0.0.0.0"),
                       (["--bind", "0.0.0.0"], "goes with --serve")):
        done = subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", "calibrate", *args],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_frame_caps_follow_the_plan_and_apply_to_tcp_endpoints(tmp_path):
    from protocol.limits import FrameCaps
    from protocol.transport import Endpoints
    caps = FrameCaps.for_stage(hidden=2048, top_k=8, prompt_chunk=512)
    assert caps.data == caps.helper == 512 * 2048 * 4          # a prompt chunk's float32 rows
    assert FrameCaps.for_stage(64, 2, 0).data == FrameCaps.CONTROL + 9   # one row: a control message's cap
    with pytest.raises(ValueError):
        FrameCaps.for_stage(0, 2, 16)
    with Endpoints(str(tmp_path / "run")) as eps:
        pull = Channel("pull", peer="stage")
        tcp = pull.bind("tcp://127.0.0.1:*", tcp_max_msg_bytes=1 << 20)
        ipc = pull.bind(eps.ipc("data"))
        pull.cap_frames(4 << 20)                                   # the plan's cap, once assigned
        got = []
        for ep, size in ((tcp, 3 << 20), (tcp, 5 << 20), (ipc, 5 << 20)):
            push = zmq.Context.instance().socket(zmq.PUSH)
            push.linger = 0
            push.connect(ep)
            push.send(bytes(size))
            got.append(len(pull.socket.recv()) if pull.poll(1500) else None)
            push.close()
        pull.close()
    assert got == [3 << 20, None, 5 << 20]     # under the cap; over it on TCP: dropped; ipc: local, uncapped
