"""The data plane trusts only admitted peers: on TCP every data message is sealed under the
launch's key (protocol/seal.py). Unit checks of the seal, then a launch whose ranks register over
loopback TCP while a process without the secret pushes well-formed messages of every type at
every data port: the tokens equal the clean run and the drops show in the counters."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import zmq

from launch_helpers import LineProcess
from protocol import Cancel, Channel, Error, ExpertRequest, Hidden, PromptProgress, Token, Tokens
from protocol.codec import encode
from protocol.seal import LinkSeal, link_key
from test_cluster import CHUNK, PROMPT, baseline, files, free_port, rank_cmd  # noqa: F401

SECRET = b"s" * 32


def _pair(nonce="n"):
    rx = Channel("pull")
    ep = rx.bind("tcp://127.0.0.1:*")
    seal = LinkSeal(link_key(SECRET, nonce))
    rx.seal_tcp(seal)
    return rx, ep, seal


def test_a_sealed_link_takes_only_what_proves_itself():
    rx, ep, seal = _pair()
    good = Channel("push").connect(ep).seal_tcp(LinkSeal(link_key(SECRET, "n")))
    other_key = Channel("push").connect(ep).seal_tcp(LinkSeal(link_key(SECRET, "another launch")))
    plain = Channel("push").connect(ep)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.linger = 0
    raw.connect(ep)
    msg = Tokens(request_id=1, session_id=0, pos=0, ids=[1, 2])
    plain.send(msg)                                           # no seal
    other_key.send(msg)                                       # another launch's key
    sealed = good._sealer.seal(encode(msg))
    raw.send_multipart(sealed)                                # a true message ...
    raw.send_multipart(sealed)                                # ... replayed
    tampered = list(sealed)
    tampered[0] = bytes(tampered[0])[:-1] + b"\x00"
    raw.send_multipart(tampered)                              # altered after sealing
    assert rx.recv(2000)[0].request_id == 1
    good.send(Tokens(request_id=2, session_id=0, pos=0, ids=[3]))   # the same sender, next number
    assert rx.recv(2000)[0].request_id == 2
    with pytest.raises(Exception):
        rx.recv(300)
    assert seal.rejected == 4
    for ch in (rx, good, other_key, plain):
        ch.close()
    raw.close()


def test_local_ipc_links_are_not_sealed(tmp_path):
    rx = Channel("pull")
    ep = rx.bind(f"ipc://{tmp_path}/s")
    seal = LinkSeal(link_key(SECRET, "n"))
    assert not rx.seal_tcp(seal).sealed
    tx = Channel("push").connect(ep).seal_tcp(seal)
    assert not tx.sealed
    tx.send(Tokens(request_id=1, session_id=0, pos=0, ids=[1]))
    assert rx.recv(2000)[0].ids == [1]


def _listening_ports(pid: int) -> set[int]:
    """TCP ports a process listens on (from /proc, no tool needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:           # LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _forged(request_id: int) -> list:
    """Well-formed messages of every data-plane type, as a process without the key can make."""
    rows = np.full((1, 64), 7.0, dtype=np.float32)
    return [
        (Token(request_id=request_id, session_id=0, token_id=1, pos=99, done=False), []),
        (Error(rank=0, request_id=request_id, message="forged failure"), []),
        (PromptProgress(request_id=request_id, session_id=0, pos=1, chunk_index=0, chunk_total=1,
                        ms=1.0), []),
        (Tokens(request_id=request_id, session_id=0, pos=0, ids=[5, 6, 7]), []),
        (Hidden(request_id=request_id, session_id=0, pos=0, n=1, dtype="float32",
                shape=[1, 64]), [rows]),
        (Cancel(request_id=request_id), []),
    ]


def test_forged_frames_at_every_tcp_port_change_nothing(files, baseline):
    port = free_port()
    head = LineProcess(subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "--model", files["model"], "--serve", "--listen",
         str(port), "--expect-ranks", "2", "--token-file", files["token"], "--prefill", str(CHUNK),
         "--max-context", "512", "--layer-split", "3"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1))
    data = [free_port(), free_port()]
    helper = [free_port(), free_port()]
    ranks = [subprocess.Popen(rank_cmd(files, f"tcp://127.0.0.1:{port}", h,
                                       "--data-bind", f"tcp://127.0.0.1:{d}",
                                       "--helper-bind", f"tcp://127.0.0.1:{hp}"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for h, d, hp in zip(("left", "right"), data, helper)]
    stop = threading.Event()
    try:
        head.wait_ready(60)
        inbox = sorted(_listening_ports(head.proc.pid) - {port})
        assert inbox, "the head's inbox port was not found"
        targets = [f"tcp://127.0.0.1:{p}" for p in data + inbox]
        ctx = zmq.Context.instance()

        def attack():
            socks = []
            for ep in targets:
                s = ctx.socket(zmq.PUSH)
                s.linger, s.sndtimeo = 0, 100
                s.connect(ep)
                socks.append(s)
            dealers = []
            for hp in helper:
                s = ctx.socket(zmq.DEALER)
                s.linger, s.sndtimeo = 0, 100
                s.connect(f"tcp://127.0.0.1:{hp}")
                dealers.append(s)
            ids = np.zeros((1, 2), dtype=np.int32)
            wts = np.ones((1, 2), dtype=np.float32)
            while not stop.is_set():
                for request_id in range(1, 4):
                    for msg, arrays in _forged(request_id):
                        for s in socks:
                            try:
                                s.send_multipart(encode(msg, arrays))
                            except zmq.Again:
                                pass
                    for s in dealers:
                        try:
                            s.send_multipart(encode(ExpertRequest(seq=1, layer=0, n=1),
                                                    [np.ones((1, 64), np.float32), ids, wts]))
                        except zmq.Again:
                            pass
                stop.wait(0.005)
            for s in socks + dealers:
                s.close()

        t = threading.Thread(target=attack, daemon=True)
        t.start()
        for _ in range(2):                      # two requests while forged frames keep coming
            out = head.gen(PROMPT, 16, timeout=120)
            assert out["err"] is None, out["err"]
            assert out["tokens"] == baseline
        stop.set()
        t.join(10)
        head.send("STATS")
        lines = []
        while True:
            line = head.next_line(30)
            lines.append(line)
            if line == "STATS END":
                break
        rank_drops = [int(kv.split("=")[1]) for line in lines if line.startswith("STATS rank=")
                      for kv in line.split() if kv.startswith("forged_dropped=")]
        head_drops = [int(line.split("=")[1]) for line in lines if line.startswith("STATS head")]
        assert len(rank_drops) == 2 and all(n > 0 for n in rank_drops), lines
        assert head_drops and head_drops[0] > 0, lines
        head.send("QUIT")
        assert head.proc.wait(timeout=20) == 0
    finally:
        stop.set()
        for p in [head.proc] + ranks:
            if p.poll() is None:
                p.kill()
