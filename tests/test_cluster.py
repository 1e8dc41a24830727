"""Ranks that are not spawned by the launcher: `--listen` + `--expect-ranks` on loopback with ranks
started by hand, wildcard binds advertised at a reachable address, CURVE on every link, helper
requests kept on one host (--no-remote-cross-host), cross-host hand-offs priced by the link, CUDA
IPC only between ranks of one host identity, and the flag refusals."""
import socket
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import zmq

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession
from launcher.cli import main as launch_main
from launcher.launch import assignments, same_host_helpers_only
from launch_helpers import LineProcess
from protocol import Channel, Release
from protocol.auth import write_secret
from protocol.compute_options import ComputeOptions
from protocol.messages import Assign, DeviceInfo, Register
from protocol.transport import CurveKeys, ProtocolTimeout, new_curve_keypair, use_curve
from strata_dist.head.coordinator import Coordinator, RankSlot
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.plan import PlanParams, make_plan
from strata_dist.plan.pricing import HANDOFF_DTYPE_BYTES
from strata_dist.rank.shell import use_cuda_ipc
from test_plan_fixtures import make_devices, make_shape

CHUNK = 16
PROMPT = [int(x) for x in np.random.default_rng(5).integers(0, 320, 40)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster")
    model = write_gguf(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=6), d / "m6.gguf", "f32")
    write_secret(str(d / "token"), "t" * 48)
    return {"model": str(model), "token": str(d / "token"), "dir": d}


@pytest.fixture(scope="module")
def baseline(files):
    return SingleProcessRunner(files["model"], prompt_chunk=CHUNK, max_context=512).generate(PROMPT, 16).tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n ports free now and distinct (held together while picked: free_port called n times may
    hand out one port twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rank_cmd(files, coordinator, host, *extra):
    return [sys.executable, "-m", "strata_dist.rank.main", "--coordinator", coordinator,
            "--model", files["model"], "--vram-budget", "1G", "--token-file", files["token"],
            "--host-id", host, "--connect-timeout", "5", *extra]


def listening_head(files, port: int) -> LineProcess:
    """`strata-launch --serve --listen PORT` waiting for two ranks started by hand (two stages)."""
    return LineProcess(subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "--model", files["model"], "--serve", "--listen",
         str(port), "--expect-ranks", "2", "--token-file", files["token"], "--prefill", str(CHUNK),
         "--max-context", "512", "--layer-split", "3"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1))


def test_listen_on_loopback_with_ranks_started_by_hand(files, baseline):
    port = free_port()
    head = listening_head(files, port)
    ranks = [subprocess.Popen(rank_cmd(files, f"tcp://127.0.0.1:{port}", h),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for h in ("left", "right")]
    try:
        head.wait_ready(60)
        assert head.err_has(f"waiting for 2 rank(s) to register at tcp://127.0.0.1:{port}")
        assert head.err_has("2 ranks on 2 hosts (left, right)")
        out = head.gen(PROMPT, 16)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        head.send("QUIT")
        assert head.proc.wait(timeout=20) == 0
        codes = [r.wait(timeout=20) for r in ranks]
        assert codes == [0, 0], [r.stderr.read() for r in ranks]   # told to shut down
    finally:
        for p in [head.proc] + ranks:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("bind, registered", [
    ([], "tcp://127.0.0.1:"),                                         # auto: toward the coordinator
    (["--data-bind", "tcp://0.0.0.0:*"], "tcp://127.0.0.1:"),         # a wildcard: the route
    (["--data-bind", "tcp://0.0.0.0:*", "--advertise-host", "127.0.0.9"], "tcp://127.0.0.9:"),
])
def test_ranks_register_an_address_peers_can_reach(files, bind, registered):
    secret = open(files["token"]).read().strip()
    coord = Coordinator(secret.encode(), GGUFModel(files["model"]).fingerprint,
                        f"tcp://127.0.0.1:{free_port()}", "tcp://127.0.0.1:*")
    proc = subprocess.Popen(rank_cmd(files, coord.control_endpoint, "h", *bind),
                            stderr=subprocess.PIPE, text=True)
    try:
        (slot,) = coord.wait_for_ranks(1, timeout_s=30)
        for name in ("data", "helper"):
            ep = slot.register.endpoints[name]
            assert ep.startswith(registered) and ep.rsplit(":", 1)[1].isdigit(), ep
        assert slot.register.host == "h"
    finally:
        coord.shutdown()
        proc.wait(timeout=20)


def test_spawned_ranks_with_curve_on_every_link(files, baseline):
    s = ServeSession(files["model"], "--cpu-ranks", "2", "--layer-split", "3", "--curve",
                     "--prefill", str(CHUNK), "--max-context", "512")
    try:
        out = s.gen(PROMPT, 16)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
    finally:
        assert s.close() == 0


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_deployment_curve_applies_to_binds_and_connects():
    keys = CurveKeys(*new_curve_keypair())
    use_curve(keys)
    try:
        server = Channel("pull", peer="stage")
        ep = server.bind("tcp://127.0.0.1:*")
        Channel("push", peer="upstream").connect(ep).send(Release(session_id=1), timeout_ms=3000)
        assert server.recv(3000)[0] == Release(session_id=1)
    finally:
        use_curve(None)
    stranger = Channel("push", peer="stranger").connect(ep)   # no key: the handshake never completes
    with pytest.raises(ProtocolTimeout):
        stranger.send(Release(session_id=2), timeout_ms=500)
    other = Channel("push", peer="other", curve=CurveKeys(*new_curve_keypair(),
                                                          server_public=new_curve_keypair()[0]))
    other.connect(ep)
    with pytest.raises(ProtocolTimeout):
        other.send(Release(session_id=3), timeout_ms=500)
        server.recv(500)
    for ch in (server, stranger, other):
        ch.close()


def _slots(plan_devices):
    out = []
    for d in plan_devices:
        reg = Register(rank=d.index, host=d.host, pid=1000 + d.index,
                       devices=[DeviceInfo(name=d.name, kind=d.kind, index=0,
                                           total_bytes=d.total_bytes, free_bytes=d.free_bytes)],
                       model_fingerprint="f", protocol_version=1,
                       endpoints={"data": f"tcp://{d.host}:{6000 + d.index}",
                                  "helper": f"tcp://{d.host}:{7000 + d.index}"})
        out.append(RankSlot(identity=b"r%d" % d.index, register=reg, rank=d.index))
    return sorted(out, key=lambda s: s.rank)


def test_no_remote_cross_host_keeps_helper_requests_on_each_host():
    # CPU stages: a tier on another host serves only stages without a decode graph
    shape = make_shape(n_layers=8, n_experts=32)
    devs = make_devices([600, 900, 900], bw=[300, 300, 300], hosts=["hostA", "hostA", "hostB"],
                        kinds=["cpu", "cpu", "cuda"])
    plan = make_plan(shape, devs, cells=2048, split=[4], order="as_given",
                     params=PlanParams(stage_cache_slots=10))
    remote = next(h for h in plan.live_helpers if h.device.host == "hostB")
    slots = _slots(devs)
    every = assignments(plan, slots, "tcp://head:1", 2048, True)
    assert any(p.rank == remote.device.index for p in every[0].helpers)
    for a in every:   # endpoints are the registered ones, reachable from the other hosts
        if a.next_endpoint:
            assert a.next_endpoint == slots[1].register.endpoints["data"]
    kept = assignments(plan, slots, "tcp://head:1", 2048, True, cross_host_helpers=False)
    for a in kept[:2]:   # the two stages, on hostA
        assert all(p.host == "hostA" for p in a.helpers) and a.helpers
        assert remote.device.index not in {p.rank for p in a.helpers}
    trimmed = same_host_helpers_only(plan)
    tier = trimmed.helper_on(remote.device)
    assert tier.skipped and "--no-remote-cross-host" in tier.reason
    assert trimmed.expert_slots == plan.expert_slots - len(remote.pairs)


def test_cross_host_hand_offs_are_priced_by_the_link():
    shape = make_shape(n_layers=8, n_experts=4, hidden=4096)
    one = make_devices([2000, 2000], bw=[300, 300], hosts=["h", "h"])
    two = make_devices([2000, 2000], bw=[300, 300], hosts=["h", "g"])
    p = PlanParams(link_ms=0.5, link_gbs=1.0)
    same = make_plan(shape, one, cells=512, split=[4], order="as_given", params=p)
    cross = make_plan(shape, two, cells=512, split=[4], order="as_given", params=p)
    link = p.link_ms + shape.hidden * HANDOFF_DTYPE_BYTES / (p.link_gbs * 1e6)
    # the row crosses the link once; the sampled token's way back crosses it again, without a row
    assert cross.handoff_ms == pytest.approx(same.handoff_ms + link + p.link_ms)
    assert cross.predicted_ms_per_token == pytest.approx(same.predicted_ms_per_token + link + p.link_ms)


def test_cuda_ipc_only_between_gpu_ranks_of_one_host():
    gpu = Assign(rank=0, role="stage", lb=0, le=1, first=True, last=False, device="cuda", plan={},
                 host="a", next_host="a", next_kind="cuda")
    assert use_cuda_ipc(gpu)
    assert not use_cuda_ipc(replace(gpu, next_host="b"))          # another host: frames over TCP
    assert not use_cuda_ipc(replace(gpu, next_kind="cpu"))
    assert not use_cuda_ipc(replace(gpu, host="", next_host=""))  # no identity: never assumed
    # STRATA_IPC=0 at the launcher: the record its Assign carries says so
    assert not use_cuda_ipc(replace(gpu, compute=ComputeOptions(cuda_ipc=False)))
    assert not use_cuda_ipc(replace(gpu, ipc=False))               # --rejoin: frames


@pytest.mark.parametrize("args, says", [
    (["--listen", "5555", "--expect-ranks", "2", "--cpu-ranks", "2"], "--cpu-ranks 2 is for ranks"),
    (["--expect-ranks", "2", "--backend", "ray"], "pick one"),
    (["--listen", "5555"], "add --expect-ranks N"),
    (["--listen", "ipc:///tmp/x", "--expect-ranks", "1"], "over tcp://"),
    (["--listen", "host:99999", "--expect-ranks", "1"], "port in 1-65535"),
    (["--expect-ranks", "1", "--curve"], "--curve-keys DIR"),
    (["--expect-ranks", "1", "--plan-only"], "--plan-only"),
    (["--ray-address", "auto"], "goes with --backend ray"),
    (["--backend", "ray", "--gpus", "0"], "every GPU of the cluster"),
    (["--expect-ranks", "0"], "at least one rank"),
])
def test_cluster_flag_refusals(files, capsys, args, says):
    assert launch_main(["--model", files["model"], *args]) == 2
    assert says in capsys.readouterr().err


def test_listen_without_a_secret_is_refused(files, capsys, monkeypatch):
    monkeypatch.delenv("STRATA_TOKEN", raising=False)
    assert launch_main(["--model", files["model"], "--expect-ranks", "1", "--serve"]) == 2
    assert "no shared secret" in capsys.readouterr().err


def test_reconnecting_rank_waits_for_a_coordinator_that_comes_later(files):
    """A unit's rank starts before its coordinator: it keeps trying, then registers."""
    port = free_port()
    proc = subprocess.Popen(rank_cmd(files, f"tcp://127.0.0.1:{port}", "h", "--reconnect",
                                     "--connect-timeout", "1"),
                            stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2.5)   # at least one handshake attempt has timed out
        assert proc.poll() is None
        secret = open(files["token"]).read().strip()
        coord = Coordinator(secret.encode(), GGUFModel(files["model"]).fingerprint,
                            f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:*")
        try:
            (slot,) = coord.wait_for_ranks(1, timeout_s=30)
            assert slot.register.host == "h"
        finally:
            coord.shutdown()
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=20)
    assert "registering again" in err


def test_a_rank_notices_at_once_when_its_coordinator_dies(files):
    """Killed (no Shutdown): a rank waiting for its assignment learns it from the closed
    connection, not from the 300 s assignment timeout."""
    port = free_port()
    head = LineProcess(subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "--model", files["model"], "--serve", "--listen",
         str(port), "--expect-ranks", "2", "--token-file", files["token"]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1))
    rank = subprocess.Popen(rank_cmd(files, f"tcp://127.0.0.1:{port}", "h"),
                            stderr=subprocess.PIPE, text=True)
    try:
        assert head.err_has("waiting for 2 rank(s)")
        time.sleep(1.5)   # registered by now, waiting for an assignment that will not come
        head.proc.kill()
        t0 = time.monotonic()
        assert rank.wait(timeout=20) == 1
        assert time.monotonic() - t0 < 5
        assert "closed the connection before assigning this rank" in rank.stderr.read()
    finally:
        for p in (head.proc, rank):
            if p.poll() is None:
                p.kill()
