"""The hand-off itself, without a model: one decode row [1, 2048] float32 passed between two
processes and back through strata_dist.handoff (the rank's own code path), as frames over ZeroMQ
and, on a GPU, through CUDA IPC. Prints the median microseconds per hop. With --devices A,B the
two processes sit on two cards (cuda:A and cuda:B), as two stages of a pipeline do.

    python benchmarks/bench_transport.py --device cuda:0
    python benchmarks/bench_transport.py --devices 0,1 --json
    python benchmarks/bench_transport.py --device cpu
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time

HIDDEN = 2048
N = 2000


def _peer(device: str, ipc: bool, a: str, b: str, back: str, ready) -> None:
    """Receive rows on a, send them on through b (and acknowledge IPC slots on back)."""
    from protocol import Channel, Hidden, IpcHandle, Poller, SlotFree, Tokens
    from strata_dist.backends import get_backend
    from strata_dist.handoff import HandoffReceiver, HandoffSender
    be = get_backend(device)
    rx = Channel("pull")
    rx.bind(a)
    up = Channel("push").connect(back)
    tx = Channel("push").connect(b)
    recv = HandoffReceiver(be, up, 10_000)
    send = HandoffSender(tx, be, "h", ipc, max_rows=1, hidden=HIDDEN, timeout_ms=10_000)
    ready.set()
    send.offer()
    poller = Poller(rx)
    while True:
        for _ in poller.poll(1000):
            msg, arrays = rx.recv(timeout_ms=1000)
            if isinstance(msg, Tokens):
                return
            if isinstance(msg, IpcHandle):
                recv.on_handle(msg)
            elif isinstance(msg, SlotFree) or getattr(msg, "code", "") == "ipc":
                send.on_reply(msg)
            elif isinstance(msg, Hidden):
                rows = recv.rows(msg, arrays) * 1.0      # a kernel reads the rows
                send.send(rows, request_id=1, session_id=0, pos=msg.pos)
                recv.release()


def run(device: str, ipc: bool, peer_device: str | None = None) -> tuple[float, str]:
    from protocol import Channel, Hidden, IpcHandle, Poller, SlotFree, Tokens
    from strata_dist.backends import get_backend
    from strata_dist.handoff import HandoffReceiver, HandoffSender
    with tempfile.TemporaryDirectory() as d:
        a, b, back_a, back_b = (f"ipc://{d}/{n}" for n in ("a", "b", "ba", "bb"))
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        p = ctx.Process(target=_peer, args=(peer_device or device, ipc, a, b, back_b, ready))
        p.start()
        ready.wait(60)
        be = get_backend(device)
        rx = Channel("pull")
        rx.bind(b)
        acks = Channel("pull")
        acks.bind(back_b)
        tx = Channel("push").connect(a)
        up = Channel("push").connect(a)     # our acknowledgements of the peer's slots
        send = HandoffSender(tx, be, "h", ipc, max_rows=1, hidden=HIDDEN, timeout_ms=10_000)
        recv = HandoffReceiver(be, up, 10_000)
        send.offer()
        rows = be.asarray(__import__("numpy").ones((1, HIDDEN), dtype="float32"))
        poller = Poller(rx, acks)
        times = []
        deadline = time.monotonic() + 60
        i = 0
        while len(times) < N and time.monotonic() < deadline:
            t0 = time.perf_counter()
            send.send(rows, request_id=1, session_id=0, pos=i)
            got = False
            while not got:
                for ch in poller.wait(10_000):
                    msg, arrays = ch.recv(timeout_ms=1000)
                    if isinstance(msg, IpcHandle):
                        recv.on_handle(msg)
                    elif isinstance(msg, SlotFree) or getattr(msg, "code", "") == "ipc":
                        send.on_reply(msg)
                    elif isinstance(msg, Hidden):
                        rows = recv.rows(msg, arrays) * 1.0
                        recv.release()
                        got = True
            times.append(time.perf_counter() - t0)
            i += 1
        tx.send(Tokens(request_id=0, session_id=0, pos=0, ids=[0]))
        p.join(30)
        path = "ipc" if send.sent_ipc else "frames"
        steady = times[len(times) // 5:]
        return statistics.median(steady) / 2 * 1e6, path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--devices", default="", help="A,B: the two processes on cuda:A and cuda:B")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = ap.parse_args()
    device, peer = args.device, None
    if args.devices:
        device, peer = (f"cuda:{d}" for d in args.devices.split(","))
    modes = [False] + ([True] if device.startswith("cuda") else [])
    figures = {}
    for ipc in modes:
        us, path = run(device, ipc, peer)
        figures[path] = us
        print(f"device={device} peer={peer or device} path={path}: {us:.0f} us per hop "
              f"(median of {N} round trips / 2)", flush=True)
    if args.json:
        # a decode row goes by IPC between stages of one host when it can, else in frames
        print(json.dumps({"decode_row_median_us": figures.get("ipc", figures.get("frames")),
                          **{f"{k}_us": v for k, v in figures.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
