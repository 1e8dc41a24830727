"""The HTTP server against hostile clients and a hostile model file, on real CPU ranks with real HTTP
clients: each refusal comes at once, and the server process stays under PEAK_RSS_MB (its VmHWM, read
from /proc) and answers within WITHIN_S.

The model's chat template (`tokenizer.chat_template`, code from the file) loops for hours or writes
gigabytes when a request's chat_template_kwargs ask it to."""
from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

import strata_dist.synth.tokenizer as synth_tokenizer
from launch_helpers import launcher_children
from server_helpers import ServerProcess, server_fixture, tiny_model_fixture
from strata_dist.server.hosts import HostCheck, default_allowed_hosts, parse_allowed_hosts

pytestmark = pytest.mark.timeout(60)

PEAK_RSS_MB = 500          # the server process, whatever a client sends
WITHIN_S = 10.0            # a refusal that should come at once comes within this
KEY = "sk-hostile-51"
CHATML = synth_tokenizer.CHAT_TEMPLATE
HOSTILE_TEMPLATE = (
    # 10^10 empty iterations: hours of CPU without a byte of output
    "{%- if hang %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    "{% endif %}"
    # 10 GB of output
    "{%- if flood %}{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}{% endif %}"
    + CHATML)


model = tiny_model_fixture("hostile", popularity="zipf:1.0", chat_template=HOSTILE_TEMPLATE)
# no key and no --allowed-hosts: the defaults a local user gets
server = server_fixture("--cpu-ranks", "1", "--vram-budget", "1G", "--max-context", "4096")


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def assert_bounded(server, t0: float) -> None:
    took = time.monotonic() - t0
    assert took < WITHIN_S, f"took {took:.1f} s"
    peak = peak_rss_mb(server.proc.pid)
    assert peak < PEAK_RSS_MB, f"the server process peaked at {peak:.0f} MB"


def post(server, path: str, body: dict, timeout: float = WITHIN_S, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=timeout, **kw)


def chat(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
            **extra}


# ---- prompts and bodies ---------------------------------------------------------------------------

def test_a_huge_prompt_is_refused_before_it_is_tokenized(server):
    """30 MB of prompt text cannot fit 4,096 tokens; it is refused by its length in bytes (it was
    tokenized first: gigabytes and half a minute)."""
    text = "lorem ipsum " * 2_500_000
    t0 = time.monotonic()
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 1})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "30000000 bytes" in err["message"] and "4096 tokens" in err["message"], err
    r = post(server, "/v1/chat/completions",
             {"model": "tiny", "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert_bounded(server, t0)
    # a prompt that fits is still served
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "lorem ipsum " * 100,
                                         "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_chunked_body_is_refused_as_it_passes_the_cap(server):
    """No Content-Length: the body is counted as it arrives and refused (413) once past 32 MiB, not
    read to its end (600 MB used to be read, at twice that in memory)."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    chunk = b"x" * 2 ** 20
    sent = 0
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=WITHIN_S) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        reply = b""
        try:
            while sent < 600 * 2 ** 20 and time.monotonic() - t0 < WITHIN_S:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                sock.setblocking(False)
                try:
                    reply = sock.recv(65536)
                except BlockingIOError:
                    pass
                sock.setblocking(True)
                if reply:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass   # the server closed the connection after its answer
        sock.settimeout(WITHIN_S)
        while b"\r\n\r\n" not in reply:
            more = sock.recv(65536)
            if not more:
                break
            reply += more
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert sent < 200 * 2 ** 20, f"{sent >> 20} MiB were accepted before the refusal"
    assert_bounded(server, t0)


def test_a_body_or_headers_that_stall_are_dropped_and_others_are_served_meanwhile(server):
    """A client that sends its headers and part of its body, then nothing, gets 408 once
    BODY_IDLE_S pass without a byte; one that stops inside its headers is disconnected HEADERS_S
    after it connected (each connection used to be held forever); a request sent meanwhile is
    answered."""
    from strata_dist.server.app import BODY_IDLE_S
    from strata_dist.server.run import HEADERS_S
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=BODY_IDLE_S + WITHIN_S) as sock, \
            socket.create_connection((host, int(port)), timeout=HEADERS_S + WITHIN_S) as partial:
        partial.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode())
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: 1000\r\n\r\n{{\"model\":".encode())
        other = httpx.post(server.url + "/v1/completions", timeout=WITHIN_S,
                           json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
        assert other.status_code == 200, other.text
        reply = b""
        while b"\r\n\r\n" not in reply:
            more = sock.recv(65536)
            if not more:
                break
            reply += more
        assert partial.recv(65536) == b""          # closed by the server, no answer
        assert HEADERS_S - 1 <= time.monotonic() - t0 < HEADERS_S + WITHIN_S
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert BODY_IDLE_S <= time.monotonic() - t0 < BODY_IDLE_S + WITHIN_S


def test_a_body_of_millions_of_tiny_values_is_refused_before_parsing(server):
    """31 MiB of `[],` parsed is 770 MB of empty lists; a body is refused past a count of values
    (its ',', '[' and '{': 8 per context token, at least 65,536) before it is parsed."""
    t0 = time.monotonic()
    n = 31 * 2 ** 20 // 3
    r = httpx.post(server.url + "/v1/completions", content=b"[" + b"[]," * n + b"[]]",
                   headers={"content-type": "application/json"}, timeout=WITHIN_S)
    assert r.status_code == 413 and "65536 JSON values" in r.json()["error"]["message"], \
        r.text[:300]
    assert_bounded(server, t0)
    # a body under the count is parsed (and this one refused for what it says)
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": [7] * 60_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


# ---- chat templates --------------------------------------------------------------------------------

def test_template_kwargs_must_be_names_the_template_can_take(server):
    """`self` collided with the renderer's own argument (a 500); keys the server or jinja2 set, and
    keys that are not names, are refused naming the key."""
    for key in ("self", "loop", "raise_exception", "bos_token", "1x", "a-b", "__class__"):
        r = post(server, "/v1/chat/completions", chat(chat_template_kwargs={key: 1}))
        assert r.status_code == 400, (key, r.text)
        err = r.json()["error"]
        assert err["param"] == "chat_template_kwargs" and key in err["message"], (key, err)
    r = post(server, "/v1/chat/completions", chat(chat_template_kwargs={"enable_thinking": False}))
    assert r.status_code == 200, r.text


def test_a_template_that_loops_or_floods_is_stopped_within_its_bound(server):
    """10^10 loop iterations stop at the render deadline (1 s) and 10 GB of output at the prompt
    cap, each a 400 naming the bound; forty at once do not take the server down (each hung a thread
    for good, and ~40 exhausted the pool while /health said 200)."""
    t0 = time.monotonic()
    r = post(server, "/v1/chat/completions", chat(chat_template_kwargs={"hang": True}))
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "template_limit" and "within 1 s" in err["message"], err
    assert took < 8.0, f"the render stopped after {took:.1f} s"
    r = post(server, "/v1/chat/completions", chat(chat_template_kwargs={"flood": True}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "bytes" in err["message"], err
    assert_bounded(server, t0)

    # forty at once: a few render (each stopped at its deadline), some wait, the rest are told to
    # come back (429); a completion meanwhile is served at once
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(40) as pool:
        hung = [pool.submit(post, server, "/v1/chat/completions",
                            chat(chat_template_kwargs={"hang": True}), 30) for _ in range(40)]
        time.sleep(0.5)
        t1 = time.monotonic()
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": "meanwhile",
                                             "max_tokens": 2})
        assert r.status_code == 200 and time.monotonic() - t1 < 8.0, r.text
        codes = sorted(f.result().status_code for f in hung)
    assert set(codes) <= {400, 429} and codes.count(400) >= 4, codes
    assert_bounded(server, t0)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert post(server, "/v1/chat/completions", chat()).status_code == 200


def test_a_client_that_leaves_stops_its_render(server):
    """The render of a client that disconnects is stopped then (its child killed), not at the
    deadline: /v1/status counts it cancelled, not timed out."""
    def counts():
        return httpx.get(f"{server.url}/v1/status", timeout=5).json()["chat_templates"]
    before = counts()
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/chat/completions", chat(chat_template_kwargs={"hang": True}),
             timeout=0.3)
    deadline = time.monotonic() + 5
    while counts()["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = counts()
    assert after["cancelled"] == before["cancelled"] + 1, (before, after)
    assert after["timed_out"] == before["timed_out"], (before, after)


# ---- Host, cache ------------------------------------------------------------------------------------

def test_a_foreign_host_header_is_refused(server):
    """DNS rebinding: a page on evil.example whose name resolves to 127.0.0.1 makes the browser
    send `Host: evil.example:PORT`; with no key, that reached everything."""
    port = server.url.rsplit(":", 1)[1]
    for path in ("/v1/models", "/v1/status", "/"):
        r = httpx.get(server.url + path, headers={"Host": f"evil.example:{port}"}, timeout=5)
        assert r.status_code == 421, (path, r.status_code)
        assert "--allowed-hosts" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", headers={"Host": f"evil.example:{port}"},
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 1}, timeout=5)
    assert r.status_code == 421
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert httpx.get(server.url + "/v1/models", headers={"Host": host}, timeout=5).status_code \
            == 200, host
    # /health answers any Host (probes), with its status only
    r = httpx.get(server.url + "/health", headers={"Host": f"evil.example:{port}"}, timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "ready"}, r.text


def test_host_policy_of_a_server_on_every_interface():
    """Listening on 0.0.0.0, the LAN reaches the server by its addresses and this machine's name;
    a name that is not its own (a rebound one) is still refused."""
    check = HostCheck(default_allowed_hosts("0.0.0.0", 8080), addresses_on=8080)
    for ok in ("192.168.1.20:8080", "[fe80::1]:8080", "localhost:8080",
               f"{socket.gethostname()}:8080"):
        assert check.allows(ok), ok
    for bad in ("evil.example:8080", "192.168.1.20:9", "localhost:9"):
        assert not check.allows(bad), bad
    named = HostCheck(parse_allowed_hosts("api.example,10.0.0.1:80"))
    assert named.allows("api.example") and named.allows("API.example:1234")
    assert named.allows("10.0.0.1") and named.allows("10.0.0.1:80")
    assert not named.allows("10.0.0.1:8080") and not named.allows("127.0.0.1:80")


def test_cached_prompt_state_is_reused_only_within_a_salt(server):
    """cached_tokens told one client how much of its prompt matched another's last prompt (a way to
    read it token by token); requests of different `cache_salt` share nothing."""
    prompt = "the secret plan is to meet at the old mill at nine " * 3

    def cached(salt: str, text: str = prompt) -> int:
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 1,
                                             "temperature": 0, "cache_salt": salt})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached("alice")
    assert cached("alice") > 0                      # the same client still reuses its prompt
    cached("alice")
    assert cached("mallory", prompt[:40] + "guess") == 0
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "cache_salt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


# ---- flags, and the health of a launch that cannot be served -------------------------------------------

def test_allowed_hosts_flag_refusals(model):
    def launch(*args):
        return subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model, *args],
                              capture_output=True, text=True, timeout=30)
    r = launch("--allowed-hosts", "localhost")
    assert r.returncode == 2 and "--allowed-hosts goes with --port" in r.stderr, r.stderr
    for bad in ("a,,b", "", "a:port", "http://x"):
        r = launch("--port", "0", "--allowed-hosts", bad)
        assert r.returncode == 2 and "--allowed-hosts" in r.stderr, (bad, r.stderr)
        assert "Traceback" not in r.stderr


def test_health_says_503_while_a_lost_rank_cannot_come_back(model, tmp_path):
    """--rejoin, and the model file replaced by a truncated copy: the lost rank's replacement never
    loads, every request would wait and get 503, so /health says 503 and why (it said 200 "ready").
    Without the key /health says only its status (it showed the launcher's lines); --allowed-hosts
    replaces the default list."""
    path = tmp_path / "tiny.gguf"
    shutil.copy(model, path)
    s = ServerProcess(str(path), "--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G",
                      "--max-context", "4096", "--rejoin", "--allowed-hosts",
                      "127.0.0.1,api.example:8080", api_key=KEY)
    try:
        with httpx.Client(timeout=5) as http:
            health = http.get(f"{s.url}/health")
            assert health.status_code == 200 and health.json() == {"status": "ready"}
            full = http.get(f"{s.url}/health", headers=s.headers).json()
            assert full["status"] == "ready" and "queue" in full, full
            models = f"{s.url}/v1/models"
            assert http.get(models, headers=dict(s.headers, Host="api.example:8080")).status_code \
                == 200
            assert http.get(models, headers=dict(s.headers, Host="api.example:9")).status_code \
                == 421
            assert http.get(models, headers=dict(s.headers, Host="localhost")).status_code == 421

            spare = tmp_path / "spare.gguf"
            data = open(model, "rb").read()
            spare.write_bytes(data[:len(data) // 2])
            os.replace(spare, path)        # the ranks keep the file they opened
            ranks = launcher_children(s.proc.pid)
            t0 = time.monotonic()
            os.kill(ranks[1], 9)
            seen = []
            while time.monotonic() - t0 < WITHIN_S:
                r = http.get(f"{s.url}/health", headers=s.headers)
                seen.append((r.status_code, r.json()))
                if r.status_code == 503:
                    break
                time.sleep(0.1)
            code, body = seen[-1]
            assert code == 503, seen[-3:]
            assert body["status"] == "rejoining" and "rank 1 is lost" in body["error"], body
            time.sleep(1.5)              # its replacement has failed on the truncated file by now
            r = http.get(f"{s.url}/health", headers=s.headers)
            assert r.status_code == 503 and "rank 1" in r.json()["error"], r.text
            r = http.get(f"{s.url}/health")
            assert r.status_code == 503 and r.json() == {"status": "rejoining"}, r.text
    finally:
        s.close()
