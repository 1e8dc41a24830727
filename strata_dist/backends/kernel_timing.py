"""Every kernel of one eager decode-graph step timed on the GPU (backends/cuda_decode.py
DecodeGraph: `kernel_times` for a one-session step, `replay_kernel_times` for one replay of a
batched step; benchmarks/profile_decode.py prints both).

Each launch sits between two CUDA events. The launches are queued behind a `spin` kernel that
holds the stream while Python queues them, so they run back to back as they would in a graph, and
the events time the GPU, not Python's launch overhead."""
from __future__ import annotations

from typing import Callable

import numpy as np
import cupy as cp

from ..kernels import function

SPIN_SOURCE = "decode.cu"         # where `spin` is (cuda_decode.KERNELS)
HOLD_NS_PER_LAUNCH = 20_000       # ~what Python takes to queue a launch, with room to spare
LAUNCHES_PER_LAYER = 12           # a layer's launches, rounded up (the step's others: 8)


class KernelTimer:
    """The timed launches of one step: `wrap` gives a kernel that records its launch (run
    `repeat` times in a row) between two events; `sums` adds them up per kernel name."""

    def __init__(self, stream, repeat: int):
        if repeat < 1:
            raise ValueError(f"a timed launch runs at least once, got repeat={repeat}")
        self.stream, self.repeat = stream, repeat
        self.records: list[tuple[str, object, object]] = []

    def wrap(self, name: str, fn):
        def timed(grid, block, args, shared_mem=0):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(self.stream)
            for _ in range(self.repeat):
                fn(grid, block, args, shared_mem=shared_mem)
            end.record(self.stream)
            self.records.append((name, start, end))
        return timed

    def sums(self) -> dict[str, float]:
        """Microseconds per kernel name (the mean of a launch's repeats), summed over its
        launches; waits for the last event."""
        out: dict[str, float] = {}
        if self.records:
            self.records[-1][2].synchronize()
        for name, start, end in self.records:
            us = cp.cuda.get_elapsed_time(start, end) * 1e3 / self.repeat
            out[name] = out.get(name, 0.0) + us
        return out


def time_step(runner, queue_step: Callable[[], None], repeat: int = 1) -> dict[str, float]:
    """Run `queue_step` (which queues one step of `runner` on runner.stream and waits for it)
    eagerly, with every launch made through runner._launch timed: microseconds per kernel name,
    summed over the layers. The graph setting and the timer are put back whatever happens."""
    runner.settle()
    timer = KernelTimer(runner.stream, repeat)
    use_graph, runner.use_graph, runner._timing = runner.use_graph, False, timer
    try:
        launches = 8 + LAUNCHES_PER_LAYER * (runner.le - runner.lb)
        hold_ns = HOLD_NS_PER_LAUNCH * repeat * launches
        with runner.stream:
            function(SPIN_SOURCE, "spin", runner.model.backend.index, runner.shape.defines())(
                (1,), (1,), (np.uint64(hold_ns),))
        queue_step()
        return timer.sums()
    finally:
        runner.use_graph, runner._timing = use_graph, None
