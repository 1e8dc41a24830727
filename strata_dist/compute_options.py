"""The compute options this process runs (protocol/compute_options.py), and the one module that
reads the STRATA_* compute variables from the environment.

Who reads them: the launcher, once at its start (it prints the record with the plan, keeps it in
the plan and sends it in every Assign); single-process tools (`strata-dist generate`, ...), once
at theirs (`installed(read_environment())`). A rank installs the record its Assign carried
(rank/shell.py) and never reads its own environment: `compute_options()` in a rank before that is an
error. Elsewhere (tests, benchmarks that build a backend directly) nothing is installed and each
call reads the environment as it is then, so a test may set a variable before it builds a backend.

A path a switch chose that falls back to another for a given input says so once, with the
condition that failed (`fall_back`)."""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator, Mapping

from protocol.compute_options import ComputeOptions, options_from_env

log = logging.getLogger("strata.compute")

_installed: list[ComputeOptions | None] = [None]
_rank_process = [False]


def read_environment(environ: Mapping[str, str] | None = None) -> ComputeOptions:
    """The record the STRATA_* compute variables of `environ` (default: this process's) give.
    Raises ValueError naming the variable and its value."""
    options = options_from_env(os.environ if environ is None else environ)
    if options.kernel_shape:
        from .kernels.abi import KernelShape     # pure Python: no CUDA here
        try:
            KernelShape.parse(options.kernel_shape)
        except (TypeError, ValueError) as e:
            raise ValueError(f"STRATA_KERNEL_SHAPE={options.kernel_shape!r}: {e}") from None
    return options


def install(options: ComputeOptions) -> None:
    """From now on this process runs `options` (a rank: its Assign's record)."""
    _installed[0] = options


@contextmanager
def installed(options: ComputeOptions) -> Iterator[ComputeOptions]:
    """`options` in force for the block (a tool's run), the previous state after it."""
    before = _installed[0]
    _installed[0] = options
    try:
        yield options
    finally:
        _installed[0] = before


def mark_rank_process() -> None:
    """This process is a rank: it runs only a record it was sent (compute_options() before the
    Assign installs one is an error, never a read of this host's environment)."""
    _rank_process[0] = True


def compute_options() -> ComputeOptions:
    """The record in force: the one installed, else (outside a rank) the environment's, read now."""
    options = _installed[0]
    if options is not None:
        return options
    if _rank_process[0]:
        raise RuntimeError("this rank has no compute options yet: they come with its Assign")
    return read_environment()


@lru_cache(maxsize=None)
def fall_back(path: str, reason: str) -> None:
    """Say once per process that `path` (a path a compute option chose) gave way to another for
    `reason` (the condition that failed)."""
    log.warning("%s falls back: %s", path, reason)


__all__ = ["compute_options", "fall_back", "install", "installed", "mark_rank_process",
           "read_environment"]
