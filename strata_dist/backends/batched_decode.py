"""Batched decode steps of a GPU decode graph (backends/cuda_decode.py DecodeGraph): the next
tokens of several sessions, each at its own position, as the rows of one graph replay (at most
max_rows rows a replay; a larger batch takes several). Each row reads and writes its own session
through the step descriptor (backends/decode_rows.py), and no kernel of the step sums across rows
(the matvecs, the router, the experts and the attention each give a row the sums it would have
alone: tests/test_gpu_decode.py, tests/test_gpu_batched_decode.py), so a request's tokens do not
depend on who else is in the batch. Stage.run_batch asks `batch_replays` for the step's replays, then runs them
through `step_rows`."""
from __future__ import annotations

import numpy as np
import cupy as cp

from ..compute_options import fall_back
from .decode_rows import StepRows


class BatchedSteps:
    """DecodeGraph's batched steps (its buffers, `_launch_step` and `_wait`)."""

    def batch_replays(self, sessions, positions) -> list[StepRows] | None:
        """The replays of a batched step (row i: the next token of sessions[i] at positions[i]),
        max_rows rows each, checked, for `step_rows` to run; None if the graph cannot run the
        step now (the reason is logged, once per reason, and the general path runs it). A step
        launched ahead is settled first (it may still write a session's KV)."""
        self.settle()
        why, replays = None, []
        if self.g.arch != "qwen3moe":     # next_decode's recurrent kernels read slot 0's state
            why = f"{self.g.arch}'s recurrent state is read from one session's table"
        elif not self.usable(min(len(sessions), self.max_rows)):
            why = "the cache is lent to a prompt or a profile records routes"
        else:
            try:
                for at in range(0, len(sessions), self.max_rows):
                    replays.append(StepRows(tuple(sessions[at:at + self.max_rows]),
                                            tuple(positions[at:at + self.max_rows])))
                if any(r.end > r.session.max_cells for rows in replays for r in rows.runs()):
                    why = "a session's context is full"
            except ValueError as e:
                why = str(e)
        if why is None:
            return replays
        if why not in self._refused:
            self._refused.add(why)
            fall_back(f"a batched step on the decode graph of layers [{self.lb}, {self.le})",
                      why)
        return None

    def step_rows(self, replays: list[StepRows], ids=None, hidden=None):
        """A batched step of the replays `batch_replays` gave: row i of the step (the replays'
        rows in order) is its session's token at its position (ids on the first stage, else
        hidden rows [n, n_embd]), each row's arithmetic its own (the same as the row alone
        through `step`). Returns every row's logits (host float32 [n, vocab]) on the last stage,
        else the hidden rows (a device array). The caller advances the sessions' n_past."""
        self.settle()
        ids = self._checked_ids(ids)
        outs, routes, tiers = [], [], {"hits": 0, "remote": 0, "host": 0}
        at = 0
        for rows in replays:
            part = slice(at, at + rows.n)
            at += rows.n
            out = self._launch_step(rows, ids[part] if self.first else None,
                                    None if self.first else hidden[part], 0, every_row=True)
            self._wait(0, rows.n)
            outs.append(cp.asnumpy(self.logits_rows[:rows.n]) if self.last else out)
            for key, count in self.last_tiers.items():
                tiers[key] += count
            routes.append(self.last_routes)
        self.last_tiers = tiers
        self.last_routes = None if routes[0] is None else np.concatenate(routes, axis=1)
        return np.concatenate(outs) if self.last else cp.concatenate(outs)

    def report_step(self, counters, routing) -> None:
        """The last step's expert computations by tier (hits, host reads in place) into
        `counters` (a Counter), and its routes into `routing` (adapt.RoutingCounts, or None when
        the stage counts none) where they came back."""
        counters.update(self.last_tiers, graph_steps=1)
        if routing is not None and self.last_routes is not None:
            routing.add_layers(self.lb, self.last_routes)
