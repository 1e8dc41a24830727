"""The Monitor as a person sees it: a real `strata-launch --port` on CPU ranks, loaded by real HTTP
clients for a few seconds, then the page in headless Chromium: charts drawn from the server's
history (a freshly opened page shows the past at once), the placement (one box per card with its
layers), the request list, the predicted and measured ms/token side by side, idle shown as idle.
The screenshot's pixels are read back to check the charts were drawn."""
from __future__ import annotations

import concurrent.futures as cf
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import ServerProcess, tiny_model_fixture
from strata_dist.server.history import RECENT_REQUESTS, StatusHistory
from strata_dist.server.worker import Worker
from strata_dist.gguf_file.tokenizer import GGUFTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from monitor_screenshot import headless_chromium  # noqa: E402

KEY = "sk-monitor-3c9a"
# two stages and a helper-only card (test_server.py's layout): every card hosts a helper tier
RANK_ARGS = ("--cpu-ranks", "3", "--layer-split", "2", "--vram-budget", "1G", "--max-context", "4096",
             "--gpu-order", "as_given", "--queue-size", "4")
ENV = {"STRATA_STAGE_CACHE_SLOTS": "4"}
LOAD_S = 5.0
HAS_CHROMIUM = bool(shutil.which("chromium") and shutil.which("chromedriver"))

pytestmark = pytest.mark.timeout(90)


model = tiny_model_fixture("monitor", popularity="zipf:1.0")


@pytest.fixture(scope="module")
def loaded(model):
    """The server after LOAD_S seconds of requests from two clients; the replies, in order."""
    s = ServerProcess(model, *RANK_ARGS, api_key=KEY, env=ENV)
    replies: list[dict] = []
    end = time.monotonic() + LOAD_S

    def client(n: int) -> list[dict]:
        out = []
        with httpx.Client(timeout=30.0, headers=s.headers) as c:
            i = 0
            while time.monotonic() < end:
                i += 1
                body = {"model": "tiny", "prompt": "word " * (3 + 5 * ((i + n) % 7)),
                        "max_tokens": 8 + 6 * (i % 5), "ignore_eos": True, "cache_prompt": False}
                r = c.post(f"{s.url}/v1/completions", json=body)
                if r.status_code == 200:
                    out.append(r.json())
                else:
                    assert r.status_code == 429, r.text     # the queue bound, nothing else
                time.sleep(0.03 * (i % 4))
        return out

    with cf.ThreadPoolExecutor(2) as pool:
        for got in pool.map(client, range(2)):
            replies.extend(got)
    yield s, replies
    assert s.close() in (0, 130, -signal.SIGTERM)


def get(server, path: str) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", headers=server.headers, timeout=10)


def wait_idle(server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = get(server, "/v1/status").json()
        if s["throughput"]["idle"]:
            return s
        assert time.monotonic() < deadline, s["throughput"]
        time.sleep(0.2)


def test_history_ring_is_bounded(model):
    worker = Worker(GGUFTokenizer.from_gguf(model), ctx=256, n_vocab=512, queue_size=2)
    history = StatusHistory(worker, lambda: None, every_s=1.0, keep_s=3.0)
    for _ in range(5):
        history.sample()
        time.sleep(0.002)        # times are kept to the millisecond
    got = history.since()
    assert len(got) == 3 and [s["state"] for s in got] == ["loading"] * 3
    assert history.since(got[1]["t"]) == got[2:]
    with pytest.raises(ValueError, match="every_s"):
        StatusHistory(worker, lambda: None, every_s=0.0)


def test_history_goes_on_after_a_sample_fails(model):
    """One failed sample (a memory probe that raises) costs that second, not the charts."""
    worker = Worker(GGUFTokenizer.from_gguf(model), ctx=256, n_vocab=512, queue_size=2)

    class FlakyProbe:
        calls = 0

        def read(self, gauges):
            FlakyProbe.calls += 1
            if FlakyProbe.calls == 1:
                raise RuntimeError("the probe's first read fails")
            return {}

    probe = FlakyProbe()
    history = StatusHistory(worker, lambda: probe, every_s=0.05, keep_s=10.0)
    history.start()
    try:
        deadline = time.monotonic() + 10
        while len(history.since()) < 3:
            assert time.monotonic() < deadline and history.thread.is_alive(), FlakyProbe.calls
            time.sleep(0.02)
    finally:
        history.stop()


def test_history_samples_the_load(loaded):
    server, replies = loaded
    assert len(replies) >= 4
    h = get(server, "/v1/status/history").json()
    samples = h["samples"]
    assert h["every_s"] == 1.0 and h["keep_s"] >= 600
    assert len(samples) >= LOAD_S - 1, samples
    times = [s["t"] for s in samples]
    assert times == sorted(times) and all(0.5 < b - a < 2.5 for a, b in zip(times, times[1:])), times
    assert max(s["tokens_per_second"] for s in samples) > 0
    assert any(s["prompt_tokens_per_second"] for s in samples)
    assert any(s["running"] == 1 for s in samples)
    for s in samples:
        if s["state"] == "ready":
            assert set(s["memory_used_bytes"]) == {"0", "1", "2"}
            assert all(v > 0 for v in s["memory_used_bytes"].values())
    rated = [s["hit_rates"] for s in samples if s["hit_rates"]]
    assert rated, "no interval saw expert lookups"
    for rates in rated:     # the tiers' shares of one interval's lookups add up to one
        assert abs(sum(rates.values()) - 1.0) < 1e-3 and set(rates) <= {"stage", "helper", "host"}
    later = get(server, f"/v1/status/history?since={times[-2]}").json()["samples"]
    assert later and later[0]["t"] == times[-1]
    for bad in ("soon", "nan", "inf"):
        r = get(server, f"/v1/status/history?since={bad}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "since", r.text
        assert bad in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/status/history", timeout=10).status_code == 401


def test_status_lists_requests_and_prediction(loaded):
    server, replies = loaded
    s = wait_idle(server)
    rows = s["recent_requests"]
    by_id = {r["id"]: r for r in rows}
    totals = s["requests"]
    assert totals["requests_ok"] == len(replies)
    # the newest RECENT_REQUESTS of all that came (the refused ones too)
    assert len(rows) == min(RECENT_REQUESTS, totals["requests_ok"] + totals["requests_rejected"])
    assert {r["state"] for r in rows} <= {"done", "rejected"}
    shown = [rep for rep in replies if rep["id"].removeprefix("cmpl-") in by_id]  # the row's id
    assert len(shown) == sum(r["state"] == "done" for r in rows) > 0
    for rep in shown:
        row = by_id[rep["id"].removeprefix("cmpl-")]
        assert row["prompt_tokens"] == rep["usage"]["prompt_tokens"]
        assert row["generated_tokens"] == rep["usage"]["completion_tokens"]
        assert row["finish_reason"] == "length"
        timings = rep["timings"]
        assert row["tokens_per_second"] == timings["decode_tokens_per_second"]
        assert row["prompt_tokens_per_second"] == timings["prompt_tokens_per_second"]
    assert [r["number"] for r in rows] == sorted((r["number"] for r in rows), reverse=True)
    p = s["prediction"]
    assert p["predicted_ms_per_token"] == s["plan"]["predicted_ms_per_token"] > 0
    last_tps = s["throughput"]["last"]["decode_tokens_per_second"]
    assert p["measured_ms_per_token"] == pytest.approx(1000.0 / last_tps, rel=1e-3)
    assert p["measured_from"] == "last request"
    ratio = p["measured_ms_per_token"] / p["predicted_ms_per_token"]
    assert p["off_by"] == pytest.approx(ratio, rel=1e-3)
    assert p["flagged"] == (ratio > 2.0 or ratio < 0.5)
    # per card: the experts each layer keeps there, as the plan placed them
    plan = s["plan"]
    for r in s["ranks"]:
        want_cache = [0] * 4
        for st in plan["stages"]:
            if plan["devices"][st["device"]]["index"] == r["rank"]:
                for layer, _ in st["pairs"]:
                    want_cache[layer] += 1
        want_helper = [0] * 4
        for hp in plan["helpers"]:
            if plan["devices"][hp["device"]]["index"] == r["rank"] and not hp["skipped"]:
                for layer, _ in hp["pairs"]:
                    want_helper[layer] += 1
        assert r["experts_per_layer"] == {"cache": want_cache, "helper": want_helper}, r["rank"]


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:       # "idle"
        return False


def _pixels_like(png: bytes, box: dict, rgb: tuple[int, int, int], tol: int = 40) -> int:
    """How many pixels inside `box` (a DOM rect, CSS px = screenshot px here) are near `rgb`."""
    import io

    import numpy as np
    from PIL import Image
    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    x0, y0 = int(box["x"]), int(box["y"])
    crop = img[y0:y0 + int(box["height"]), x0:x0 + int(box["width"])]
    return int((np.abs(crop - np.array(rgb)) <= tol).all(axis=-1).sum())


@pytest.mark.skipif(not HAS_CHROMIUM,
                    reason="Debian chromium and chromium-driver are not installed (.ci/run installs them)")
def test_monitor_page_in_chromium(loaded, tmp_path):
    from PIL import Image, ImageStat
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server, replies = loaded
    s = wait_idle(server)
    driver = headless_chromium(str(tmp_path / "profile"), 1400, 1400)
    try:
        # opened after the load: the charts show it at once, from the server's history
        driver.get(f"{server.url}/?api_key={KEY}")
        points = lambda d, name: int(d.find_element(      # noqa: E731
            By.CSS_SELECTOR, f'[data-chart="{name}"] svg').get_attribute("data-points") or 0)
        WebDriverWait(driver, 15).until(lambda d: points(d, "tokens") > 1
                                        and len(d.find_elements(By.CSS_SELECTOR, "#placement g.place")) == 3)
        for name in ("tokens", "prompt", "hits", "queue", "memory"):
            assert points(driver, name) > 1, name
            svg = driver.find_element(By.CSS_SELECTOR, f'[data-chart="{name}"] svg')
            assert svg.find_elements(By.CSS_SELECTOR, "polyline.series, circle.point"), name
        # the placement: one box per card, its layers in words and in the layer strip
        boxes = {int(g.get_attribute("data-rank")): g.text
                 for g in driver.find_elements(By.CSS_SELECTOR, "#placement g.place")}
        assert "layers [0, 2)" in boxes[0] and "layers [2, 4)" in boxes[1], boxes
        assert "helper tier only" in boxes[2] and "helper tier 8 slots" in boxes[2], boxes
        for r in s["ranks"]:
            assert f"expert cache {r['expert_slots']} slots" in boxes[r["rank"]]
            segs = driver.find_elements(By.CSS_SELECTOR, f'#placement g.place[data-rank="{r["rank"]}"] rect.seg')
            assert {e.get_attribute("data-kind") for e in segs} == {k for k, v in r["bytes"].items() if v}
        # the request list: newest first, what the server counted
        WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#requests tbody tr[data-id]"))
        rows = driver.find_elements(By.CSS_SELECTOR, "#requests tbody tr[data-id]")
        newest = s["recent_requests"][0]
        cells = [c.text for c in rows[0].find_elements(By.TAG_NAME, "td")]
        assert cells[0] == str(newest["number"]) and cells[2].startswith(newest["state"])
        assert cells[3:5] == [str(newest["prompt_tokens"]), str(newest["generated_tokens"])]
        # idle is shown as idle, not as the last request's rate; the ms/token pair and its flag
        assert driver.find_element(By.ID, "tok_s").text == "idle"
        p = s["prediction"]
        assert driver.find_element(By.ID, "pred").text == f"{p['predicted_ms_per_token']:.3f}"
        assert driver.find_element(By.ID, "measured").text == f"{p['measured_ms_per_token']:.3f}"
        flag = driver.find_element(By.ID, "pred_flag")
        assert flag.is_displayed() == p["flagged"]
        if p["flagged"]:
            assert flag.text == f"measured is {p['off_by']:.1f}× the prediction"

        shot = tmp_path / "monitor.png"
        assert driver.save_screenshot(str(shot))
        png = shot.read_bytes()
        img = Image.open(shot)
        assert img.size[0] >= 1000
        assert ImageStat.Stat(img.convert("L")).stddev[0] > 10, "the screenshot is blank"
        # the generation chart's line is in the picture, in its colour (#4fb3ff)
        chart = driver.find_element(By.CSS_SELECTOR, '[data-chart="tokens"] svg').rect
        assert _pixels_like(png, chart, (0x4f, 0xb3, 0xff)) > 20

        # a running request: the header shows its rate, not "idle"
        body = {"model": "tiny", "prompt": "a long one", "max_tokens": 3000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers,
                          timeout=30) as stream:
            lines = stream.iter_lines()
            for _ in range(20):
                next(lines)
            # (a tick may fall before its second token: no rate yet, 0.0)
            WebDriverWait(driver, 10).until(
                lambda d: _positive(d.find_element(By.ID, "tok_s").text))
            WebDriverWait(driver, 10).until(
                lambda d: d.find_elements(By.CSS_SELECTOR, "#requests td.st-running"))
        # the client left: its row says so, with the tokens it got
        deadline = time.monotonic() + 10
        while (row := get(server, "/v1/status").json()["recent_requests"][0])["state"] != "cancelled":
            assert time.monotonic() < deadline, row
            time.sleep(0.1)
        assert row["prompt_tokens"] > 0 and 10 <= row["generated_tokens"] < 3000, row
    finally:
        driver.quit()


@pytest.mark.skipif(not HAS_CHROMIUM,
                    reason="Debian chromium and chromium-driver are not installed (.ci/run installs them)")
def test_sessions_show_each_running_request_in_status_and_the_page(model, tmp_path):
    """--parallel 2 with kept conversations: two streams at once, one restored from a kept
    conversation and one read whole. /v1/status's `queue.sessions` and the Monitor's sessions
    table show each: its request, its position (prompt and tokens so far), its tokens and rate,
    and where its prompt came from; an idle session shows as idle with what it holds."""
    import json
    import threading

    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = ServerProcess(model, "--cpu-ranks", "1", "--vram-budget", "1G", "--max-context",
                           "4096", "--parallel", "2", "--conversation-cache-mib", "4",
                           api_key=KEY)
    stop = threading.Event()
    try:
        def ask(prompt: list[int], n: int = 4) -> list[int]:
            r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=30,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": n,
                                 "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        a = [7, 8, 9] + list(range(20, 50))
        a_reply = ask(a)                           # A in one session
        ask(list(range(60, 90)))                   # B in the other
        ask(list(range(100, 130)))                 # C takes A's session: A is kept
        follow = a + a_reply + [5, 6, 7]           # continues A: restored from the kept copy
        fresh = list(range(140, 170))              # shares nothing: read whole
        ids: dict[str, str] = {}
        started = {name: threading.Event() for name in ("follow", "fresh")}

        def stream(name: str, prompt: list[int]) -> None:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4000, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                              headers=server.headers, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ids[name] = json.loads(line[6:])["id"].removeprefix("cmpl-")
                        started[name].set()
                    if stop.is_set():
                        return          # the client leaves: its request is cancelled

        threads = [threading.Thread(target=stream, args=("follow", follow), daemon=True)]
        threads[0].start()
        assert started["follow"].wait(30)
        threads.append(threading.Thread(target=stream, args=("fresh", fresh), daemon=True))
        threads[1].start()
        assert started["fresh"].wait(30)

        rows = get(server, "/v1/status").json()["queue"]["sessions"]
        by_request = {r["request"]: r for r in rows}
        assert set(by_request) == {ids["follow"], ids["fresh"]}, rows
        f, n = by_request[ids["follow"]], by_request[ids["fresh"]]
        assert (f["conversation"], f["cached_tokens"]) == ("kept", len(a) + len(a_reply) - 1)
        assert (n["conversation"], n["cached_tokens"]) == ("none", 0)
        for row, prompt in ((f, follow), (n, fresh)):
            # the prompt read, then a token more per token generated (read under one lock)
            assert row["tokens"] >= 1 and row["position"] == len(prompt) + row["tokens"], row
        assert {f["session"], n["session"]} == {0, 1}

        driver = headless_chromium(str(tmp_path / "profile"), 1400, 1400)
        try:
            driver.get(f"{server.url}/?api_key={KEY}")

            def cells(d, request: str) -> list[str]:
                found = d.find_elements(By.CSS_SELECTOR, f'#sessions tr[data-request="{request}"]')
                return [c.text for c in found[0].find_elements(By.TAG_NAME, "td")] if found else []
            # the page redraws its tables each poll: an element read as it is replaced goes
            # stale, so each wait reads the table again until one read holds whole
            stale = (StaleElementReferenceException,)
            got: dict[str, list[str]] = {}

            def both_rows(d) -> bool:
                got.update({name: cells(d, ids[name]) for name in ("follow", "fresh")})
                return all(got.values())
            WebDriverWait(driver, 15, ignored_exceptions=stale).until(both_rows)
            for name, prompt, conversation in (("follow", follow, "kept conversation restored"),
                                               ("fresh", fresh, "read whole")):
                c = got[name]
                assert c[1] == ids[name][:12] and c[6] == conversation, c
                assert int(c[2]) > len(prompt) and int(c[3]) >= 1 and float(c[4]) >= 0, c
            assert got["follow"][5] == str(len(a) + len(a_reply) - 1)
            WebDriverWait(driver, 10, ignored_exceptions=stale).until(
                lambda d: d.find_element(By.ID, "queue").text.endswith("+2 running"))
            stop.set()
            for t in threads:
                t.join(30)
            # both clients left: both sessions idle, each holding its conversation so far
            WebDriverWait(driver, 15, ignored_exceptions=stale).until(lambda d: [
                c.text for c in d.find_elements(By.CSS_SELECTOR, "#sessions td:nth-child(2)")]
                == ["idle", "idle"])
        finally:
            driver.quit()
        rows = get(server, "/v1/status").json()["queue"]["sessions"]
        assert all(r["request"] is None and r["position"] > 30 for r in rows), rows
    finally:
        stop.set()
        server.close()
