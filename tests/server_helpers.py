"""Driving a real `strata-launch --port 0` (real rank processes, real HTTP) from tests."""
from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time

import httpx

from launch_helpers import wait_or_kill

_URL_RE = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    """A strata-launch HTTP server on a free port. `url` is known as soon as it listens (before
    the ranks have loaded); the constructor returns once /health answers 200, or right after
    the listen line when `wait=False` (ranks started by hand come later)."""

    def __init__(self, model: str, *args: str, api_key: str | None = None, env: dict | None = None,
                 timeout: float = 60.0, wait: bool = True, api_key_file: str | None = None):
        argv = [sys.executable, "-m", "launcher.cli", "--model", model, "--port", "0", *args]
        if api_key and api_key_file:      # the key reaches the server through a file
            with open(api_key_file, "w") as f:
                f.write(api_key + "\n")
            argv += ["--api-key-file", api_key_file]
        elif api_key:
            argv += ["--api-key", api_key]
        self.api_key = api_key
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1,
                                     env=dict(os.environ, **(env or {})))
        self.stderr: list[str] = []
        self._lines: "queue.Queue[str | None]" = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        threading.Thread(target=lambda: self.proc.stdout.read(), daemon=True).start()
        self.url = self._wait_for(_URL_RE, timeout).group(1)
        if wait:
            self.wait_ready(timeout)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def _wait_for(self, pattern: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"strata-launch printed no {pattern.pattern!r} within {timeout} s; "
                                   f"stderr: {self.err_text()[-2000:]}")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise EOFError(f"strata-launch ended (code {self.proc.poll()}); stderr: "
                               f"{self.err_text()[-2000:]}")
            m = pattern.search(line)
            if m:
                return m

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise EOFError(f"strata-launch ended (code {self.proc.poll()}); stderr: "
                                   f"{self.err_text()[-2000:]}")
                if c.get(f"{self.url}/health").status_code == 200:
                    return
                time.sleep(0.05)
        raise TimeoutError(f"not ready within {timeout} s; stderr: {self.err_text()[-2000:]}")

    def err_text(self) -> str:
        return "".join(self.stderr)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        import openai
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", **kw)

    def close(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return wait_or_kill(self.proc, timeout)


