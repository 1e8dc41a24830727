"""Planner constants measured on this machine (`strata-dist calibrate`).

The planner prices a stage boundary on one host (`handoff_ms`) and a boundary between hosts
(`handoff_ms + link_ms` + a hidden row / `link_gbs`) by constants (plan/params.py) whose defaults
were measured on one rig. This measures them here, with the product's own code paths:

- the hand-off: one decode row passed between two processes and back through
  `strata_dist.rank.handoff` (CUDA IPC between two GPU processes, which is what stages on one host
  use; frames over ZeroMQ on CPUs). On a GPU, two processes on the one card take turns on it,
  which ranks on two cards do not: that figure is `shared_card_handoff_ms` (a GPU listed twice),
  and `handoff_ms` is measured between this card and a second one, where there is one;
- a link to another host: `LinkProbe` messages over ZeroMQ TCP to `strata-dist calibrate --serve`
  running there: the median round trip of a small probe gives the latency, a large probe's the
  bandwidth;
- on a GPU, what a decode step's kernels get reading expert blobs in place from each kind of
  tier (`tier_read_gbs`): pinned, device-mapped host memory (`host_gbs`, the misses) and, with a
  second card that has peer access, that card's memory (`peer_gbs`, a helper tier there).

The figures go to a JSON file (`save_calibration`) that `strata-launch --calibration FILE` plans
with; a STRATA_SPLIT_* variable still overrides the file, field by field. Nothing here is a
planner input by itself: the planner stays pure and takes a PlanParams."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from dataclasses import replace

import numpy as np

from protocol.bounded_read import MIB, FileTooLarge, read_capped

from ..plan.params import PlanParams

FORMAT = 1
# the fields a file may set
CALIBRATED = ("handoff_ms", "shared_card_handoff_ms", "link_ms", "link_gbs", "host_gbs", "peer_gbs")
CALIBRATION_FILE_MAX = 1 * MIB  # a calibration is a few numbers; past this, not one (refused unread)
HIDDEN = 2048                  # the width of the row the hand-off passes (a Qwen3-30B-A3B row)
PAYLOAD_MIB = 16               # a large probe of the link
GARBAGE_SAID = 5               # --serve says this many messages that are not probes, then counts


class CalibrationError(ValueError):
    """A calibration that could not be measured, or a file that cannot be used (names which)."""


# ---- the hand-off between two processes of this host --------------------------------------------

def _on_message(msg, arrays, send, recv):
    """One message of a hand-off link: the IPC handle and slot acknowledgements go to the
    receiver and the sender; a Hidden message gives its rows (read by a kernel, as a stage's
    would be), else None."""
    from protocol import Hidden, IpcHandle, SlotFree
    if isinstance(msg, IpcHandle):
        recv.on_handle(msg)
    elif isinstance(msg, SlotFree) or getattr(msg, "code", "") == "ipc":
        send.on_reply(msg)
    elif isinstance(msg, Hidden):
        return recv.rows(msg, arrays) * 1.0
    return None


def _handoff_peer(device: str, ipc: bool, a: str, b: str, back: str, ready) -> None:
    """Receive rows on a, send them on through b (and acknowledge IPC slots on back)."""
    from protocol import Channel, Poller, Tokens
    from ..backends import get_backend
    from ..rank.handoff import HandoffReceiver, HandoffSender
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
    idle_until = time.monotonic() + 60
    while time.monotonic() < idle_until:
        for _ in poller.poll(1000):
            msg, arrays = rx.recv(timeout_ms=1000)
            idle_until = time.monotonic() + 60
            if isinstance(msg, Tokens):
                return
            rows = _on_message(msg, arrays, send, recv)
            if rows is not None:
                send.send(rows, request_id=1, session_id=0, pos=msg.pos)
                recv.release()


def handoff_hop_us(device: str, ipc: bool, peer_device: str | None = None, rounds: int = 2000,
                   timeout_s: float = 60.0) -> tuple[float, str]:
    """Median microseconds of one hop of a decode row [1, HIDDEN] between this process and a peer
    process (round trips / 2, the first fifth left out as warm-up), and the path it took ("ipc"
    or "frames"). `peer_device`: the peer's device when not `device` (two cards)."""
    from protocol import Channel, Poller, Tokens
    from ..backends import get_backend
    from ..rank.handoff import HandoffReceiver, HandoffSender
    with tempfile.TemporaryDirectory() as d:
        a, b, back_b = (f"ipc://{d}/{n}" for n in ("a", "b", "bb"))
        spawn = mp.get_context("spawn")
        ready = spawn.Event()
        p = spawn.Process(target=_handoff_peer,
                          args=(peer_device or device, ipc, a, b, back_b, ready))
        p.start()
        try:
            if not ready.wait(timeout_s):
                raise CalibrationError(f"the hand-off peer process did not start within "
                                       f"{timeout_s:.0f} s")
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
            rows = be.asarray(np.ones((1, HIDDEN), dtype=np.float32))
            poller = Poller(rx, acks)
            times: list[float] = []
            deadline = time.monotonic() + timeout_s
            while len(times) < rounds:
                t0 = time.perf_counter()
                send.send(rows, request_id=1, session_id=0, pos=len(times))
                got = False
                while not got:
                    if time.monotonic() > deadline:
                        raise CalibrationError(f"the hand-off peer answered {len(times)} of "
                                               f"{rounds} rows within {timeout_s:.0f} s")
                    for ch in poller.wait(1000):
                        back = _on_message(*ch.recv(timeout_ms=1000), send, recv)
                        if back is not None:
                            rows = back
                            recv.release()
                            got = True
                times.append(time.perf_counter() - t0)
            tx.send(Tokens(request_id=0, session_id=0, pos=0, ids=[0]))
            path = "ipc" if send.sent_ipc else "frames"
            return statistics.median(times[len(times) // 5:]) / 2 * 1e6, path
        finally:
            p.join(10)
            if p.is_alive():
                p.kill()


# ---- a link to another host ---------------------------------------------------------------------

def serve_link(bind: str, idle_s: float = 120.0, say=print) -> int:
    """The peer of `probe_link` on another host: answer LinkProbe messages on `bind`
    (tcp://HOST:PORT) until told to stop or `idle_s` pass without one. Returns 0. Anyone who can
    reach the port can talk to it (it holds no secret and guards nothing): a frame over a probe's
    size disconnects its sender unread, anything that is not a probe is dropped (the first few
    said, the rest counted), and neither stops the peer."""
    from protocol import Channel, LinkProbe, ProtocolError, ProtocolTimeout
    from protocol.limits import FrameCaps
    from protocol.transport import is_loopback_endpoint
    ch = Channel("pair", peer="calibration prober",
                 max_msg_bytes=FrameCaps.probe(PAYLOAD_MIB << 20))
    endpoint = ch.bind(bind)
    reach = ("only this host can probe it: pass --bind ADDRESS (this host's address on the link "
             "to measure) for a prober on another host" if is_loopback_endpoint(endpoint) else
             "any host that reaches this address can probe it")
    say(f"calibration peer on {endpoint} ({reach}): waiting for `strata-dist calibrate --peer` "
        f"(stops after {idle_s:.0f} s without a probe)")
    dropped = 0
    try:
        while True:
            try:
                msg, _ = ch.recv(timeout_ms=int(idle_s * 1000), what="a probe")
            except ProtocolTimeout:
                say(f"no probe for {idle_s:.0f} s: stopping"
                    + (f" ({dropped} message(s) that were not probes dropped)" if dropped else ""))
                return 0
            except ProtocolError as e:
                msg = e
            if not isinstance(msg, LinkProbe):
                dropped += 1
                if dropped <= GARBAGE_SAID:
                    what = msg if isinstance(msg, ProtocolError) else f"a {msg.TYPE} message"
                    say(f"dropped a message that is not a probe: {what}"
                        + (" (further ones are counted)" if dropped == GARBAGE_SAID else ""))
                continue
            if msg.seq < 0:
                say("the prober is done: stopping")
                return 0
            try:
                ch.send(LinkProbe(seq=msg.seq), timeout_ms=10_000)
            except ProtocolTimeout:
                say("a probe's answer found no prober to take it: dropped")
    finally:
        ch.close()


def probe_link(endpoint: str, rounds: int = 200, payload_mib: int = PAYLOAD_MIB,
               timeout_s: float = 10.0) -> dict:
    """The link to the `serve_link` peer at `endpoint`: {"link_ms": one-way latency of a small
    probe (half its median round trip), "link_gbs": a large probe's bytes over its one-way time,
    "rtt_ms", "payload_ms", "payload_bytes"}. CalibrationError when the peer does not answer."""
    from protocol import Channel, LinkProbe, ProtocolTimeout
    ch = Channel("pair", peer=f"calibration peer {endpoint}").connect(endpoint)
    payload = np.random.default_rng(0).integers(0, 256, payload_mib << 20, dtype=np.uint8)
    seq = 0

    def round_trip(arrays) -> float:
        nonlocal seq
        t0 = time.perf_counter()
        ch.send(LinkProbe(seq=seq), arrays, timeout_ms=int(timeout_s * 1000))
        while True:
            msg, _ = ch.recv(timeout_ms=int(timeout_s * 1000), what="the peer's answer")
            if isinstance(msg, LinkProbe) and msg.seq == seq:
                seq += 1
                return time.perf_counter() - t0

    try:
        try:
            small = [round_trip(()) for _ in range(rounds)]
            large = [round_trip((payload,)) for _ in range(max(3, rounds // 20))]
        except ProtocolTimeout:
            raise CalibrationError(f"no answer from {endpoint} within {timeout_s:.0f} s: is "
                                   f"`strata-dist calibrate --serve` running there?") from None
        try:
            ch.send(LinkProbe(seq=-1), timeout_ms=1000)
        except ProtocolTimeout:
            pass
    finally:
        ch.close(linger_ms=1000)          # the stop probe leaves before the socket goes
    rtt = statistics.median(small[len(small) // 5:])
    big = statistics.median(large[len(large) // 3:])
    one_way = max(big - rtt / 2, 1e-9)      # the large probe out, the small answer back
    return {"link_ms": rtt / 2 * 1e3, "link_gbs": payload.nbytes / one_way / 1e9,
            "rtt_ms": rtt * 1e3, "payload_ms": big * 1e3, "payload_bytes": int(payload.nbytes)}


# ---- expert blobs read in place, by tier -----------------------------------------------------------

BLOB_BYTES = 3 * 884_736  # a Qwen3-30B-A3B Q4_K expert: gate, up and down, 884,736 bytes each
BLOBS_A_READ = 2         # about a layer's host misses in a decode step of a half-cached stage
_READ_KERNEL = r"""
extern "C" __global__ void read_blobs(const unsigned long long* __restrict__ blobs, int n_blobs,
                                      unsigned long long n16, unsigned int* sink) {
    // each block reads its share of every blob in 16-byte loads, as the expert kernels stream a
    // blob's rows; the xor keeps the loads from being optimised away
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (int b = 0; b < n_blobs; ++b) {
        const uint4* src = reinterpret_cast<const uint4*>(blobs[b]);
        for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n16;
             i += (unsigned long long)gridDim.x * blockDim.x) {
            uint4 v = src[i];
            acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
        }
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) sink[0] = 1u;
}
"""


def tier_read_gbs(device: str, rounds: int = 50) -> dict[str, float]:
    """GB/s a kernel on `device` (cuda:N) gets reading BLOBS_A_READ blobs of BLOB_BYTES in place
    from each tier it can: `device` (this card's memory: the reference), `host` (pinned,
    device-mapped host memory, as backends/host_mapped.py keeps the misses) and `peer` (another
    card's memory through peer access, as a helper tier there is read; only where one has it).
    The median of `rounds` launches, timed by events; a launch's fixed cost is in the figure, as
    it is in a decode step's."""
    import cupy as cp
    from ..backends.host_mapped import HOST_ALLOC_MAPPED, HOST_ALLOC_PORTABLE
    index = int(device.split(":")[1]) if ":" in device else 0
    nbytes = BLOBS_A_READ * BLOB_BYTES
    out: dict[str, float] = {}
    with cp.cuda.Device(index):
        kernel = cp.RawKernel(_READ_KERNEL, "read_blobs")
        sink = cp.zeros(1, dtype=cp.uint32)
        sms = cp.cuda.Device(index).attributes["MultiProcessorCount"]

        def timed(base: int) -> float:
            table = cp.asarray(np.array([base + i * BLOB_BYTES for i in range(BLOBS_A_READ)],
                                        dtype=np.uint64))
            args = (table, np.int32(BLOBS_A_READ), np.uint64(BLOB_BYTES // 16), sink)
            start, stop, ms = cp.cuda.Event(), cp.cuda.Event(), []
            for r in range(rounds + 5):
                start.record()
                kernel((sms * 4,), (256,), args)
                stop.record()
                stop.synchronize()
                if r >= 5:   # the first launches load the module and warm the TLBs
                    ms.append(cp.cuda.get_elapsed_time(start, stop))
            return nbytes / (statistics.median(ms) / 1e3) / 1e9

        local = cp.zeros(nbytes, dtype=cp.uint8)
        out["device"] = timed(int(local.data.ptr))
        host = int(cp.cuda.runtime.hostAlloc(nbytes, HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED))
        try:
            out["host"] = timed(int(cp.cuda.runtime.pointerGetAttributes(host).devicePointer))
        finally:
            cp.cuda.runtime.freeHost(host)
        for other in range(cp.cuda.runtime.getDeviceCount()):
            if other == index or not cp.cuda.runtime.deviceCanAccessPeer(index, other):
                continue
            with cp.cuda.Device(other):
                remote = cp.zeros(nbytes, dtype=cp.uint8)
            try:
                cp.cuda.runtime.deviceEnablePeerAccess(other)
            except cp.cuda.runtime.CUDARuntimeError:
                pass     # already enabled in this process
            out["peer"] = timed(int(remote.data.ptr))
            out["peer_device"] = other
            break
    return out


def _another_card(device: str) -> str | None:
    """A second visible GPU for the hand-off between two cards (None with one card)."""
    import cupy as cp
    index = int(device.split(":")[1]) if ":" in device else 0
    others = [i for i in range(cp.cuda.runtime.getDeviceCount()) if i != index]
    return f"cuda:{others[0]}" if others else None


# ---- the file ------------------------------------------------------------------------------------

def calibrate(device: str, peer: str | None = None, rounds: int = 2000) -> dict:
    """Measure what this machine can: the hand-off on `device`, the link to `peer` if given.
    Returns the file's content (see save_calibration)."""
    ipc = device.startswith("cuda")
    us, path = handoff_hop_us(device, ipc, rounds=rounds)
    measured = {"handoff_path": path, "handoff_rounds": rounds}
    if not ipc:
        params = {"handoff_ms": round(us / 1e3, 4)}
        measured["handoff_us"] = round(us, 1)
    else:
        params = {"shared_card_handoff_ms": round(us / 1e3, 4)}
        measured["shared_card_handoff_us"] = round(us, 1)
        other = _another_card(device)
        if other is not None:
            us, _ = handoff_hop_us(device, ipc, peer_device=other, rounds=rounds)
            params["handoff_ms"] = round(us / 1e3, 4)
            measured.update(handoff_us=round(us, 1), handoff_peer_device=other)
        reads = tier_read_gbs(device)
        params["host_gbs"] = round(reads["host"], 2)
        measured.update(blob_bytes=BLOB_BYTES, blobs_a_read=BLOBS_A_READ,
                        device_read_gbs=round(reads["device"], 1))
        if "peer" in reads:
            params["peer_gbs"] = round(reads["peer"], 2)
            measured["peer_device"] = reads["peer_device"]
    if peer:
        link = probe_link(peer, rounds=max(20, rounds // 10))
        params.update(link_ms=round(link["link_ms"], 4), link_gbs=round(link["link_gbs"], 3))
        measured.update(peer=peer, **{k: link[k] for k in ("rtt_ms", "payload_ms",
                                                            "payload_bytes")})
    return {"strata_calibration": FORMAT, "params": params,
            "measured": dict(measured, host=socket.gethostname(), device=device,
                             date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))}


def save_calibration(content: dict, path: str) -> None:
    load_params(content, path)            # what is written is what a launch can read back
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(content, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def load_params(content, path: str) -> dict[str, float]:
    """The PlanParams fields of a calibration file's content; CalibrationError naming the file
    and what is wrong with it."""
    if not isinstance(content, dict) or content.get("strata_calibration") != FORMAT:
        raise CalibrationError(f"calibration {path}: not a strata-dist calibration file (format "
                               f"{FORMAT}; write one with `strata-dist calibrate --out`)")
    params = content.get("params")
    if not isinstance(params, dict):
        raise CalibrationError(f"calibration {path}: 'params' must be an object")
    for name, value in params.items():
        if name not in CALIBRATED:
            raise CalibrationError(f"calibration {path}: unknown field {name!r} (a calibration "
                                   f"sets {', '.join(CALIBRATED)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalibrationError(f"calibration {path}: {name} must be a number, got {value!r}")
        try:
            replace(PlanParams(), **{name: float(value)})
        except ValueError as e:
            raise CalibrationError(f"calibration {path}: {e}") from None
    return {k: float(v) for k, v in params.items()}


def load_calibration(path: str) -> dict[str, float]:
    """The PlanParams fields a calibration file sets (load_params), read from `path`."""
    try:
        content = json.loads(read_capped(path, CALIBRATION_FILE_MAX, "--calibration"))
    except FileTooLarge as e:
        raise CalibrationError(str(e)) from None
    except OSError as e:
        raise CalibrationError(f"calibration {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CalibrationError(f"calibration {path}: not JSON ({e})") from None
    except RecursionError:
        raise CalibrationError(f"calibration {path}: not a calibration (nested too deep)") from None
    return load_params(content, path)
