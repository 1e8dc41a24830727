"""How strata-launch answers SIGINT, SIGTERM and SIGHUP: each stops the launch cleanly (every rank
stopped, the run directory removed, exit 130, no traceback). SIGHUP (the terminal closed) is a
stop like SIGTERM. Under --serve a SIGINT while a generation runs cancels that generation instead
(LineProtocol.interrupt); the next one, or one while idle, stops the launch.

This module imports nothing slow: launcher/cli.py installs `exit_at_once_while_starting` before its
own imports (about 0.2 s of them), so a Ctrl-C that early ends the process quietly too."""
from __future__ import annotations

import contextlib
import os
import signal
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_STOPPED = 130   # what the launcher has always exited with when stopped by a signal


def _exit_at_once(_signum, _frame) -> None:
    os._exit(EXIT_STOPPED)   # nothing is owned yet (no rank, no run directory): nothing to undo


def _ignored(sig) -> bool:
    """A signal this process was started ignoring: SIGHUP under nohup, SIGINT in a shell's
    background job. It stays ignored, as the one who started us asked."""
    return signal.getsignal(sig) is signal.SIG_IGN


def exit_at_once_while_starting() -> None:
    """Until main() installs StopSignals: a stop signal ends the process there and then. Raising
    instead would print a traceback from whichever import it interrupted."""
    for sig in STOP_SIGNALS:
        if not _ignored(sig):
            signal.signal(sig, _exit_at_once)


def detach_terminal() -> None:
    """After a hang-up, writing to the terminal fails (EIO): the standard streams that are a
    terminal are pointed at /dev/null, so the shutdown's messages cannot break the shutdown."""
    null = None
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                null = os.open(os.devnull, os.O_RDWR) if null is None else null
                os.dup2(null, fd)
        except OSError:
            pass
    if null is not None and null > 2:
        os.close(null)


class StopSignals:
    """The three stop signals raise KeyboardInterrupt (naming the signal) in the main thread, where
    the launcher's `finally` closes what it owns. `on_interrupt`, when set, is asked first about a
    SIGINT: True means it took it (a cancelled generation) and nothing is raised. Leaving the
    `with` block puts back the handlers that were there before. A signal the process was started
    ignoring (nohup's SIGHUP) stays ignored."""

    def __init__(self):
        self.on_interrupt: Callable[[], bool] | None = None
        self._before: dict = {}

    def __enter__(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            if not _ignored(sig):
                self._before[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self.on_interrupt is not None and self.on_interrupt():
            return
        if signum == signal.SIGHUP:
            detach_terminal()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @contextlib.contextmanager
    def held(self):
        """While the launch closes: another stop signal is ignored rather than cutting the close
        short (it is bounded: LocalRanks.stop waits a few seconds at most)."""
        for sig in self._before:
            signal.signal(sig, signal.SIG_IGN)
        try:
            yield
        finally:
            for sig in self._before:
                signal.signal(sig, self._on_signal)


__all__ = ["EXIT_STOPPED", "STOP_SIGNALS", "StopSignals", "detach_terminal",
           "exit_at_once_while_starting"]
