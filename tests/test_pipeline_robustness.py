"""A rank with the wrong secret is refused; garbage on any socket never takes down a rank or the
coordinator."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import zmq

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession
from protocol import Endpoints, new_secret
from strata_dist.head.coordinator import Coordinator, RankFailure
from strata_dist.gguf_file.reader import GGUFModel


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tiny_qwen3moe(21), tmp_path_factory.mktemp("rob") / "m.gguf")


def _rank(model, coordinator_ep, token, extra=()):
    env = dict(os.environ, STRATA_TOKEN=token)
    return subprocess.run([sys.executable, "-m", "strata_dist.rank.main", "--coordinator",
                           coordinator_ep, "--model", model, "--vram-budget", "1G",
                           "--assign-timeout", "5", *extra],
                          capture_output=True, text=True, timeout=60, env=env)


def test_wrong_secret_is_refused(model):
    secret = new_secret()
    with Endpoints() as ep:
        coord = Coordinator(secret.encode(), GGUFModel(model).fingerprint, ep.ipc("c"), ep.ipc("h"))
        proc = subprocess.Popen([sys.executable, "-m", "strata_dist.rank.main", "--coordinator",
                                 coord.control_endpoint, "--model", model, "--vram-budget", "1G"],
                                env=dict(os.environ, STRATA_TOKEN="x" * 32),
                                stderr=subprocess.PIPE, text=True)
        with pytest.raises(RankFailure, match="registered"):
            coord.wait_for_ranks(1, timeout_s=5)
        _, err = proc.communicate(timeout=30)
        coord.shutdown()
    assert proc.returncode == 2
    assert "wrong shared secret" in err
    assert coord.ranks == []


def test_a_different_model_is_refused_naming_both_fingerprints(model, tmp_path):
    other = write_gguf(tiny_qwen3moe(22, n_layers=3), tmp_path / "other.gguf")  # another header
    secret = new_secret()
    with Endpoints() as ep:
        coord = Coordinator(secret.encode(), GGUFModel(model).fingerprint, ep.ipc("c"), ep.ipc("h"))
        proc = subprocess.Popen([sys.executable, "-m", "strata_dist.rank.main", "--coordinator",
                                 coord.control_endpoint, "--model", other, "--vram-budget", "1G"],
                                env=dict(os.environ, STRATA_TOKEN=secret),
                                stderr=subprocess.PIPE, text=True)
        with pytest.raises(RankFailure):
            coord.wait_for_ranks(1, timeout_s=5)
        _, err = proc.communicate(timeout=30)
        coord.shutdown()
    assert proc.returncode == 2
    assert GGUFModel(model).fingerprint in err and GGUFModel(other).fingerprint in err


def _garbage(rng, n):
    frames = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            frames.append([rng.bytes(int(rng.integers(0, 64)))])
        elif kind == 1:   # a msgpack-looking header cut short
            frames.append([b"\x83\xa1v\x01\xa1t\xa6hidden\xa1f" + rng.bytes(int(rng.integers(0, 16)))])
        elif kind == 2:   # several frames of noise
            frames.append([rng.bytes(8) for _ in range(int(rng.integers(2, 5)))])
        else:             # empty frame
            frames.append([b""])
    return frames


def test_fuzzed_frames_never_crash_ranks_or_coordinator(model):
    s = ServeSession(model, "--cpu-ranks", "2", "--layer-split", "2", "--prefill", "8")
    try:
        prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
        before = s.gen(prompt, 8)
        run_dir = re.search(r"logs in (\S+)", "".join(s.stderr)).group(1)
        ctx = zmq.Context.instance()
        rng = np.random.default_rng(0)
        sent = 0
        for name, kind in (("rank0", zmq.PUSH), ("rank1", zmq.PUSH), ("control", zmq.DEALER),
                           ("head", zmq.PUSH)):
            sock = ctx.socket(kind)
            sock.linger = 0
            sock.connect(f"ipc://{run_dir}/{name}.sock")
            for frames in _garbage(rng, 300):
                sock.send_multipart(frames)
                sent += 1
            sock.close()
        assert sent >= 1000
        after = s.gen(prompt, 8)
        assert after["err"] is None, after["err"]
        assert after["tokens"] == before["tokens"]
    finally:
        assert s.close() == 0


def test_a_long_prompt_chunk_is_not_taken_for_a_dead_rank(tmp_path):
    """Heartbeats go on their own connection: a chunk that computes for longer than the heartbeat
    timeout finishes instead of failing the launch."""
    path = write_gguf(tiny_qwen3moe(5, hidden=256, top_k=8, n_experts=16, n_layers=8),
                      tmp_path / "wide.gguf")
    s = ServeSession(path, "--cpu-ranks", "2", "--layer-split", "4", "--prefill", "2048",
                     "--max-context", "4096", "--heartbeat-timeout", "1.5")
    try:
        ids = [int(x) for x in np.random.default_rng(0).integers(0, 320, 2000)]
        out = s.gen(ids, 4, timeout=120)
        assert out["err"] is None, out["err"]
        assert float(out["done"][2]) > 1500, out["done"]    # the chunk outlasted the timeout
    finally:
        assert s.close() == 0


def test_a_rank_killed_while_serve_idles_is_named_on_stderr(model):
    """--serve with nothing in flight: a rank killed ends the launch (exit 1) with ERR for the
    client on stdout and the reason for the operator on stderr, not only in the rank's log."""
    import signal
    import time
    from launch_helpers import rank_pids
    s = ServeSession(str(model), "--cpu-ranks", "2", "--layer-split", "2", timeout=60)
    try:
        victim = rank_pids(s)[1]
        os.kill(victim, signal.SIGKILL)
        line = s.next_line(timeout=30)
        assert line.startswith("ERR ") and "killed by signal 9" in line, line
        assert s.err_has(f"(pid {victim}) was killed by signal 9", timeout=30), s.err()
        deadline = time.monotonic() + 30
        while s.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.proc.returncode == 1
        assert "error: rank" in s.err().splitlines()[-1]
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
