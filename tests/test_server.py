"""The OpenAI-compatible server (`strata-launch --port`) on real CPU ranks, driven by the official
`openai` client and plain HTTP: chat and completions, streaming and not, stop strings, seeds, the
same token ids as `--serve`, bad input, the queue bound, client disconnects, /metrics, /v1/status
and the Monitor page in headless Chromium. Refusals and failures (a dead rank, SIGTERM) are
test_server_failures.py's."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch_helpers import ServeSession
from protocol.auth import write_secret
from server_helpers import (FRESH, LONG, ServerProcess, client_fixture, long_stream, server_fixture,
                            tiny_model_fixture, tokenizer_fixture)

KEY = "sk-test-7d1e"
# Two stages and a card that runs none; stage caches pinned to 4 slots, so the leftover of every card
# becomes a helper tier: ranks 0 and 1 run a stage and host a helper tier (one card each), rank 2 is
# a helper only.
RANK_ARGS = ("--cpu-ranks", "3", "--layer-split", "2", "--vram-budget", "1G", "--max-context", "4096",
             "--gpu-order", "as_given")
ENV = {"STRATA_STAGE_CACHE_SLOTS": "4"}

pytestmark = pytest.mark.timeout(60)


model = tiny_model_fixture("server", popularity="zipf:1.0")
server = server_fixture(*RANK_ARGS, "--queue-size", "2", api_key=KEY, env=ENV, clean_exit=True)
client = client_fixture()
tok = tokenizer_fixture()


def status(server) -> dict:
    r = httpx.get(f"{server.url}/v1/status", headers=server.headers, timeout=10)
    assert r.status_code == 200
    return r.json()


def metrics(server) -> dict[str, float]:
    r = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10)
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


# ---- lifecycle ----------------------------------------------------------------------------------------

def test_health_is_503_while_loading_then_200(model, tmp_path):
    """The listener answers before any rank exists. With ranks started by hand (`--listen`),
    /health is 503 "loading" for as long as they are absent (so the 503 is seen on any machine,
    however fast the ranks load), then 200 once both have loaded, and never 503 again."""
    token = tmp_path / "token"
    write_secret(str(token), "h" * 48)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = ServerProcess(model, "--listen", str(port), "--expect-ranks", "2", "--token-file",
                      str(token), "--layer-split", "2", "--max-context", "4096", wait=False)
    ranks: list[subprocess.Popen] = []
    try:
        with httpx.Client(timeout=5.0) as c:
            before = [c.get(f"{s.url}/health") for _ in range(3)]
            assert [r.status_code for r in before] == [503] * 3
            first = before[0].json()
            assert first["status"] == "loading", first
            assert first["loading"]["ranks_total"] == 2 and first["loading"]["ranks_ready"] == 0
            assert first["loading"]["phase"] in ("starting", "registering"), first
            ranks = [subprocess.Popen(
                [sys.executable, "-m", "strata_dist.rank.main", "--coordinator",
                 f"tcp://127.0.0.1:{port}", "--model", model, "--vram-budget", "1G",
                 "--token-file", str(token), "--host-id", host, "--connect-timeout", "5"],
                stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{host}.log", "w"))
                for host in ("left", "right")]
            codes = []
            deadline = time.monotonic() + 45
            while time.monotonic() < deadline and s.proc.poll() is None:
                r = c.get(f"{s.url}/health")
                codes.append(r.status_code)
                if r.status_code == 200:
                    assert r.json()["status"] == "ready", r.json()
                    break
                assert r.json()["status"] == "loading", r.json()
                time.sleep(0.01)
            assert codes and codes[-1] == 200, (codes[-5:], s.err_text()[-2000:],
                                                (tmp_path / "left.log").read_text()[-1000:])
            assert set(codes[:-1]) <= {503}, codes
            assert [c.get(f"{s.url}/health").status_code for _ in range(3)] == [200] * 3
    finally:
        assert s.close() in (0, 130, -signal.SIGTERM)
        for p in ranks:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_api_key_from_a_file_or_the_environment(model, tmp_path, monkeypatch):
    s = ServerProcess(model, "--cpu-ranks", "1", api_key="from-a-file",
                      api_key_file=str(tmp_path / "key"))
    try:
        assert "from-a-file" not in " ".join(s.proc.args)       # not in the process list
        r = httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer from-a-file"},
                      timeout=10)
        assert r.status_code == 200
        assert httpx.get(f"{s.url}/v1/models", timeout=10).status_code == 401
    finally:
        s.close()
    from launcher.cli import UsageError, api_key, build_parser
    monkeypatch.setenv("STRATA_API_KEY", "from-the-env")
    args = build_parser().parse_args(["--model", model, "--port", "0"])
    assert api_key(args) == "from-the-env"
    (tmp_path / "empty").write_text("\n")
    args = build_parser().parse_args(["--model", model, "--port", "0", "--api-key-file",
                                      str(tmp_path / "empty")])
    with pytest.raises(UsageError, match="holds no key"):
        api_key(args)


def test_api_key_guards_everything_but_health(server):
    for path in ("/v1/models", "/v1/status", "/metrics", "/"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"},
                         timeout=10).status_code == 401
        assert httpx.get(server.url + path, headers=server.headers, timeout=10).status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "a"}, timeout=10)
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


# ---- generation -------------------------------------------------------------------------------------

def test_chat_and_completions(client, tok):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                       extra_body=LONG)
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason == "length" and len(ids_of(c)) == 8
    assert c.message.content == tok.decode(ids_of(c))
    prompt_ids = tok.encode_chat(msgs)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 8
    assert r.usage.total_tokens == len(prompt_ids) + 8

    r = client.completions.create(model="tiny", prompt="The cat sat on the", max_tokens=6,
                                  temperature=0, extra_body=LONG)
    c = r.choices[0]
    assert c.text == tok.decode(ids_of(c)) and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode("The cat sat on the"))
    assert r.usage.completion_tokens == 6


def test_streaming_equals_non_streaming(client):
    msgs = [{"role": "user", "content": "Count to three"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0,
                                          extra_body=dict(LONG, **FRESH))
    text, ids, finish, usage = "", [], None, None
    for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body=dict(LONG, **FRESH)):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text += c.delta.content or ""
            ids += c.model_extra.get("token_ids") or []
            finish = c.finish_reason or finish
    assert text == full.choices[0].message.content
    assert ids == ids_of(full.choices[0])
    assert finish == "length" and usage.completion_tokens == 24

    full = client.completions.create(model="tiny", prompt="Once upon", max_tokens=20, temperature=0,
                                     extra_body=dict(LONG, **FRESH))
    parts = list(client.completions.create(model="tiny", prompt="Once upon", max_tokens=20,
                                           temperature=0, stream=True,
                                           extra_body=dict(LONG, **FRESH)))
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text
    assert sum((p.choices[0].model_extra["token_ids"] for p in parts), []) == ids_of(full.choices[0])
    assert parts[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text(client):
    args = dict(model="tiny", prompt="Tell me a story", max_tokens=48, temperature=0)
    base = client.completions.create(**args, extra_body=dict(LONG, **FRESH)).choices[0]
    text = base.text
    # a stop string that first occurs after the start, made of stable characters
    stop = next(text[i:i + 3] for i in range(1, len(text) - 3)
                if "\ufffd" not in text[i:i + 3] and text.find(text[i:i + 3]) == i)
    want = text[:text.find(stop)]
    r = client.completions.create(**args, stop=[stop, "never-there"], extra_body=dict(LONG, **FRESH))
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 48
    streamed = list(client.completions.create(**args, stop=stop, stream=True,
                                              extra_body=dict(LONG, **FRESH)))
    assert "".join(p.choices[0].text for p in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    args = dict(model="tiny", prompt="Pick a word", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(**args, seed=1234, extra_body=dict(LONG, **FRESH)).choices[0]
    b = client.completions.create(**args, seed=1234, extra_body=dict(LONG, **FRESH)).choices[0]
    c = client.completions.create(**args, seed=99, extra_body=dict(LONG, **FRESH)).choices[0]
    assert ids_of(a) == ids_of(b) and a.text == b.text
    assert ids_of(a) != ids_of(c)


def test_token_ids_equal_those_of_serve(model, client):
    prompt = [17, 300, 42, 9, 128, 77, 5, 260, 311, 2]
    s = ServeSession(model, *RANK_ARGS, env=ENV)
    try:
        greedy = s.gen(prompt, 24)
        sampled = s.gen(prompt[::-1], 24, "temperature=0.8 seed=7")
    finally:
        s.close()
    assert greedy["err"] is None and sampled["err"] is None
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body=FRESH)
    assert ids_of(r.choices[0]) == greedy["tokens"]
    r = client.completions.create(model="tiny", prompt=prompt[::-1], max_tokens=24, temperature=0.8,
                                  seed=7, extra_body=FRESH)
    assert ids_of(r.choices[0]) == sampled["tokens"]


# ---- bad input ------------------------------------------------------------------------------------

def test_bad_input_is_400_with_an_openai_error(server, client):
    url, h = server.url, server.headers

    def post(path, content, **kw):
        return httpx.post(url + path, content=content, timeout=10,
                          headers=dict(h, **{"content-type": "application/json"}), **kw)

    for path in ("/v1/completions", "/v1/chat/completions"):
        r = post(path, b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert post(path, b"[1, 2]").status_code == 400
    cases = [
        ({"model": "gpt-5", "prompt": "hi"}, "model_not_found"),
        ({"prompt": "hi"}, "missing_required_parameter"),
        ({"model": "tiny", "prompt": [1] * 5000}, "context_length_exceeded"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, "invalid_value"),
        ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, "invalid_type"),
        ({"model": "tiny", "prompt": "hi", "top_p": 0}, "invalid_value"),
        ({"model": "tiny", "prompt": [1, 2, 99999]}, "invalid_value"),
        ({"model": "tiny", "prompt": "hi", "n": 0}, "invalid_value"),
        ({"model": "tiny", "prompt": "hi", "stop": 5}, "invalid_type"),
        ({"model": "tiny", "prompt": ""}, "invalid_value"),
        ({"model": "tiny", "prompt": "hi", "top_k": 10 ** 30}, "invalid_value"),
        ({"model": "tiny", "prompt": "hi", "stop": ["x" * 100_000] * 16}, "invalid_value"),
        ({"model": "tiny", "prompt": "a\ud800b"}, "invalid_value"),     # not valid Unicode
    ]
    for body, code in cases:
        r = post("/v1/completions", json.dumps(body).encode())
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"]
    # client input that used to be a 500 (and a dropped connection)
    for content in (b"[" * 20_000 + b"]" * 20_000,              # nested deeper than a parser goes
                    b'{"model": "tiny", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}"):
        r = post("/v1/completions", content)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    for key in ("add_generation_prompt", "tools", "messages"):
        r = post("/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
             "chat_template_kwargs": {key: True}}).encode())
        assert r.status_code == 400 and key in r.json()["error"]["message"], r.text
    r = post("/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "x\udcff"}]}).encode())
    assert r.status_code == 400 and "Unicode" in r.json()["error"]["message"], r.text
    r = post("/v1/chat/completions", json.dumps({"model": "tiny", "messages": []}).encode())
    assert r.status_code == 400
    r = post("/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}).encode())
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-5)
    assert httpx.get(url + "/v1/nothing", headers=h, timeout=10).status_code == 404
    assert httpx.get(url + "/v1/completions", headers=h, timeout=10).status_code == 405
    # nothing crashed: the server still answers
    r = client.completions.create(model="tiny", prompt="still here", max_tokens=2, extra_body=LONG)
    assert r.usage.completion_tokens == 2


# ---- queue, disconnects, concurrency ---------------------------------------------------------------

def _wait_running(server, want: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        q = status(server)["queue"]
        if q["running"] + q["waiting"] >= want:
            return
        time.sleep(0.02)
    raise AssertionError(f"expected {want} requests in the server, status {status(server)['queue']}")


def test_disconnect_cancels_the_generation(server, client):
    before = status(server)["requests"]
    stream = client.completions.create(model="tiny", prompt="A long story", max_tokens=4000,
                                       stream=True, extra_body=LONG)
    got = 0
    for _chunk in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    t0 = time.monotonic()
    r = client.completions.create(model="tiny", prompt="quick", max_tokens=4, extra_body=LONG)
    assert r.usage.completion_tokens == 4
    assert time.monotonic() - t0 < 4.0      # 4000 tokens would take far longer
    after = status(server)["requests"]
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] == 4   # the cancelled one is not counted

    # a non-streaming client that gives up is noticed too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=server.headers,
                   json={"model": "tiny", "prompt": "long", "max_tokens": 4000, **LONG},
                   timeout=httpx.Timeout(10.0, read=0.5))
    t0 = time.monotonic()
    while status(server)["requests"]["requests_cancelled"] != before["requests_cancelled"] + 2:
        assert time.monotonic() - t0 < 3.0, status(server)["requests"]
        time.sleep(0.02)
    assert status(server)["queue"]["running"] == 0


def test_queue_full_answers_429(server, client):
    with httpx.Client(timeout=30) as http:
        running = long_stream(server, http)
        assert running.status_code == 200
        _wait_running(server, 1)
        queued = [long_stream(server, http) for _ in range(2)]    # --queue-size 2
        _wait_running(server, 3)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny", prompt="one too many", max_tokens=2)
        assert e.value.code == "queue_full"
        r = http.post(f"{server.url}/v1/chat/completions", headers=server.headers,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1   # admission tests: its value
        for s in [running] + queued:
            s.close()
    # the server notices the three disconnects: the running generation is cancelled and the
    # waiting two leave the queue without running
    t0 = time.monotonic()
    while {k: v for k, v in status(server)["queue"].items() if k != "sessions"} != {
            "waiting": 0, "capacity": 2, "running": 0}:
        assert time.monotonic() - t0 < 3.0, status(server)["queue"]
        time.sleep(0.02)
    assert all(s["request"] is None for s in status(server)["queue"]["sessions"])
    r = client.completions.create(model="tiny", prompt="after the rush", max_tokens=3, extra_body=LONG)
    assert r.usage.completion_tokens == 3 and time.monotonic() - t0 < 4.0


def test_fifty_concurrent_clients(server, client):
    def one(i: int) -> int:
        with httpx.Client(timeout=45) as http:
            r = http.post(f"{server.url}/v1/completions", headers=server.headers,
                          json={"model": "tiny", "prompt": f"client {i}", "max_tokens": 4, **LONG})
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 4
            else:
                assert r.json()["error"]["code"] == "queue_full"
            return r.status_code

    with cf.ThreadPoolExecutor(50) as pool:
        codes = list(pool.map(one, range(50), timeout=50))
    assert len(codes) == 50 and set(codes) <= {200, 429} and 200 in codes
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = client.completions.create(model="tiny", prompt="after fifty", max_tokens=2, extra_body=LONG)
    assert r.usage.completion_tokens == 2


# ---- observability ---------------------------------------------------------------------------------

def test_metrics_parse_and_count(server, client):
    m0 = metrics(server)
    prompt = [9, 8, 7, 6, 5]
    client.completions.create(model="tiny", prompt=prompt, max_tokens=5, extra_body=LONG)
    m1 = metrics(server)
    # the ranks' own counters arrive with the next stats round (at most a few seconds)
    steps = "strata_rank_counter_total{name=tokens,rank=0}"
    t0 = time.monotonic()
    while m1.get(steps, 0) <= m0.get(steps, 0):
        assert time.monotonic() - t0 < 6.0, "no rank counters in /metrics"
        time.sleep(0.1)
        m1 = metrics(server)
    assert m1["strata_generated_tokens_total"] - m0["strata_generated_tokens_total"] == 5
    assert m1["strata_prompt_tokens_total"] - m0["strata_prompt_tokens_total"] == len(prompt)
    assert m1["strata_requests_total{outcome=ok}"] == m0["strata_requests_total{outcome=ok}"] + 1
    assert m1["strata_queue_depth"] == 0 and m1["strata_queue_capacity"] == 2
    assert m1["strata_ready"] == 1
    assert m1["strata_decode_tokens_per_second"] > 0
    for rank in ("0", "1", "2"):
        assert m1[f"strata_device_memory_used_bytes{{device=cpu,rank={rank},source=rss}}"] > 0
        assert m1[f"strata_device_memory_total_bytes{{device=cpu,rank={rank}}}"] == 2 ** 30
        assert m1[f"strata_rank_allocated_bytes{{kind=helper,rank={rank}}}"] > 0
        assert (m1[f"strata_rank_allocated_bytes{{kind=weights,rank={rank}}}"] > 0) == (rank != "2")
    rates: dict[str, float] = {}
    for k, v in m1.items():
        if k.startswith("strata_expert_hit_rate{"):
            assert 0.0 <= v <= 1.0
            rank = k.split("rank=")[1].split(",")[0].rstrip("}")
            rates[rank] = rates.get(rank, 0.0) + v
    for rank, total in rates.items():      # the tiers' shares of a rank's lookups add up to one
        assert abs(total - 1.0) < 1e-9, (rank, total)


def test_status_shows_the_plan_and_allocations(server):
    s = status(server)
    assert s["state"] == "ready" and s["model"]["id"] == "tiny"
    plan = s["plan"]
    assert [(st["lb"], st["le"]) for st in plan["stages"]] == [(0, 2), (2, 4)]
    # one entry per device: a card that runs a stage and hosts a helper tier is one entry
    assert [(r["rank"], r["role"]) for r in s["ranks"]] == [(0, "stage+helper"), (1, "stage+helper"),
                                                           (2, "helper")]
    helpers = {plan["devices"][h["device"]]["index"]: h for h in plan["helpers"] if not h["skipped"]}
    for r, st in zip(s["ranks"], plan["stages"]):
        assert (r["lb"], r["le"]) == (st["lb"], st["le"])
        assert r["allocated_bytes"]["weights"] == st["weights_bytes"]
        assert r["allocated_bytes"]["session"] == st["session_bytes"]
        assert r["bytes"]["expert_cache"] == st["cache_bytes"] and r["expert_slots"] == 4
    for r in s["ranks"]:
        assert r["bytes"]["helper"] == helpers[r["rank"]]["bytes"] > 0
        assert r["helper_slots"] == helpers[r["rank"]]["slots"]
        assert r["memory"]["source"] == "rss" and r["memory"]["total_bytes"] == 2 ** 30
    assert s["ranks"][2]["lb"] is None and s["ranks"][2]["bytes"]["weights"] == 0
    assert s["totals"]["expert_slots"] == plan["expert_slots"]


@pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                    reason="Debian chromium and chromium-driver are not installed (.ci/run installs them)")
def test_monitor_page_in_chromium(server, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--disable-quic", f"--user-data-dir={tmp_path / 'profile'}",
                 "--window-size=1280,800"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        driver.set_page_load_timeout(20)
        driver.get(f"{server.url}/?api_key={KEY}")
        WebDriverWait(driver, 20).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, ".card")) == 3
            and d.find_element(By.CSS_SELECTOR, '.card[data-rank="2"] [data-field="mem_used"]').text)
        s = status(server)
        for r in s["ranks"]:
            card = driver.find_element(By.CSS_SELECTOR, f'.card[data-rank="{r["rank"]}"]')
            def field(f, card=card):
                return card.find_element(By.CSS_SELECTOR, f'[data-field="{f}"]').text
            assert field("role") == r["role"]
            assert field("layers") == (f"[{r['lb']}, {r['le']})" if r["lb"] is not None
                                       else "none (helper)")
            for k in ("weights", "kv", "prompt_loan", "expert_cache", "helper"):
                assert field(k) == f"{r['bytes'][k] / 2 ** 20:.1f}", k
            assert field("mem_total") == f"{r['memory']['total_bytes'] / 2 ** 20:.1f}"
            assert float(field("mem_used")) > 0
        assert driver.find_element(By.ID, "state").text.startswith("ready")
        shot = os.environ.get("STRATA_MONITOR_SCREENSHOT") or str(tmp_path / "monitor.png")
        assert driver.save_screenshot(shot)
    finally:
        driver.quit()
