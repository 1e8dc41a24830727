"""Expert tiers of a stage: its own cache, the helper tiers of other cards, host memory.

For every (row, top-k rank) a layer routes, one tier computes the expert:
  hit     the pair is resident in this stage's cache (a slot of its arena)
  remote  a helper tier holds it: sent as an ExpertRequest (decode only — prompt chunks never go
          to helpers) and answered with the unweighted outputs
  host    nobody holds it: computed from the model file (a GPU rank streams the stored blob to the
          device and runs the same kernel as a hit)
Outputs land in y[row, rank] and the caller combines them in rank order, so a token's output
does not depend on which tier computed which expert. A helper that does not answer in time is
marked dead and its experts are computed from host memory: the tokens stay the same."""
from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np

from protocol import Channel, Error, ExpertReply, ExpertRequest, ProtocolError, ProtocolTimeout

from .experts import BlobArena, ExpertStore, HostTier, swiglu

log = logging.getLogger("strata.tiers")

REMOTE_TIMEOUT_MS = 2000


class HelperClient:
    """This stage's link to one helper tier (a DEALER to the helper's ROUTER)."""

    def __init__(self, rank: int, endpoint: str, pairs):
        self.rank, self.endpoint = rank, endpoint
        self.pairs = {(int(l), int(e)) for l, e in pairs}
        self.ch = Channel("dealer", peer=f"helper rank {rank}").connect(endpoint)
        self.alive = True
        self._seq = 0

    def request(self, layer: int, rows: np.ndarray, ids: np.ndarray, wts: np.ndarray) -> int:
        self._seq += 1
        self.ch.send(ExpertRequest(seq=self._seq, layer=layer, n=rows.shape[0]),
                     [rows, ids.astype(np.int32), wts.astype(np.float32)], timeout_ms=REMOTE_TIMEOUT_MS)
        return self._seq

    def reply(self, seq: int, deadline: float) -> np.ndarray:
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0:
                raise ProtocolTimeout(self.ch.peer, "an expert reply", REMOTE_TIMEOUT_MS)
            msg, arrays = self.ch.recv(timeout_ms=left, what="an expert reply")
            if isinstance(msg, ExpertReply) and msg.seq == seq:
                return np.asarray(arrays[0], dtype=np.float32)
            if isinstance(msg, Error):
                raise ProtocolError(f"helper rank {self.rank}: {msg.message}")
            # a late reply to an earlier, timed-out request: skip it


class ExpertTiers(ExpertStore):
    """The expert store a stage's model computes through."""

    def __init__(self, backend, gguf, cache: BlobArena, helpers: list[HelperClient],
                 local_helper: BlobArena | None = None):
        self.backend, self.gguf, self.cache = backend, gguf, cache
        self.local_helper = local_helper   # the helper tier on this stage's own card
        self.host = HostTier(backend, gguf)
        self.helpers = helpers
        self.remote_of = {pair: h for h in helpers for pair in h.pairs}
        self.prompt = False          # set by the stage: prompt chunks never go to helpers
        self.counters: Counter = Counter()

    def outputs(self, layer: int, x, idx: np.ndarray):
        be = self.backend
        n, k = idx.shape
        y = be.xp.zeros((n, k, x.shape[1]), dtype=np.float32)
        tier = np.zeros((n, k), dtype=np.int8)   # 0 host, 1 hit, 2 remote, 3 own card's helper tier
        asked: dict[HelperClient, np.ndarray] = {}
        for r in range(n):
            for j in range(k):
                e = int(idx[r, j])
                if self.cache.holds(layer, e):
                    tier[r, j] = 1
                    continue
                if not self.prompt and self.local_helper is not None and self.local_helper.holds(layer, e):
                    tier[r, j] = 3
                    continue
                h = None if self.prompt else self.remote_of.get((layer, e))
                if h is not None and h.alive:
                    tier[r, j] = 2
                    asked.setdefault(h, np.zeros((n, k), dtype=bool))[r, j] = True
        pending = []
        if asked:
            x_host = np.ascontiguousarray(be.to_host(x), dtype=np.float32)
            for h, mask in asked.items():
                try:
                    pending.append((h, mask, h.request(layer, x_host, np.where(mask, idx, -1),
                                                       np.zeros((n, k), np.float32))))
                except ProtocolTimeout as e:
                    self._helper_lost(h, e)
                    tier[mask] = 0
        # local work overlaps with the helpers'
        self._run(self.cache, layer, x, idx, tier == 1, y)
        if self.local_helper is not None:
            self._run(self.local_helper, layer, x, idx, tier == 3, y)
        for h, mask, seq in pending:
            try:
                out = h.reply(seq, time.monotonic() + REMOTE_TIMEOUT_MS / 1000)
                rows, ranks = np.nonzero(mask)
                y[be.asarray(rows), be.asarray(ranks)] = be.asarray(out[rows, ranks])
            except (ProtocolTimeout, ProtocolError) as e:
                self._helper_lost(h, e)
                tier[mask] = 0
        if self.prompt and self.cache.lent:
            self._run_streamed(layer, x, idx, tier == 0, y)
        else:
            self._run(self.host, layer, x, idx, tier == 0, y)
        self.counters["hits"] += int((tier == 1).sum())
        self.counters["remote"] += int((tier >= 2).sum())   # served by a helper tier
        self.counters["host"] += int((tier == 0).sum())
        return y

    def _run(self, store: ExpertStore, layer: int, x, idx, mask, y) -> None:
        be = self.backend
        for expert in np.unique(idx[mask]):
            rows, ranks = np.nonzero(mask & (idx == expert))
            sel = be.asarray(rows)
            y[sel, be.asarray(ranks)] = store.compute(layer, int(expert), x[sel])

    def _run_streamed(self, layer: int, x, idx, mask, y) -> None:
        """A prompt chunk's misses, streamed into the loaned tail of the cache a batch at a time
        and computed there with the same kernel as a hit (no allocation per expert)."""
        be, gguf = self.backend, self.gguf
        region = self.cache.loan_region()
        size = gguf.blob_bytes(layer)
        per_batch = int(region.nbytes) // size
        experts = [int(e) for e in np.unique(idx[mask])]
        if per_batch == 0:   # a loan smaller than one of this layer's blobs: plain host path
            self._run(self.host, layer, x, idx, mask, y)
            return
        for start in range(0, len(experts), per_batch):
            batch = experts[start:start + per_batch]
            for i, e in enumerate(batch):     # stream the batch in, then compute it
                be.stage_blob(gguf.expert_blob(layer, e), out=region[i * size:(i + 1) * size])
            for i, e in enumerate(batch):
                rows, ranks = np.nonzero(mask & (idx == e))
                sel = be.asarray(rows)
                gate, up, down = be.expert_weights(gguf, layer, region[i * size:(i + 1) * size])
                y[sel, be.asarray(ranks)] = swiglu(be, x[sel], gate, up, down)
            self.counters["streamed"] += len(batch)

    def _helper_lost(self, h: HelperClient, err: Exception) -> None:
        if h.alive:
            log.error("helper rank %d stopped answering (%s); its experts are computed from host "
                      "memory from now on", h.rank, err)
        h.alive = False
        self.counters["remote_lost"] += 1


def serve_request(store: BlobArena, msg: ExpertRequest, arrays) -> np.ndarray:
    """A helper's answer: the unweighted output of every asked (row, rank), zeros elsewhere."""
    rows, ids = arrays[0], arrays[1]
    be = store.backend
    n, k = ids.shape
    x = be.asarray(np.ascontiguousarray(rows, dtype=np.float32))
    y = be.xp.zeros((n, k, x.shape[1]), dtype=np.float32)
    for expert in np.unique(ids[ids >= 0]):
        if not store.holds(msg.layer, int(expert)):
            raise KeyError(f"asked for pair ({msg.layer}, {int(expert)}), which this helper does not hold")
        r, j = np.nonzero(ids == expert)
        y[be.asarray(r), be.asarray(j)] = store.compute(msg.layer, int(expert), x[be.asarray(r)])
    return np.ascontiguousarray(be.to_host(y), dtype=np.float32)
