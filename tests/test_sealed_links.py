"""The data plane trusts only admitted peers: on TCP every data message is sealed under the
launch's key for its own link and its receiver's epoch (protocol/seal.py). Unit checks of the
seal (another link, another direction, another DEALER, another epoch), then launches whose ranks
register over loopback TCP: a process without the secret pushes well-formed messages of every
data-plane type at every data port, and the tokens equal the clean run while the drops show in
the counters; frames the head really sealed for one rank, replayed raw at the other rank, at the
helper tiers and at the head's inbox, are dropped and counted; the same frames replayed into the
rank's replacement after it was killed and rejoined are dropped and counted as stale."""
import os
import subprocess
import threading
import time

import numpy as np
import pytest
import zmq

from forger import CONTROL_TYPES, DATA_PLANE_TYPES, attack, forged
from protocol import Channel, RouterChannel, Tokens
from protocol.codec import decode, encode
from protocol.messages import MESSAGE_TYPES, ExpertReply, ExpertRequest, Sampling
from protocol.seal import LinkSeal, link_key
from test_cluster import (CHUNK, PROMPT, baseline, files, free_ports, listening_head,  # noqa: F401
                          rank_cmd)

SECRET = b"s" * 32


def _seal(nonce="n", epochs=None):
    return LinkSeal(link_key(SECRET, nonce), epochs)


def _pair(nonce="n"):
    rx = Channel("pull")
    ep = rx.bind("tcp://127.0.0.1:*")
    seal = _seal(nonce)
    rx.seal_tcp(seal)
    return rx, ep, seal


def _raw(kind, ep):
    s = zmq.Context.instance().socket(kind)
    s.linger = 0
    s.connect(ep)
    return s


def _gone(ch, ms=300):
    with pytest.raises(Exception):
        ch.recv(ms)


def test_a_sealed_link_takes_only_what_proves_itself():
    rx, ep, seal = _pair()
    good = Channel("push").connect(ep).seal_tcp(_seal())
    other_key = Channel("push").connect(ep).seal_tcp(_seal("another launch"))
    plain = Channel("push").connect(ep)
    raw = _raw(zmq.PUSH, ep)
    msg = Tokens(request_id=1, session_id=0, pos=0, ids=[1, 2])
    plain.send(msg)                                           # no seal
    other_key.send(msg)                                       # another launch's key
    sealed = good._link.seal(encode(msg))
    raw.send_multipart(sealed)                                # a true message ...
    raw.send_multipart(sealed)                                # ... replayed
    tampered = list(sealed)
    tampered[0] = bytes(tampered[0])[:-1] + b"\x00"
    raw.send_multipart(tampered)                              # altered after sealing
    assert rx.recv(2000)[0].request_id == 1
    good.send(Tokens(request_id=2, session_id=0, pos=0, ids=[3]))   # the same sender, next number
    assert rx.recv(2000)[0].request_id == 2
    _gone(rx)
    assert seal.rejected == 4 and seal.stale == 0
    for ch in (rx, good, other_key, plain):
        ch.close()
    raw.close()


def test_a_frame_sealed_for_one_link_opens_on_no_other():
    """One launch key, several links: a frame sealed for one receiver is dropped (and counted) by
    every other one — another stage's data socket, a helper tier, the way back — and a helper's
    reply to one DEALER does not open on another."""
    rx_a, ep_a, seal_a = _pair()
    rx_b, ep_b, seal_b = _pair()
    helper = RouterChannel(peer="stages")
    ep_h = helper.bind("tcp://127.0.0.1:*")
    seal_h = _seal()
    helper.seal_tcp(seal_h)
    tx = Channel("push").connect(ep_a).seal_tcp(_seal())
    sealed = tx._link.seal(encode(Tokens(request_id=7, session_id=0, pos=0, ids=[1])))
    for ep, kind in ((ep_b, zmq.PUSH), (ep_h, zmq.DEALER), (ep_a, zmq.PUSH)):
        s = _raw(kind, ep)
        s.send_multipart(sealed)
        s.close(linger=1000)
    assert rx_a.recv(2000)[0].request_id == 7                # its own link: taken
    _gone(rx_b)
    assert seal_b.rejected == 1 and seal_a.rejected == 0
    _gone(helper)
    assert seal_h.rejected == 1

    # a DEALER pair on one helper: requests in, replies bound to the DEALER they answer
    stage_seal = _seal()
    d1 = Channel("dealer").connect(ep_h).seal_tcp(stage_seal)
    d2 = Channel("dealer").connect(ep_h).seal_tcp(stage_seal)
    request = (ExpertRequest(seq=1, layer=0, n=1),
               [np.ones((1, 8), np.float32), np.zeros((1, 2), np.int32), np.ones((1, 2), np.float32)])
    d1.send(*request)
    d2.send(*request)
    who = {helper.recv(2000)[0] for _ in range(2)}
    id1, id2 = d1.socket.identity, d2.socket.identity
    assert who == {id1, id2}
    reply = helper._link.seal(encode(ExpertReply(seq=1, layer=0, n=1),
                                     [np.ones((1, 2, 8), np.float32)]), peer=id1)
    helper.send_frames([id2] + reply)                         # d1's reply, given to d2
    helper.send_frames([id1] + reply)                         # to d1: taken
    assert d1.recv(2000)[0].seq == 1
    _gone(d2)
    back = _raw(zmq.DEALER, ep_h)                             # the reply, sent toward the helper
    back.send_multipart(reply)
    _gone(helper)
    assert stage_seal.rejected == 1 and seal_h.rejected == 2
    for ch in (rx_a, rx_b, helper, tx, d1, d2):
        ch.close()
    back.close()


def test_a_replaced_receiver_takes_only_its_new_epoch():
    """The receiver at an endpoint was replaced (epoch 1): a frame sealed for the process before
    it is dropped and counted as stale, a forged one as forged, and a sender told the new epoch
    is taken."""
    rx = Channel("pull")
    ep = rx.bind("tcp://127.0.0.1:*")
    seal = _seal(epochs={ep: 1})
    rx.seal_tcp(seal)
    old_keys = _seal()
    before = Channel("push").connect(ep).seal_tcp(old_keys)   # still keys epoch 0
    msg = Tokens(request_id=1, session_id=0, pos=0, ids=[1])
    captured = before._link.seal(encode(msg))
    raw = _raw(zmq.PUSH, ep)
    raw.send_multipart(captured)                              # captured before the replacement
    raw.send_multipart(encode(msg))                           # no seal at all
    _gone(rx)
    assert seal.stale == 1 and seal.rejected == 1
    old_keys.set_epochs({ep: 1})                              # the coordinator's word
    before.send(Tokens(request_id=2, session_id=0, pos=0, ids=[2]))
    assert rx.recv(2000)[0].request_id == 2
    raw.send_multipart(captured)                              # and once more, later
    _gone(rx)
    assert seal.stale == 2 and seal.rejected == 1
    for ch in (rx, before):
        ch.close()
    raw.close()


def test_local_ipc_links_are_not_sealed(tmp_path):
    rx = Channel("pull")
    ep = rx.bind(f"ipc://{tmp_path}/s")
    seal = _seal()
    assert not rx.seal_tcp(seal).sealed
    tx = Channel("push").connect(ep).seal_tcp(seal)
    assert not tx.sealed
    tx.send(Tokens(request_id=1, session_id=0, pos=0, ids=[1]))
    assert rx.recv(2000)[0].ids == [1]


def test_the_forger_sends_every_data_plane_type():
    assert {m.TYPE for m, _ in forged(1)} == DATA_PLANE_TYPES
    assert set(MESSAGE_TYPES) - CONTROL_TYPES == DATA_PLANE_TYPES, \
        "a new message type: add it to tests/forger.py (data plane) or CONTROL_TYPES"
    for msg, arrays in forged(1):                             # each one well-formed
        assert type(decode(encode(msg, arrays))[0]) is type(msg)


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
    port, *ports = free_ports(5)
    head = listening_head(files, port)
    data, helper = ports[:2], ports[2:]
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


# ---- real ranks: frames the head sealed, replayed elsewhere and into a replacement --------------

def _in_process_head(files, port: int):
    """`strata-launch --listen … --expect-ranks 2 --rejoin` in this process (its coordinator is
    what the test records from and asks for counters), started on a thread."""
    from launcher.cli import build_parser, plan_params, prompt_chunk_arg, split_arg
    from launcher.cluster import check_cluster_flags, cluster_config
    from launcher.launch import Launch, LaunchConfig
    args = build_parser().parse_args([
        "--model", files["model"], "--serve", "--listen", f"tcp://127.0.0.1:{port}",
        "--expect-ranks", "2", "--token-file", files["token"], "--prefill", str(CHUNK),
        "--max-context", "512", "--layer-split", "3", "--rejoin", "--register-timeout", "60"])
    check_cluster_flags(args)
    cfg = LaunchConfig(model=args.model, ranks=[], split=split_arg(args.layer_split, 2),
                       max_context=512, prompt_chunk=prompt_chunk_arg(args.prompt_chunk),
                       params=plan_params(args), load_timeout_s=60, rejoin_timeout_s=60,
                       **cluster_config(args))
    launch = Launch(cfg, echo=lambda line: None)
    failure = []

    def start():
        try:
            launch.start()
        except BaseException as e:   # noqa: BLE001 - reported by the test
            failure.append(e)
    t = threading.Thread(target=start, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while launch.coordinator is None and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return launch, t, failure


def _generate(coord, eos) -> list[int]:
    tokens = []
    coord.run_request(0, 0, PROMPT, Sampling(max_new=16, stop_ids=[eos] if eos is not None else []),
                      CHUNK, lambda ev: tokens.append(ev.msg.token_id) if ev.kind == "token"
                      else None, step_timeout_s=30)
    return tokens


def _counters_when(coord, done, timeout_s=20.0) -> dict[int, dict]:
    """Every rank's counters once `done(counters)` holds (a rank answers Stats between data
    messages, so replayed frames may still be queued at the first ask)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = {r: dict(reply.counters) for r, reply in coord.stats().items()}
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def _replay(frames: list[list[bytes]], kind, ep) -> None:
    s = _raw(kind, ep)
    for f in frames:
        s.send_multipart(f)
    s.close(linger=2000)


def test_frames_replayed_on_another_link_or_into_a_replacement_are_dropped(files, baseline):
    """The head's own sealed frames for rank 0's data link (prompt chunks and a Release of the
    serving session), recorded as they left: replayed raw at rank 1's data socket, at both
    helper sockets and at the head's inbox they prove nothing there (dropped, counted, never
    acted on); replayed at rank 0 again they are replays. Then rank 0 is killed and started
    again (--rejoin): the same frames replayed into its replacement are dropped as stale, while
    the head and rank 1 reach it under its new epoch and the tokens equal the clean run."""
    from strata_dist.gguf_file.reader import GGUFModel
    eos = GGUFModel(files["model"]).metadata("tokenizer.ggml.eos_token_id")
    eos = None if eos is None else int(eos)
    port, *ports = free_ports(5)
    data, helper = ports[:2], ports[2:]

    def start_rank(r):
        return subprocess.Popen(rank_cmd(files, f"tcp://127.0.0.1:{port}", f"h{r}", "--rank", str(r),
                                         "--data-bind", f"tcp://127.0.0.1:{data[r]}",
                                         "--helper-bind", f"tcp://127.0.0.1:{helper[r]}"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    launch, starter, failure = _in_process_head(files, port)
    ranks = []
    try:
        ranks = [start_rank(0), start_rank(1)]
        starter.join(90)
        if starter.is_alive() or failure:      # say why a rank did not register
            for r in ranks:
                if r.poll() is not None:
                    failure.append(f"rank exited {r.returncode}: {r.stderr.read()[-2000:]}")
        assert not starter.is_alive() and not failure, failure
        coord = launch.coordinator
        assert [s.data_endpoint for s in coord.ranks] == [f"tcp://127.0.0.1:{d}" for d in data]
        assert _generate(coord, eos) == baseline

        # record what the head seals for rank 0 (the first stage) as it leaves
        sender, recorded = coord._senders["first"], []
        send_frames = sender.send_frames

        def record(frames, **kw):
            recorded.append([bytes(memoryview(f).cast("B")) for f in frames])
            return send_frames(frames, **kw)
        sender.send_frames = record
        assert _generate(coord, eos) == baseline
        coord.release(0)
        sender.send_frames = send_frames
        n = len(recorded)
        assert n == -(-len(PROMPT) // CHUNK) + 1 and all(len(f) == 2 for f in recorded)

        before = _counters_when(coord, lambda c: True)
        head_before = coord.seal.rejected
        data_ep = [f"tcp://127.0.0.1:{d}" for d in data]
        helper_ep = [f"tcp://127.0.0.1:{h}" for h in helper]
        _replay(recorded, zmq.PUSH, data_ep[1])       # another stage's data socket
        _replay(recorded, zmq.DEALER, helper_ep[1])   # helper tiers
        _replay(recorded, zmq.DEALER, helper_ep[0])
        _replay(recorded, zmq.PUSH, data_ep[0])       # its own link again: replays
        _replay(recorded, zmq.PUSH, coord.head_endpoint)   # the head's inbox
        after = _counters_when(coord, lambda c: all(
            c[r]["forged_dropped"] - before[r]["forged_dropped"] >= 2 * n for r in (0, 1)))
        for r in (0, 1):
            assert after[r]["forged_dropped"] - before[r]["forged_dropped"] == 2 * n, after
            for k in ("chunks", "rows", "tokens", "errors", "stale_dropped"):
                assert after[r][k] == before[r][k], (r, k, before, after)   # never acted on
        coord.idle(0.5)
        assert coord.seal.rejected - head_before == n
        assert _generate(coord, eos) == baseline

        # rank 0 dies and is started again: the same frames replayed into the replacement
        ranks[0].kill()
        ranks[0].wait(10)
        ranks[0] = start_rank(0)
        deadline = time.monotonic() + 60
        while coord.rejoins < 1 and time.monotonic() < deadline:
            coord.idle(0.2)
        assert coord.rejoins == 1, "the replacement did not rejoin"
        coord.await_ranks()                           # rank 1 keys its link to it anew
        assert coord.link_epochs == {data_ep[0]: 1, helper_ep[0]: 1}
        _replay(recorded, zmq.PUSH, data_ep[0])
        after = _counters_when(coord, lambda c: c[0]["link_stale_dropped"] >= n)
        assert after[0]["link_stale_dropped"] == n and after[0]["stale_dropped"] == n, after
        assert after[0]["forged_dropped"] == 0 and after[0]["chunks"] == 0, after
        assert _generate(coord, eos) == baseline      # the new epoch both ways
        after = _counters_when(coord, lambda c: True)
        assert after[0]["chunks"] > 0 and after[0]["forged_dropped"] == 0
        assert after[1]["forged_dropped"] == before[1]["forged_dropped"] + 2 * n
    finally:
        launch.close()
        for p in ranks:
            if p.poll() is None:
                p.kill()
        starter.join(5)
