"""The Monitor under load, as a PNG: serves a model (default: the synthetic tiny one, on three CPU
ranks: two stages, every card with a helper tier), drives requests from two clients for `--seconds`
(so the queue fills now and then), then opens the page in headless Chromium and saves a full-page
screenshot. docs/images/monitor.png is made by

    python benchmarks/monitor_screenshot.py --seconds 70 --out docs/images/monitor.png

Needs Debian's chromium and chromium-driver (and selenium, from the test extra)."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import httpx

RANK_ARGS = ("--cpu-ranks", "3", "--layer-split", "2", "--vram-budget", "1G", "--max-context", "4096",
             "--gpu-order", "as_given")
READY_TIMEOUT_S = 90.0
WORDS = ("the quick brown fox jumps over the lazy dog while a small cat sits on a warm mat and "
         "watches the rain fall on the old stone wall").split()


def headless_chromium(profile_dir: str, width: int = 1400, height: int = 1600):
    """A Selenium driver for Debian's chromium, headless, with no network of its own."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--disable-quic", f"--user-data-dir={profile_dir}",
                 f"--window-size={width},{height}", "--hide-scrollbars"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    driver.set_page_load_timeout(20)
    return driver


def full_page_png(driver, path: str) -> None:
    """The whole page (the window grown to its height), saved as a PNG."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    width = driver.execute_script("return document.documentElement.scrollWidth")
    driver.set_window_size(max(width, 1400), height + 160)   # the window frame takes some
    time.sleep(1.5)                          # a redraw at the new size
    if not driver.save_screenshot(path):
        raise RuntimeError(f"chromium did not save {path}")


def start_server(model: str, log_path: str) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "launcher.cli", "--model", model, "--port", "0", *RANK_ARGS]
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                            env=dict(os.environ, STRATA_STAGE_CACHE_SLOTS="4"))
    deadline = time.monotonic() + READY_TIMEOUT_S
    url = None
    with httpx.Client(timeout=5.0) as c:
        while time.monotonic() < deadline and proc.poll() is None:
            if url is None:
                m = re.search(r"listening on (http://\S+)", open(log_path).read())
                url = m.group(1) if m else None
            elif c.get(f"{url}/health").status_code == 200:
                return proc, url
            time.sleep(0.1)
    proc.terminate()
    raise RuntimeError(f"the server did not get ready; its log: {open(log_path).read()[-2000:]}")


def drive(url: str, seconds: float, client_no: int, stop: threading.Event) -> int:
    """Requests of varied prompt and answer lengths, back to back, until `seconds` pass."""
    done, i = 0, 0
    end = time.monotonic() + seconds
    with httpx.Client(timeout=60.0) as c:
        while time.monotonic() < end and not stop.is_set():
            i += 1
            n = 4 + (i * 7 + client_no * 13) % 60
            prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 16 + (i * 29) % 112,
                    "ignore_eos": True, "temperature": 0.8, "cache_prompt": i % 3 != 0}
            r = c.post(f"{url}/v1/completions", json=body)
            if r.status_code == 200:
                done += 1
            elif r.status_code == 429:          # the queue is full: the chart shows it
                time.sleep(0.2)
            else:
                raise RuntimeError(f"request failed: {r.status_code} {r.text[:300]}")
            time.sleep(0.05 * (i % 5))          # bursts and pauses, so the charts move
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=70.0, help="how long to drive load first")
    ap.add_argument("--out", default="docs/images/monitor.png")
    ap.add_argument("--model", help="a GGUF model (default: the synthetic tiny one)")
    args = ap.parse_args(argv)
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        print("error: chromium and chromedriver are needed (apt-get install chromium chromium-driver)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from strata_dist.synth import write_synthetic
            model = os.path.join(tmp, "tiny.gguf")
            write_synthetic(model, like="tiny", quant="f32", popularity="zipf:1.0")
        proc, url = start_server(model, os.path.join(tmp, "server.log"))
        stop = threading.Event()
        try:
            counts: list[int] = []
            clients = [threading.Thread(target=lambda n=n: counts.append(drive(url, args.seconds, n, stop)))
                       for n in range(2)]
            for t in clients:
                t.start()
            # the page is opened while the load still runs, so the shot shows a running request
            time.sleep(max(args.seconds - 8, 0))
            driver = headless_chromium(os.path.join(tmp, "profile"))
            try:
                driver.get(f"{url}/")
                time.sleep(6)
                full_page_png(driver, args.out)
            finally:
                driver.quit()
            stop.set()
            for t in clients:
                t.join(70)
            print(f"{args.out}: {sum(counts)} requests in {args.seconds:.0f} s", file=sys.stderr)
        finally:
            stop.set()
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
