"""Stopping strata-launch while its ranks are deep in a long prompt, with real rank processes: a
12,000-token prompt read as one chunk at a 16,384-cell context keeps each CPU rank inside a single
step for seconds. SIGINT (one-shot --prompt-ids), SIGTERM (--serve, --port) and a second SIGINT
(--serve: the first cancels) each end the launch within 5 s of the signal: exit 130, no traceback,
every rank process gone, the run directory removed. A launcher killed outright (SIGKILL) leaves
no rank computing on either: they are gone within 5 s too."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from launch_helpers import LineProcess, launcher_children, wait_gone, wait_or_kill
from server_helpers import ServerProcess

STOP_WITHIN_S = 5.0
PROMPT = [int(x) for x in np.random.default_rng(0).integers(0, 500, 12000)]
DEPTH = ("--cpu-ranks", "2", "--layer-split", "2", "--max-context", "16384", "--prefill", "16384")
INTO_PROMPT_S = 1.5   # the signal comes this long after the prompt went out: inside its one chunk


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    path = tmp_path_factory.mktemp("depth") / "m.gguf"
    write_synthetic(path, like="tiny", quant="f32", popularity="zipf:1.0", seed=0)
    return str(path)


def launcher(model: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", "--model", model, *DEPTH, *args]


def ranks_of(proc: subprocess.Popen, n: int = 2, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = launcher_children(proc.pid)
        if len(pids) == n:
            return pids
        assert proc.poll() is None, "the launcher ended before its ranks started"
        time.sleep(0.05)
    raise TimeoutError(f"no {n} ranks within {timeout} s")


def run_dir(stderr: str) -> str:
    found = re.search(r"logs in (\S+)", stderr)
    assert found, stderr
    return found.group(1)


def stopped_in_time(proc: subprocess.Popen, ranks: list[int], signalled: float, stderr) -> None:
    """Exit 130 within STOP_WITHIN_S of the signal, every rank gone by then, no traceback, the
    run directory removed."""
    code = wait_or_kill(proc, STOP_WITHIN_S + 30)
    took = time.monotonic() - signalled
    left = wait_gone(ranks, timeout=max(0.0, STOP_WITHIN_S - took))
    err = stderr()
    assert code == 130, err
    assert took <= STOP_WITHIN_S, f"the launch took {took:.1f} s to stop; {err[-2000:]}"
    assert left == [], f"ranks {left} outlived the launch; {err[-2000:]}"
    assert "Traceback" not in err, err
    assert not os.path.exists(run_dir(err)), err


def test_sigint_during_a_one_shot_prompt_stops_within_5_s(model):
    proc = subprocess.Popen(launcher(model, "--prompt-ids", ",".join(map(str, PROMPT)),
                                     "--max-new", "4"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    session = LineProcess(proc)   # reads both streams on threads
    try:
        ranks = ranks_of(proc)
        assert session.err_has("INFO rank=1", timeout=60), session.err()   # the prompt went out
        time.sleep(INTO_PROMPT_S)
        assert proc.poll() is None and "DONE" not in session.err()
        proc.send_signal(signal.SIGINT)
        stopped_in_time(proc, ranks, time.monotonic(), session.err)
    finally:
        wait_or_kill(proc, 5)


def _serving(model: str) -> tuple[LineProcess, list[int]]:
    proc = subprocess.Popen(launcher(model, "--serve"), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    session = LineProcess(proc)
    session.wait_ready(60)
    session.send(f"GEN 4 {' '.join(map(str, PROMPT))}")
    assert session.next_line(30) == "RESUME 0"
    time.sleep(INTO_PROMPT_S)
    assert session.lines.empty(), session.next_line(1)   # no PP yet: inside the prompt's chunk
    return session, launcher_children(proc.pid)


def test_sigterm_during_a_served_prompt_stops_within_5_s(model):
    session, ranks = _serving(model)
    try:
        assert len(ranks) == 2
        session.proc.send_signal(signal.SIGTERM)
        stopped_in_time(session.proc, ranks, time.monotonic(), session.err)
    finally:
        wait_or_kill(session.proc, 5)


def test_a_second_sigint_during_a_served_prompt_stops_within_5_s(model):
    """The first SIGINT asks the running generation to end; the second stops the launch."""
    session, ranks = _serving(model)
    try:
        session.proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        session.proc.send_signal(signal.SIGINT)
        stopped_in_time(session.proc, ranks, time.monotonic(), session.err)
    finally:
        wait_or_kill(session.proc, 5)


def test_sigterm_during_an_http_prompt_stops_within_5_s(model):
    server = ServerProcess(model, *DEPTH)
    try:
        ranks = launcher_children(server.proc.pid)
        assert len(ranks) == 2
        got: dict = {}

        def complete() -> None:
            try:
                with httpx.Client(timeout=60.0) as c:
                    r = c.post(f"{server.url}/v1/completions",
                               json={"model": os.path.basename(model)[:-5], "prompt": PROMPT,
                                     "max_tokens": 4, "stream": True})
                    got["status"], got["body"] = r.status_code, r.text
            except httpx.HTTPError as e:   # the server may close the stream instead
                got["error"] = repr(e)

        client = threading.Thread(target=complete, daemon=True)
        client.start()
        time.sleep(INTO_PROMPT_S + 0.5)
        assert client.is_alive(), got    # the prompt is still being read
        server.proc.send_signal(signal.SIGTERM)
        stopped_in_time(server.proc, ranks, time.monotonic(), server.err_text)
        client.join(10)
        assert not client.is_alive()
        assert "error" in got or "stopping" in got.get("body", ""), got
    finally:
        wait_or_kill(server.proc, 5)


def test_a_launcher_killed_during_a_prompt_leaves_no_rank_computing(model):
    """SIGKILL gives the launcher no chance to stop anything: each rank sees its coordinator's
    connection close (or its parent gone) and ends though it is inside a step."""
    session, ranks = _serving(model)
    try:
        session.proc.kill()
        killed = time.monotonic()
        left = wait_gone(ranks, timeout=STOP_WITHIN_S)
        assert left == [], f"ranks {left} still ran {time.monotonic() - killed:.1f} s after"
    finally:
        wait_or_kill(session.proc, 5)
        for pid in wait_gone(ranks, timeout=0):   # none, unless the assertion above failed
            os.kill(pid, signal.SIGKILL)


def test_the_pulse_watches_only_a_coordinator_on_this_host():
    """A dropped connection ends a busy rank only where it can mean the coordinator closed: across
    a network it may be a blip that ZeroMQ reconnects through (the heartbeats decide there)."""
    from strata_dist.rank.pulse import on_this_host
    assert on_this_host("ipc:///tmp/strata-x/control")
    assert on_this_host("tcp://127.0.0.1:5555") and on_this_host("tcp://localhost:1")
    assert on_this_host("tcp://[::1]:5555")
    assert not on_this_host("tcp://10.0.0.7:5555") and not on_this_host("tcp://[fd00::7]:5555")
