"""Chat prompts rendered in child processes (strata_dist/gguf_file/template_sandbox.py), each render bounded in
time, output and memory and cancelled when its client leaves.

The template comes from the model file (`tokenizer.chat_template`; ChatML when it has none), so it
is treated as hostile: a render that passes its deadline, or whose client went away, ends with its
child killed (a thread running a template cannot be stopped), and the next render starts a fresh
one. Idle children are kept for the next request, up to `max_children` at a time."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Callable

from ..gguf_file.template_sandbox import TemplateError

RENDER_TIMEOUT_S = 1.0         # a chat template renders in milliseconds; past this it is refused
CHILD_MEMORY_BYTES = 512 * 2 ** 20
CHILD_START_TIMEOUT_S = 30.0   # a Python interpreter and jinja2 on a busy machine
WAIT_FOR_CHILD_S = 30.0        # every child busy: a request waits this long for one
# ...and past this many waiting, a request is refused at once: each waits on one of the HTTP
# server's worker threads, which other requests need too
MAX_WAITING = 8
POLL_S = 0.02                  # how often a waiting render looks at its cancel flag


class TemplateLimit(TemplateError):
    """A render stopped by a bound: `kind` is time, output or memory."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class RenderCancelled(Exception):
    """The client went away while its prompt rendered."""


class RenderUnavailable(Exception):
    """No child could render (all busy past the wait, or one could not start)."""


class RenderBusy(RenderUnavailable):
    """Every child busy and the wait list full, or the wait ran out: the server is loaded, not
    broken, so the request is refused as a full queue's is (429), to be retried."""


class _Child:
    def __init__(self, source: str, memory_bytes: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata_dist.gguf_file.template_sandbox", str(memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)   # Ctrl-C on the terminal is the launcher's to handle
        self.buf = b""
        try:
            self.send({"source": source})
            ready = self.read(time.monotonic() + CHILD_START_TIMEOUT_S, None, 1 << 20)
        except BaseException:
            self.kill()
            raise
        if "error" in ready:
            self.kill()
            raise TemplateError(ready["error"])

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
                              + b"\n")
        self.proc.stdin.flush()

    def read(self, deadline: float, cancelled: Callable[[], bool] | None, max_bytes: int) -> dict:
        """One reply line, or TimeoutError at `deadline` / RenderCancelled when `cancelled()`."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            if cancelled is not None and cancelled():
                raise RenderCancelled()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError()
            ready, _, _ = select.select([fd], [], [], min(left, POLL_S))
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError(f"the template child exited (code {self.proc.poll()})")
            self.buf += chunk
            if len(self.buf) > max_bytes:
                raise EOFError("the template child answered more than it may")
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


class TemplateRenderer:
    """Renders one template source for many requests (thread-safe)."""

    def __init__(self, source: str, timeout_s: float = RENDER_TIMEOUT_S, max_children: int = 4,
                 memory_bytes: int = CHILD_MEMORY_BYTES):
        self.source, self.timeout_s, self.max_children = source, timeout_s, max_children
        self.memory_bytes = memory_bytes
        self.idle: list[_Child] = []
        self.busy = 0
        self.waiting = 0
        self.cond = threading.Condition()
        self.closed = False
        self.counts = {"rendered": 0, "failed": 0, "timed_out": 0, "cancelled": 0,
                       "output_limit": 0, "memory_limit": 0}

    def warm(self) -> None:
        """Start one child ahead of the first request (in the background)."""
        def start():
            try:
                child = _Child(self.source, self.memory_bytes)
            except (OSError, EOFError, TimeoutError, ValueError):
                child = None   # the first request starts one and reports why
            self._put_back(child)
        with self.cond:
            self.busy += 1
        threading.Thread(target=start, name="template-warm", daemon=True).start()

    def _take(self, cancelled: Callable[[], bool] | None) -> _Child | None:
        """An idle child, or None when the caller may start one (its place is reserved)."""
        deadline = time.monotonic() + WAIT_FOR_CHILD_S
        with self.cond:
            if not self.idle and self.busy >= self.max_children and self.waiting >= MAX_WAITING:
                raise RenderBusy(f"all {self.max_children} chat-template renderers are "
                                        f"busy and {self.waiting} requests wait for one")
            self.waiting += 1
            try:
                while True:
                    if cancelled is not None and cancelled():
                        raise RenderCancelled()
                    if self.closed:
                        raise RenderUnavailable("the server is stopping")
                    if self.idle:
                        self.busy += 1
                        return self.idle.pop()
                    if self.busy < self.max_children:
                        self.busy += 1
                        return None
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RenderBusy(f"all {self.max_children} chat-template renderers "
                                                f"stayed busy for {WAIT_FOR_CHILD_S:.0f} s")
                    self.cond.wait(min(left, POLL_S * 5))
            finally:
                self.waiting -= 1

    def _put_back(self, child: _Child | None) -> None:
        with self.cond:
            self.busy -= 1
            if child is not None:
                if self.closed:
                    child.kill()
                else:
                    self.idle.append(child)
            self.cond.notify()

    def _count(self, key: str) -> None:
        with self.cond:
            self.counts[key] += 1

    def render(self, context: dict, max_chars: int,
               cancelled: Callable[[], bool] | None = None) -> str:
        """The prompt text. TemplateError when the template fails on these messages, TemplateLimit
        past a bound (time, output, memory), RenderCancelled when `cancelled()` turns true,
        RenderUnavailable when no child can render."""
        try:
            child = self._take(cancelled)
        except RenderCancelled:
            self._count("cancelled")
            raise
        keep = False
        try:
            reused = child is not None
            if child is None:
                child = self._start()
            request = {"context": context, "max_chars": max_chars,
                       "alarm_s": self.timeout_s * 2 + 1}
            try:
                try:
                    child.send(request)
                except OSError:
                    if not reused:
                        raise
                    child.kill()             # an idle child that died (killed from outside)
                    child = None
                    child = self._start()
                    child.send(request)
                reply = child.read(time.monotonic() + self.timeout_s, cancelled,
                                   6 * max_chars + (1 << 20))
            except TimeoutError:
                self._count("timed_out")
                raise TemplateLimit("time", f"the chat template did not finish within "
                                            f"{self.timeout_s:g} s") from None
            except RenderCancelled:
                self._count("cancelled")
                raise
            except (OSError, EOFError, ValueError) as e:
                self._count("failed")
                raise TemplateLimit("memory", f"the chat template's renderer failed: {e}") from None
            if "text" in reply:
                keep = True
                self._count("rendered")
                return reply["text"]
            kind = reply.get("kind")
            if kind == "template":
                keep = True
                self._count("failed")
                raise TemplateError(reply["error"])
            self._count("output_limit" if kind == "output" else "memory_limit")
            raise TemplateLimit("output" if kind == "output" else "memory", reply["error"])
        finally:
            if child is not None and not keep:
                child.kill()
            self._put_back(child if keep else None)

    def _start(self) -> _Child:
        try:
            return _Child(self.source, self.memory_bytes)
        except TemplateError:        # the file's template does not parse
            self._count("failed")
            raise
        except (OSError, EOFError, TimeoutError, ValueError) as e:
            raise RenderUnavailable(f"the chat-template renderer did not start: "
                                    f"{e or type(e).__name__}") from None

    def stats(self) -> dict:
        with self.cond:
            return dict(self.counts, idle=len(self.idle), busy=self.busy, waiting=self.waiting,
                        timeout_s=self.timeout_s)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            idle, self.idle = self.idle, []
            self.cond.notify_all()
        for child in idle:
            child.kill()
