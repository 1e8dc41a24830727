"""Multi-node over TCP, with Linux network namespaces as separate hosts (tests/netns_helpers.py).

A head (`strata-launch --listen … --expect-ranks 2`) in one namespace, two ranks started by hand
(as a systemd unit would start them) in two others: the greedy tokens equal the single process,
rows travel in frames (no CUDA IPC across hosts), and the fault drills end in bounded time: a
killed rank and a pulled cable fail the request with ERR within the heartbeat timeout, and a
restarted head is found again by the surviving ranks (--reconnect). Refusals over TCP: a wrong
secret, another model (both fingerprints named), another protocol version (both named). With
CURVE the same run works and a rank without the deployment key cannot register. A machine
without the secret cannot touch the data plane (sealed links)."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import LineProcess
from netns_helpers import NetLab, python, unavailable
from protocol.auth import write_secret
from protocol.transport import write_curve_keys
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.gguf_file.reader import GGUFModel

CHUNK = 16
PROMPT = [int(x) for x in np.random.default_rng(5).integers(0, 320, 40)]
PORT = 5555
HEARTBEAT_S = 3.0

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@pytest.fixture(scope="module")
def lab():
    lab = NetLab(["head", "a", "b", "evil"])   # evil: a machine on the LAN without the secret
    yield lab
    lab.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("multinode")
    model = write_gguf(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=6), d / "m6.gguf", "f32")
    other = write_gguf(tiny_qwen3moe(22, n_layers=3), d / "other.gguf")
    write_secret(str(d / "token"), "s" * 48)
    write_secret(str(d / "wrong"), "w" * 48)
    write_curve_keys(str(d / "curve"))
    write_curve_keys(str(d / "other-curve"))
    return {"model": str(model), "other": str(other), "token": str(d / "token"),
            "wrong": str(d / "wrong"), "curve": str(d / "curve"), "other_curve": str(d / "other-curve"),
            "dir": d}


@pytest.fixture(scope="module")
def baseline(files):
    return SingleProcessRunner(files["model"], prompt_chunk=CHUNK, max_context=512).generate(PROMPT, 24).tokens


def head(lab, files, *extra, expect=2) -> LineProcess:
    argv = [sys.executable, "-m", "launcher.cli", "--model", files["model"], "--serve",
            "--listen", f"tcp://{lab.ip('head')}:{PORT}", "--expect-ranks", str(expect),
            "--token-file", files["token"], "--heartbeat-timeout", str(HEARTBEAT_S),
            "--register-timeout", "60", "--prefill", str(CHUNK), "--max-context", "512", *extra]
    if expect == 2:
        argv += ["--layer-split", "3"]
    return LineProcess(lab.popen("head", argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, bufsize=1))


def rank(lab, files, host, *extra, model=None, token=None, prefix=()) -> subprocess.Popen:
    log = open(files["dir"] / f"rank-{host}-{time.monotonic_ns()}.log", "w+")
    argv = [*(prefix or [sys.executable, "-m", "strata_dist.rank.main"]),
            "--coordinator", f"tcp://{lab.ip('head')}:{PORT}", "--model", model or files["model"],
            "--vram-budget", "1G", "--token-file", token or files["token"], "--host-id", host,
            "--connect-timeout", "3", "--coordinator-timeout", "4", *extra]
    p = lab.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    p.log = log
    return p


def log_of(p) -> str:
    p.log.seek(0)
    return p.log.read()


def finish(p, timeout=30.0) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise


def stop(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def fault_mid_generation(h, fault):
    """A long generation; once its tokens flow, `fault()`; then the first line that is not a
    token. Returns (the lines before the first token, that line, seconds from the fault to it,
    what `fault` returned)."""
    h.send(f"GEN 400 {' '.join(map(str, PROMPT))}")
    before = []
    while not (line := h.next_line(30)).startswith("T"):
        before.append(line)
    t0 = time.monotonic()
    result = fault()
    line = h.next_line(30)
    while line.startswith("T"):
        line = h.next_line(30)
    return before, line, time.monotonic() - t0, result


def test_two_hosts_over_tcp_then_a_kill_and_a_cut_cable(lab, files, baseline):
    h = head(lab, files)
    a = rank(lab, files, "a", "--reconnect")
    b = rank(lab, files, "b", "--reconnect")
    try:
        info = h.wait_ready(60)
        assert h.err_has("2 ranks on 2 hosts (a, b)")
        assert [f for f in info if "rank=" in f][1].split()[4:6] == ["lb=3", "le=6"]
        out = h.gen(PROMPT, 24)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        stats = h.stats()
        assert stats[0]["handoff_ipc"] == "0" and int(stats[0]["handoff_frames"]) > 0

        # a rank killed mid-generation: ERR within the heartbeat timeout, the head stops
        before, line, took, _ = fault_mid_generation(h, b.kill)
        assert before and before[0].startswith("RESUME"), before
        assert line.startswith("ERR") and "rank 1" in line, line
        assert took < HEARTBEAT_S + 5
        assert finish(h.proc) == 1

        # the unit restarts the head and the killed rank; the survivor registers again by itself
        h = head(lab, files)
        b = rank(lab, files, "b", "--reconnect")
        h.wait_ready(60)
        assert "registering again" in log_of(a)
        assert h.gen(PROMPT, 24)["tokens"] == baseline

        # b's cable is pulled mid-generation: ERR within the heartbeat timeout
        _, line, took, _ = fault_mid_generation(h, lambda: lab.link("b", up=False))
        assert line.startswith("ERR") and "rank 1" in line, line
        assert took < HEARTBEAT_S + 5
        assert finish(h.proc) == 1
        lab.link("b", up=True)
        # the cable is back and the head restarted: both ranks find it again
        h = head(lab, files)
        h.wait_ready(60)
        assert h.gen(PROMPT, 24)["tokens"] == baseline
        h.send("QUIT")
        assert finish(h.proc) == 0
    finally:
        lab.link("b", up=True)
        stop(h.proc, a, b)


def test_a_rank_started_again_by_hand_rejoins_and_the_other_keeps_running(lab, files, baseline):
    """--rejoin over TCP: a killed rank fails the request in flight within the heartbeat timeout
    and the head serves on. A replacement claiming its number from another host is refused,
    naming both hosts; the rank started again on its host (as its unit would, on a fresh port)
    takes over its endpoints while the other rank keeps its process, and the next request has
    the baseline tokens."""
    h = head(lab, files, "--rejoin")
    a = rank(lab, files, "a", "--rank", "0")
    # b's data port is fixed (--data-bind), its helper port is not: the replacement binds the same
    # data endpoint by itself and must take over the helper endpoint
    fixed = ("--data-bind", f"tcp://{lab.ip('b')}:{PORT + 17}", "--log-level", "INFO")
    b = rank(lab, files, "b", "--rank", "1", *fixed)
    wrong = None
    try:
        h.wait_ready(60)
        assert h.gen(PROMPT, 24)["tokens"] == baseline
        _, line, took, _ = fault_mid_generation(h, b.kill)
        assert line.startswith("ERR") and "rank 1" in line and "replacement" in line, line
        assert took < HEARTBEAT_S + 5
        assert h.proc.poll() is None                     # the head serves on
        wrong = rank(lab, files, "a", "--rank", "1")
        assert finish(wrong) != 0
        assert h.err_has("must run on host b", timeout=10) and h.err_has("not a", timeout=10)
        b = rank(lab, files, "b", "--rank", "1", *fixed)
        assert h.gen(PROMPT, 24)["tokens"] == baseline
        assert a.poll() is None and "registering again" not in log_of(a)
        took_over = [l for l in log_of(b).splitlines() if "taking over the endpoints" in l]
        assert len(took_over) == 1 and "helper tcp://" in took_over[0], log_of(b)
        assert "data tcp://" not in took_over[0]
        h.send("QUIT")
        assert finish(h.proc) == 0
    finally:
        stop(h.proc, a, b, *([wrong] if wrong is not None else []))


def test_rejoin_when_units_restart_fast_the_first_stage_twice_and_a_stopped_rank(lab, files,
                                                                                 baseline):
    """--rejoin over TCP, the cases a unit meets: a rank restarted before its loss was noticed
    (RestartSec is shorter than the heartbeat timeout) replaces the old one at once; rows the
    other rank was still handing on for a lost request are dropped by the replacement, not run;
    the first stage replaced, then its replacement replaced; a stopped rank that is lost and then
    resumes learns it was replaced, registers again (--reconnect) and takes its own place back."""
    h = head(lab, files, "--rejoin")
    a = rank(lab, files, "a", "--rank", "0", "--reconnect")
    b = rank(lab, files, "b", "--rank", "1", "--reconnect")
    try:
        h.wait_ready(60)
        assert h.gen(PROMPT, 24)["tokens"] == baseline
        # a fast restart with a request in flight
        def restart_b():
            b.kill()
            return rank(lab, files, "b", "--rank", "1", "--reconnect")
        _, line, _, b = fault_mid_generation(h, restart_b)
        assert line.startswith("ERR") and "rank 1" in line and "started again" in line, line
        assert h.gen(PROMPT, 24)["tokens"] == baseline
        # a request sent to a dead rank not yet noticed: the first stage reads it and waits to
        # hand its rows on; they reach the replacement, which drops them instead of running them
        b.kill()
        time.sleep(1)                      # its connections are seen closed; its loss is not yet
        out = h.gen(PROMPT, 400, timeout=30)
        assert out["err"] is not None and "rank 1" in out["err"], out["err"]
        b = rank(lab, files, "b", "--rank", "1", "--reconnect")
        assert h.gen(PROMPT, 24)["tokens"] == baseline
        assert int(h.stats()[1]["stale_dropped"]) >= 1
        # the first stage, twice
        for _ in range(2):
            a.kill()
            time.sleep(HEARTBEAT_S + 1)                      # noticed first, this time
            a = rank(lab, files, "a", "--rank", "0", "--reconnect")
            out = h.gen(PROMPT, 24)
            assert out["err"] is None and out["tokens"] == baseline, out["err"]
        # a stopped rank: lost after the heartbeat timeout, then it resumes
        b.send_signal(signal.SIGSTOP)
        time.sleep(HEARTBEAT_S + 2)
        b.send_signal(signal.SIGCONT)
        out = h.gen(PROMPT, 24, timeout=90)
        assert out["err"] is None and out["tokens"] == baseline, out["err"]
        assert b.poll() is None and "registering again" in log_of(b)
        h.send("QUIT")
        assert finish(h.proc) == 0
    finally:
        stop(h.proc, a, b)


def test_refusals_over_tcp_name_both_values(lab, files):
    """A wrong secret, another model and another protocol version: each rank exits 2 saying why;
    the head names both fingerprints and both versions, and keeps waiting."""
    h = head(lab, files, expect=1)
    v = "import protocol.messages as m, protocol.codec as c, protocol.auth as a, " \
        "strata_dist.rank.shell as r, sys; v = m.PROTOCOL_VERSION + 1; " \
        "m.PROTOCOL_VERSION = c.PROTOCOL_VERSION = a.PROTOCOL_VERSION = r.PROTOCOL_VERSION = v; " \
        "m.VersionMismatch.__init__.__defaults__ = (v,); " \
        "from strata_dist.rank.main import main; sys.exit(main(sys.argv[1:]))"
    try:
        wrong = rank(lab, files, "a", token=files["wrong"])
        other = rank(lab, files, "b", model=files["other"])
        newer = rank(lab, files, "a", prefix=[sys.executable, "-c", v])
        for p in (wrong, other, newer):
            assert finish(p) == 2, log_of(p)
        assert "wrong shared secret" in log_of(wrong)
        mine, theirs = GGUFModel(files["model"]).fingerprint, GGUFModel(files["other"]).fingerprint
        assert mine in log_of(other) and theirs in log_of(other)
        from protocol.messages import PROTOCOL_VERSION as ours
        assert f"v{ours}" in log_of(newer) and f"v{ours + 1}" in log_of(newer), log_of(newer)
        assert h.err_has(mine) and h.err_has(f"v{ours + 1}") and h.err_has("wrong shared secret")
        err = h.err()
        assert "wrong shared secret" in err
        assert mine in err and theirs in err
        assert f"v{ours + 1}" in err and f"v{ours}" in err
        assert h.proc.poll() is None   # still waiting for a rank it can admit
    finally:
        stop(h.proc)


def test_curve_encrypted_run_and_a_rank_without_the_key(lab, files, baseline):
    h = head(lab, files, "--curve-keys", files["curve"])
    try:
        plain = rank(lab, files, "a")
        stranger = rank(lab, files, "b", "--curve-keys", files["other_curve"])
        for p in (plain, stranger):
            assert finish(p) == 3, log_of(p)   # no CURVE handshake, so no HMAC one either
            assert "timed out" in log_of(p)
        a = rank(lab, files, "a", "--curve-keys", files["curve"])
        b = rank(lab, files, "b", "--curve-keys", files["curve"])
        h.wait_ready(60)
        out = h.gen(PROMPT, 24)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        h.send("QUIT")
        assert finish(h.proc) == 0
        assert finish(a) == 0 and finish(b) == 0
    finally:
        stop(h.proc)


def test_a_host_without_the_secret_cannot_touch_the_data_plane(lab, files, baseline):
    """A fourth machine on the LAN, without the secret, pushes well-formed messages of every type
    at both ranks' data and helper ports and at the head's inbox (tests/forger.py) while two
    requests run: the tokens equal the single process, and every receiver counts its drops."""
    from test_sealed_links import assert_drops_counted, listening_ports, stats_lines
    h = head(lab, files)
    ports = {"a": (7101, 7102), "b": (7201, 7202)}
    ranks = [rank(lab, files, host, "--data-bind", f"tcp://{lab.ip(host)}:{d}",
                  "--helper-bind", f"tcp://{lab.ip(host)}:{hp}") for host, (d, hp) in ports.items()]
    evil = None
    try:
        h.wait_ready(60)
        inbox = sorted(listening_ports(h.proc.pid) - {PORT})
        assert inbox, "the head's inbox port was not found"
        targets = [f"push=tcp://{lab.ip(host)}:{d}" for host, (d, _) in ports.items()]
        targets += [f"dealer=tcp://{lab.ip(host)}:{hp}" for host, (_, hp) in ports.items()]
        targets += [f"push=tcp://{lab.ip('head')}:{p}" for p in inbox]
        forger = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forger.py")
        evil = lab.popen("evil", [sys.executable, forger, *targets],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        for _ in range(2):
            out = h.gen(PROMPT, 24, timeout=120)
            assert out["err"] is None, out["err"]
            assert out["tokens"] == baseline
        assert evil.poll() is None, "the forger stopped early"
        assert_drops_counted(stats_lines(h), n_ranks=2)
        h.send("QUIT")
        assert finish(h.proc) == 0
    finally:
        if evil is not None and evil.poll() is None:
            evil.kill()
        stop(h.proc, *ranks)


def test_calibrating_the_link_between_two_hosts(lab, files):
    """`strata-dist calibrate --serve` on one host, `--peer` from another: the link's constants
    measured over the namespaces' network, the file a head plans with; the peer stops once the
    prober is done."""
    import json
    port = PORT + 31
    peer = lab.popen("b", [python(), "-m", "strata_dist.tools.cli", "calibrate", "--serve", str(port),
                           "--bind", lab.ip("b"), "--idle", "60"], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    out = files["dir"] / "calibration.json"
    prober = lab.popen("a", [python(), "-m", "strata_dist.tools.cli", "calibrate", "--peer",
                             f"{lab.ip('b')}:{port}", "--rounds", "100", "--out", str(out)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert prober.wait(timeout=90) == 0, prober.stderr.read()
        assert peer.wait(timeout=20) == 0
    finally:
        for p in (prober, peer):
            if p.poll() is None:
                p.kill()
    content = json.loads(out.read_text())
    assert content["measured"]["peer"] == f"tcp://{lab.ip('b')}:{port}"
    assert content["params"]["link_ms"] > 0 and content["params"]["link_gbs"] > 0
    done = subprocess.run([python(), "-m", "launcher.cli", "--model", files["model"],
                           "--cpu-ranks", "2", "--plan-only", "--json", "--calibration", str(out)],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["params"]["link_ms"] == content["params"]["link_ms"]
