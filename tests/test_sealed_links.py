"""The data plane trusts only admitted peers: on TCP every data message is sealed under the
launch's key (protocol/seal.py). Unit checks of the seal, then a launch whose ranks register over
loopback TCP while a process without the secret pushes well-formed messages of every type at
every data port: the tokens equal the clean run and the drops show in the counters."""
import os
import subprocess
import threading

import pytest
import zmq

from forger import attack
from protocol import Channel, Tokens
from protocol.codec import encode
from protocol.seal import LinkSeal, link_key
from test_cluster import (PROMPT, baseline, files, free_port, listening_head,  # noqa: F401
                          rank_cmd)

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


def assert_drops_counted(stats_lines: list[str], n_ranks: int) -> None:
    """Every rank and the head dropped (and counted) forged messages (STATS lines)."""
    rank_drops = [int(kv.split("=")[1]) for line in stats_lines if line.startswith("STATS rank=")
                  for kv in line.split() if kv.startswith("forged_dropped=")]
    head_drops = [int(line.split("=")[1]) for line in stats_lines if line.startswith("STATS head")]
    assert len(rank_drops) == n_ranks and all(n > 0 for n in rank_drops), stats_lines
    assert head_drops and head_drops[0] > 0, stats_lines


def stats_lines(head) -> list[str]:
    head.send("STATS")
    lines = []
    while not lines or lines[-1] != "STATS END":
        lines.append(head.next_line(30))
    return lines


def listening_ports(pid: int) -> set[int]:
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
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):   # its network namespace
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:           # LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def test_forged_frames_at_every_tcp_port_change_nothing(files, baseline):
    port = free_port()
    head = listening_head(files, port)
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
        inbox = sorted(listening_ports(head.proc.pid) - {port})
        assert inbox, "the head's inbox port was not found"
        targets = [("push", f"tcp://127.0.0.1:{p}") for p in data + inbox]
        targets += [("dealer", f"tcp://127.0.0.1:{p}") for p in helper]
        t = threading.Thread(target=attack, args=(targets, stop.is_set), daemon=True)
        t.start()
        for _ in range(2):                      # two requests while forged frames keep coming
            out = head.gen(PROMPT, 16, timeout=120)
            assert out["err"] is None, out["err"]
            assert out["tokens"] == baseline
        stop.set()
        t.join(10)
        lines = stats_lines(head)
        assert_drops_counted(lines, n_ranks=2)
        head.send("QUIT")
        assert head.proc.wait(timeout=20) == 0
    finally:
        stop.set()
        for p in [head.proc] + ranks:
            if p.poll() is None:
                p.kill()
