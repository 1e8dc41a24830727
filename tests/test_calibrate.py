"""`strata-dist calibrate` and `strata-launch --calibration`: the hand-off measured between two real
processes, the link measured against a real `--serve` peer over TCP, the file a launch plans with
(the environment still overriding it field by field), and the refusals: a bad file names itself
and its field, a peer that is not there fails in bounded time, a peer nobody probes stops."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from strata_dist.tools.calibrate import FORMAT, save_calibration
from strata_dist.synth import write_synthetic

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool(*args, timeout=90, env=None):
    return subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", "calibrate", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "tiny.gguf"
    write_synthetic(path, like="tiny", quant="f32", popularity="zipf:1.0")
    return str(path)


def test_calibrate_measures_the_handoff_and_a_link_to_a_real_peer(tmp_path):
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-m", "strata_dist.tools.cli", "calibrate", "--serve",
                             f"127.0.0.1:{port}", "--idle", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = tmp_path / "cal.json"
        done = tool("--peer", f"127.0.0.1:{port}", "--rounds", "200", "--out", str(out))
        assert done.returncode == 0, done.stderr
        assert f"wrote {out}" in done.stdout
        content = json.loads(out.read_text())
        assert content["strata_calibration"] == FORMAT
        params = content["params"]
        assert set(params) == {"handoff_ms", "link_ms", "link_gbs"}
        assert all(v > 0 for v in params.values()), params
        m = content["measured"]
        assert m["handoff_path"] == "frames" and m["device"] == "cpu"
        assert m["peer"] == f"tcp://127.0.0.1:{port}" and m["payload_bytes"] == 16 << 20
        # the prober tells its peer it is done: the peer stops at once
        assert peer.wait(timeout=20) == 0
        assert "the prober is done" in peer.stderr.read()
    finally:
        if peer.poll() is None:
            peer.kill()


def test_without_a_peer_only_the_handoff_is_calibrated(tmp_path):
    out = tmp_path / "cal.json"
    done = tool("--rounds", "100", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "the link constants keep their defaults" in done.stdout
    assert set(json.loads(out.read_text())["params"]) == {"handoff_ms"}


def _plan_params(model, *args, env=None):
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model, "--cpu-ranks",
                           "2", "--plan-only", "--json", *args],
                          capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["params"], done.stderr


def test_a_launch_plans_with_the_calibration_and_the_environment_overrides_it(model, tmp_path,
                                                                              monkeypatch):
    path = str(tmp_path / "cal.json")
    save_calibration({"strata_calibration": FORMAT,
                      "params": {"handoff_ms": 0.25, "link_ms": 0.9, "link_gbs": 3.5},
                      "measured": {}}, path)
    monkeypatch.delenv("STRATA_SPLIT_LINK_MS", raising=False)
    monkeypatch.delenv("STRATA_SPLIT_HANDOFF_MS", raising=False)
    default, _ = _plan_params(model)
    params, err = _plan_params(model, "--calibration", path)
    assert (params["handoff_ms"], params["link_ms"], params["link_gbs"]) == (0.25, 0.9, 3.5)
    assert params["host_gbs"] == default["host_gbs"]            # not calibrated: the default
    assert f"planner constants from calibration {path}: handoff_ms 0.25, link_ms 0.9" in err
    env = dict(os.environ, STRATA_SPLIT_LINK_MS="0.05")
    params, err = _plan_params(model, "--calibration", path, env=env)
    assert params["link_ms"] == 0.05 and params["handoff_ms"] == 0.25
    assert "link_ms 0.9 (overridden by the environment)" in err


@pytest.mark.parametrize("text, says", [
    ("{", "not JSON"),
    ('{"params": {"link_ms": 1}}', "not a strata-dist calibration file"),
    ('{"strata_calibration": 1, "params": {"miss_ms": 1}}', "unknown field 'miss_ms'"),
    ('{"strata_calibration": 1, "params": {"link_gbs": 0}}', "link_gbs must be > 0"),
    ('{"strata_calibration": 1, "params": {"link_ms": "fast"}}', "link_ms must be a number"),
])
def test_a_bad_calibration_file_is_refused_naming_it(model, tmp_path, text, says):
    path = tmp_path / "cal.json"
    path.write_text(text)
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model, "--cpu-ranks",
                           "2", "--plan-only", "--calibration", str(path)],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 2
    assert f"calibration {path}" in done.stderr and says in done.stderr, done.stderr


def test_a_peer_that_is_not_there_fails_in_bounded_time():
    t0 = time.monotonic()
    done = tool("--peer", f"127.0.0.1:{free_port()}", "--rounds", "20")
    assert done.returncode == 2
    assert "no answer from tcp://127.0.0.1:" in done.stderr and "--serve" in done.stderr
    assert time.monotonic() - t0 < 60


def test_a_peer_nobody_probes_stops_and_the_flag_refusals():
    done = tool("--serve", f"127.0.0.1:{free_port()}", "--idle", "1", timeout=30)
    assert done.returncode == 0 and "no probe for 1 s: stopping" in done.stderr
    done = tool("--serve", "5555", "--out", "x.json")
    assert done.returncode == 2 and "--serve 5555" in done.stderr and "--out" in done.stderr
    done = tool("--peer", "nohost")
    assert done.returncode == 2 and "--peer nohost" in done.stderr
