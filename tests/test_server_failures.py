"""The OpenAI-compatible server (`strata-launch --port`) on real CPU ranks when things go wrong:
flags it refuses, a rank that dies mid-request (with and without --restart-ranks and --rejoin)
and SIGTERM with streams open. Each test starts its own server; the server's normal serving is
test_server.py's."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from launch_helpers import launcher_children
from server_helpers import LONG, ServerProcess, long_stream, tiny_model_fixture

pytestmark = pytest.mark.timeout(60)


model = tiny_model_fixture("server_failures", popularity="zipf:1.0")


# ---- refusals and failures -------------------------------------------------------------------------

def _launch(model, *args, timeout=30):
    return subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model, *args],
                          capture_output=True, text=True, timeout=timeout)


def test_refusals_name_both_flags(model):
    r = _launch(model, "--port", "0", "--serve")
    assert r.returncode == 2 and "--port 0 and --serve" in r.stderr
    r = _launch(model, "--port", "0", "--prompt-ids", "1,2")
    assert r.returncode == 2 and "--port 0 and --prompt-ids" in r.stderr
    r = _launch(model, "--api-key", "k")
    assert r.returncode == 2 and "--api-key goes with --port" in r.stderr
    r = _launch(model, "--port", "0", "--queue-size", "0")
    assert r.returncode == 2 and "--queue-size" in r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = _launch(model, "--cpu-ranks", "1", "--port", str(port))
    assert r.returncode == 2 and f"--port {port}" in r.stderr and "cannot listen" in r.stderr


def test_a_dead_rank_fails_the_request_and_stops_the_server(model):
    s = ServerProcess(model, "--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G")
    try:
        ranks = launcher_children(s.proc.pid)
        assert len(ranks) == 2
        events: list[str] = []

        def read():
            with httpx.Client(timeout=30) as http:
                resp = long_stream(s, http)
                try:
                    for line in resp.iter_lines():
                        events.append(line)
                except httpx.HTTPError as e:
                    events.append(f"closed: {e!r}")
                finally:
                    resp.close()

        t = threading.Thread(target=read, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while not any('"token_ids": [' in e for e in events) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(ranks[1], signal.SIGKILL)
        t.join(20)
        assert not t.is_alive()
        errors = [json.loads(e[6:]) for e in events if e.startswith("data: {\"error\"")]
        assert errors and errors[0]["error"]["type"] == "server_error"
        assert "rank" in errors[0]["error"]["message"]
        assert s.proc.wait(timeout=20) == 1
        assert "error:" in s.err_text()
    finally:
        s.close()


def test_restart_ranks_under_port(model):
    """With --restart-ranks, a rank's death fails the request in flight, /health answers 503 with
    the error while fresh ranks load, then 200, and the next request is served."""
    s = ServerProcess(model, "--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G",
                      "--restart-ranks", "1")
    try:
        ranks = launcher_children(s.proc.pid)
        os.kill(ranks[1], signal.SIGKILL)
        seen, deadline = [], time.monotonic() + 30
        with httpx.Client(timeout=10) as http:
            while time.monotonic() < deadline:
                r = http.get(f"{s.url}/health")
                seen.append((r.status_code, r.json()))
                if r.status_code == 200 and any(code == 503 for code, _ in seen):
                    break
                time.sleep(0.01)
            failing = [body for code, body in seen if code == 503]
            assert failing and any("rank" in body.get("error", "") for body in failing), seen[-3:]
            assert seen[-1][0] == 200, seen[-3:]
            r = http.post(f"{s.url}/v1/completions", headers=s.headers, timeout=30,
                          json={"model": "tiny", "prompt": "again", "max_tokens": 3, **LONG})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert s.proc.poll() is None
        assert set(launcher_children(s.proc.pid)).isdisjoint(ranks)   # every rank is new
    finally:
        s.close()


def test_rejoin_under_port_replaces_only_the_dead_rank(model):
    """With --rejoin, a rank killed mid-request fails that request with 503 naming the rank; the
    launcher starts it again while the other rank keeps its process, and the next request is
    served (it waits for the replacement)."""
    s = ServerProcess(model, "--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G",
                      "--rejoin")
    try:
        ranks = launcher_children(s.proc.pid)
        with httpx.Client(timeout=30) as http:
            first = http.post(f"{s.url}/v1/completions", headers=s.headers,
                              json={"model": "tiny", "prompt": "again", "max_tokens": 3,
                                    "temperature": 0, **LONG}).json()["choices"][0]["token_ids"]
            with http.stream("POST", f"{s.url}/v1/completions", headers=s.headers,
                             json={"model": "tiny", "prompt": "long", "max_tokens": 4000,
                                   "stream": True, **LONG}) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data:"))   # under way
                os.kill(ranks[1], signal.SIGKILL)
                rest = "\n".join(lines)
            assert "rank 1" in rest and "replacement" in rest, rest[-500:]
            r = http.post(f"{s.url}/v1/completions", headers=s.headers,
                          json={"model": "tiny", "prompt": "again", "max_tokens": 3,
                                "temperature": 0, **LONG})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == first
        now = launcher_children(s.proc.pid)
        assert ranks[0] in now and ranks[1] not in now and len(now) == 2, (ranks, now)
        assert s.proc.poll() is None
    finally:
        s.close()


def test_sigterm_ends_open_streams_with_a_message(model):
    s = ServerProcess(model, "--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G")
    try:
        ranks = launcher_children(s.proc.pid)
        with httpx.Client(timeout=30) as http:
            resp = long_stream(s, http)
            lines = resp.iter_lines()
            while '"token_ids": [' not in next(lines):
                pass
            s.proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x]   # ends: no hang, no broken chunked stream
            resp.close()
        assert rest[-1] == "data: [DONE]"
        err = json.loads(next(x for x in rest if x.startswith('data: {"error"'))[6:])["error"]
        assert err["message"] == "the server is stopping"
        assert s.proc.wait(timeout=20) == 130
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{p}") and _alive(p) for p in ranks):
            assert time.monotonic() < deadline, "a rank outlived its launcher"
            time.sleep(0.05)
    finally:
        s.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
