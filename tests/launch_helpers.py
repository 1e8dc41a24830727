"""Driving a real `strata-launch --serve` (real rank processes, real sockets) from tests."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time


class LineProcess:
    """A process speaking the --serve line protocol: stdout read line by line on a thread, stderr
    collected; every wait bounded."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        self.stderr: list[str] = []
        self.info: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def err(self) -> str:
        return "".join(self.stderr)

    def err_has(self, text: str, timeout: float = 10.0) -> bool:
        """Whether stderr shows `text` within `timeout` (stderr is read on a thread: it may lag)."""
        deadline = time.monotonic() + timeout
        while text not in self.err():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def next_line(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no line within {timeout} s; stderr: {self.err()[-3000:]}") from None
        if line is None:
            raise EOFError(f"process ended (code {self.proc.poll()}); stderr: {self.err()[-3000:]}")
        return line

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_ready(self, timeout: float) -> list[str]:
        """The INFO lines up to READY (kept in self.info)."""
        while True:
            line = self.next_line(timeout)
            if line.startswith("READY"):
                self.ctx = int(line.split()[1])
                return self.info
            if line.startswith("INFO"):
                self.info.append(line)

    def gen(self, ids: list[int], max_new: int, options: str = "", timeout: float = 60.0) -> dict:
        self.send(f"GEN {max_new} {options} {' '.join(map(str, ids))}".replace("  ", " "))
        out = {"tokens": [], "pp": [], "resume": None, "done": None, "err": None, "stats": []}
        while True:
            line = self.next_line(timeout)
            kind, _, rest = line.partition(" ")
            if kind == "T":
                out["tokens"].append(int(rest))
            elif kind == "PP":
                out["pp"].append(rest.split())
            elif kind == "STATS":
                out["stats"].append(dict(kv.split("=", 1) for kv in rest.split()))
            elif kind == "RESUME":
                out["resume"] = int(rest)
            elif kind == "DONE":
                out["done"] = rest.split()
                return out
            elif kind == "ERR":
                out["err"] = rest
                return out

    def stats(self, timeout: float = 30.0) -> dict[int, dict[str, str]]:
        """STATS: every rank's counters since start, by rank."""
        self.send("STATS")
        out = {}
        while True:
            line = self.next_line(timeout)
            if line == "STATS END":
                return out
            if line.startswith("STATS rank="):
                fields = dict(kv.split("=", 1) for kv in line.split()[1:])
                out[int(fields.pop("rank"))] = fields

    def info_fields(self) -> list[dict]:
        return [dict(kv.split("=", 1) for kv in line.split()[1:]) for line in self.info]

    def close(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            try:
                self.send("QUIT")
            except (BrokenPipeError, OSError):
                pass
        return wait_or_kill(self.proc, timeout)


def wait_or_kill(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for a process to end; kill it if it will not (bounded either way)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    return proc.returncode


class ServeSession(LineProcess):
    """strata-launch --serve with local ranks, started and waited for until READY. `cwd`: the
    launcher's working directory, which `python -m` puts first on sys.path (and its ranks
    inherit): another tree of the project there runs that tree's code (a relative `model` is
    made absolute first, so it names the same file)."""

    def __init__(self, model: str, *args: str, env: dict | None = None, timeout: float = 60.0,
                 cwd: str | None = None):
        if cwd is not None:
            model = os.path.abspath(model)
        argv = [sys.executable, "-m", "launcher.cli", "--model", model, "--serve", *args]
        super().__init__(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, bufsize=1,
                                          env=dict(os.environ, **(env or {})), cwd=cwd))
        self.wait_ready(timeout)


def gpu_split_session(model: str, split: str, chunk: int, max_context: int = 512,
                      timeout: float = 120.0) -> ServeSession:
    """`strata-launch --serve` with one GPU rank per stage of `split` (a --layer-split; "" for one
    stage), every rank on GPU 0 (a one-GPU machine tests pipelines so)."""
    n = len(split.split(",")) + 1 if split else 1
    args = ["--gpus", ",".join(["0"] * n), "--prefill", str(chunk), "--max-context",
            str(max_context), "--gpu-order", "as_given"]
    return ServeSession(model, *args, *(["--layer-split", split] if split else []),
                        timeout=timeout)


def launcher_children(pid: int) -> list[int]:
    """PIDs of the strata-rank children of a launcher process (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and b"strata_dist.rank.main" in cmd:
            pids.append(int(entry))
    return sorted(pids)


def rank_pids(session: ServeSession) -> list[int]:
    return launcher_children(session.proc.pid)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def generate_killing(session: ServeSession, ids: list[int], max_new: int, pid: int,
                     after: int = 5, timeout: float = 60.0) -> list[int]:
    """The tokens of one GEN request during which process `pid` is killed (SIGKILL) once `after`
    tokens have arrived; an ERR line fails the caller's test."""
    session.send(f"GEN {max_new} {' '.join(map(str, ids))}")
    tokens = []
    line = session.next_line(timeout)
    while not line.startswith("DONE"):
        assert not line.startswith("ERR"), line
        if line.startswith("T "):
            tokens.append(int(line[2:]))
            if len(tokens) == after:
                os.kill(pid, signal.SIGKILL)
        line = session.next_line(2 * timeout)
    return tokens

