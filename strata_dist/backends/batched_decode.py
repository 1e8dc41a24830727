"""Batched decode steps of a GPU decode graph (backends/cuda_decode.py DecodeGraph): the next
tokens of several sessions, each at its own position, as the rows of one graph replay (at most
max_rows rows a replay; a larger batch takes several). Each row reads and writes its own session
through the step descriptor (backends/decode_rows.py), and no kernel of the step sums across rows
(the matvecs, the router, the experts and the attention each give a row the sums it would have
alone: tests/test_gpu_decode.py, tests/test_gpu_batched_decode.py), so a request's tokens do not
depend on who else is in the batch. Stage.run_batch asks `batch_replays` for the step's replays, then runs them
through `step_rows`. On the last stage the rows' logits stay on the card (BatchLogits): each row is
sampled there as a one-session step's row is, and only the greedy tokens come back; a step of
several replays launches them back to back, with no wait for the card between two."""
from __future__ import annotations

import numpy as np
import cupy as cp

from ..compute_options import fall_back
from .decode_rows import StepRows
from .step_slots import BatchLogits

GREEDY_THREADS = 1024      # sample_rows.cu greedy_rows: a block a row


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
        through `step`). Returns every row's logits on the last stage as a BatchLogits (kept on
        the card, each row's greedy token already on the host: the rows are sampled where they
        are, as a one-session step's row is), else the hidden rows (a device array). The caller
        advances the sessions' n_past.

        The replays go out back to back, with no wait for the card between them: replay k uses
        host slot k % 2 (its pinned descriptor and routes), and waits only for replay k - 2,
        which last used that slot, before rewriting it; each replay's rows (logits, or hidden
        rows) are copied out of the runner's buffers on the step's stream before the next
        replay overwrites them."""
        self.settle()
        ids = self._checked_ids(ids)
        outs, routes, tiers = [], [], {"hits": 0, "remote": 0, "host": 0}
        logits = None
        in_flight: list[tuple[int, int]] = []      # (slot, rows) of replays not waited for

        def wait_oldest() -> None:
            slot, n = in_flight.pop(0)
            self._wait(slot, n)
            for key, count in self.last_tiers.items():
                tiers[key] += count
            routes.append(self.last_routes)

        if self.last:      # the step's rows, out of the runner's buffer (the next replay's)
            with self.stream:
                logits = cp.empty((sum(r.n for r in replays), self.g.n_vocab), cp.float32)
        at = 0
        try:
            for k, rows in enumerate(replays):
                slot = k % len(self.slots)
                if len(in_flight) == len(self.slots):
                    wait_oldest()               # the slot's descriptor is read: rewritable
                part = slice(at, at + rows.n)
                at += rows.n
                out = self._launch_step(rows, ids[part] if self.first else None,
                                        None if self.first else hidden[part], slot,
                                        every_row=True)
                in_flight.append((slot, rows.n))
                if self.last:
                    with self.stream:   # ordered after this replay, before the next one's writes
                        cp.copyto(logits[part], self.logits_rows[:rows.n])
                else:
                    outs.append(out)    # its own copy, made on the stream
            got = self._greedy_rows(logits) if self.last else None
        except BaseException:
            # a step that fails part way (a capture, the NaN check's memory, a session table)
            # leaves no replay running behind the Error: the next step rewrites the slots'
            # pinned descriptors without waiting for replays nobody tracks any more
            self.stream.synchronize()
            raise
        while in_flight:              # (every replay has finished: the copy above waited)
            wait_oldest()
        self.last_tiers = tiers
        self.last_routes = None if routes[0] is None else np.concatenate(routes, axis=1)
        return got if self.last else cp.concatenate(outs)

    def _greedy_rows(self, rows) -> BatchLogits:
        """The step's logits rows [n, vocab] (on the card, made on the step's stream) with each
        row's greedy token, whether its best logit is finite and whether it holds a NaN: one
        launch (sample_rows.cu greedy_rows, numpy's argmax facts), and only those 3 x n words
        copied back (one copy, which waits for the stream)."""
        n = rows.shape[0]
        with self.stream:
            facts = cp.empty((3, n), cp.int32)
            self._fns["greedy_rows"]((n,), (GREEDY_THREADS,),
                                     (rows, np.int32(rows.shape[1]), np.int32(n), facts))
            host = cp.asnumpy(facts, stream=self.stream)
        self.stream.synchronize()
        return BatchLogits(rows, host[0].astype(np.int64), host[1] > 0, host[2] > 0)

    def report_step(self, counters, routing) -> None:
        """The last step's expert computations by tier (hits, host reads in place) into
        `counters` (a Counter), and its routes into `routing` (adapt.RoutingCounts, or None when
        the stage counts none) where they came back."""
        counters.update(self.last_tiers, graph_steps=1)
        if routing is not None and self.last_routes is not None:
            routing.add_layers(self.lb, self.last_routes)
