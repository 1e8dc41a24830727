"""Local rank processes: spawn one `strata-rank` per device, watch them, stop them all.

Ranks run in their own process session, so a Ctrl-C at the terminal reaches only the launcher,
which then shuts them down in order; each rank also exits by itself when its launcher is gone
(--parent-pid), so no process outlives a launch however it ends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass
class RankSpec:
    index: int
    device: str                  # as the rank opens it: "cpu" or "cuda:0"
    visible_gpu: int | None      # CUDA_VISIBLE_DEVICES for a GPU rank (it sees only its card)
    vram_budget: str | None


THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def cpu_thread_env(n_cpu_ranks: int) -> dict[str, str]:
    """Share the cores among CPU ranks: BLAS pools that each take every core spin against each
    other and turn a sub-millisecond hand-off into tens of milliseconds. Set variables win."""
    if n_cpu_ranks == 0:
        return {}
    per = str(max(1, (os.cpu_count() or 1) // n_cpu_ranks))
    return {v: os.environ.get(v, per) for v in THREAD_VARS}


RESPAWN_MARK = b"\n--- the rank is started again to rejoin ---\n"   # in its log


class LocalRanks:
    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self._argv: list[tuple[list[str], dict]] = []   # how each was started (respawn)

    def spawn(self, spec: RankSpec, model: str, coordinator: str, data_bind: str,
              secret: str, extra_env: dict | None = None,
              extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
        argv = [sys.executable, "-m", "strata_dist.rank.main", "--coordinator", coordinator,
                "--model", model, "--device", spec.device, "--data-bind", data_bind,
                "--rank", str(spec.index), "--parent-pid", str(os.getpid()), *extra_args]
        if spec.vram_budget:
            argv += ["--vram-budget", spec.vram_budget]
        env = dict(os.environ, STRATA_TOKEN=secret, **(extra_env or {}))
        if spec.visible_gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(spec.visible_gpu)
        log_path = os.path.join(self.run_dir, f"rank-{spec.index}.log")
        self.logs.append(log_path)
        self._argv.append((argv, env))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def respawn(self, index: int) -> subprocess.Popen:
        """Start rank `index` again, as it was started (its log continues), once it has exited:
        the replacement registers with the same number and endpoints and rejoins."""
        if self.procs[index].poll() is None:
            raise RuntimeError(f"rank {index} (pid {self.procs[index].pid}) is still running")
        argv, env = self._argv[index]
        with open(self.logs[index], "ab") as log:
            log.write(RESPAWN_MARK)
            log.flush()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                    start_new_session=True)
        self.procs[index] = proc
        return proc

    def log_tail(self, index: int, lines: int = 6) -> str:
        """The last lines the rank's current process wrote (not those of one it replaced)."""
        try:
            with open(self.logs[index], "rb") as f:
                text = f.read()[-8192:].rsplit(RESPAWN_MARK, 1)[-1].decode("utf-8",
                                                                          errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def exited(self, index: int) -> bool:
        return self.procs[index].poll() is not None

    def death(self, index: int) -> str | None:
        """Why rank `index` is gone (with its last log lines), or None while it runs."""
        p = self.procs[index]
        code = p.poll()
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        tail = self.log_tail(index)
        return f"rank {index} (pid {p.pid}) {how}" + (f": {tail}" if tail else "")

    def first_dead(self, ignore: frozenset = frozenset()) -> str | None:
        """A message about the first rank process (not in `ignore`) that has exited."""
        for i in range(len(self.procs)):
            if i not in ignore and (why := self.death(i)) is not None:
                return why
        return None

    def stop(self, grace_s: float = 3.0) -> None:
        """Wait briefly for ranks that were told to shut down, then terminate, then kill."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            _wait(p, deadline)
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
            live = [p for p in self.procs if p.poll() is None]
            if not live:
                return
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + wait
            for p in live:
                _wait(p, deadline)


def _wait(p: subprocess.Popen, deadline: float) -> None:
    try:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
