"""The server half of a helper tier: the experts a card holds for other stages (docs/ARCHITECTURE.md).

A stage asks with ExpertRequest (rows in frames, or in the stage's CUDA IPC buffer once the helper
has opened it) and gets the unweighted outputs of the asked (row, rank) pairs back. The client half
is `tiers.HelperClient`. Nothing here touches a socket: `HelperServer.answer` takes one message and
returns the reply, so the rank's shell owns the socket and this module owns the arithmetic.

With the adaptive cache on (--adapt-every, --adapt-swaps) the tier re-ranks as a stage's cache
does (strata_dist/experts/adapt.py): each stage sends its decayed routing counts at its own rounds
(TierCounts), and the tier swaps its coldest held pairs for the hottest pairs no tier holds, over
every stage's latest counts, so a slot can move from one stage's layers to another's. A swap runs
between two messages of this rank's one loop, so no request is being computed while a slot is
rewritten; a stage learns its layers' pairs in the answer (TierPairs) and until then may ask for
a pair that has left: that one is computed from the model file (HostTier), the same kernel as a
hit, so the tokens do not change. A tier read in place (a decode graph holds its addresses
through CUDA IPC, or this card's own stage on a GPU) never swaps: no step could be told in time."""
from __future__ import annotations

import logging
import os

import numpy as np

from protocol import (Error, ExpertReply, ExpertRequest, ExpertTier, ExpertTierAsk, IpcHandle, SlotFree,
                      TierCounts, TierPairs)
from protocol.messages import RowSlot

from .adapt import coverage, pick_swaps
from .stores import BlobArena, HostTier

log = logging.getLogger("strata.helper")


class HelperServer:
    """One card's helper tier. Fail-soft: a tier that could not open answers every request with an
    Error (the stages then compute those experts from host memory)."""

    def __init__(self, rank: int, arena: BlobArena | None, error: str = "", adapt_swaps: int = 0):
        self.rank, self.arena, self.error = rank, arena, error
        self.links: dict[bytes, object] = {}   # stage identity -> its opened CUDA IPC buffer
        self.requests = 0
        # the re-ranking (module doc): the most swaps a round makes (0: the tier stays as planned),
        # every stage's latest counts, and the pairs that left the tier (still answered)
        self.adapt_swaps = adapt_swaps
        self.counts = np.zeros(arena.slot_of.shape) if arena is not None else None
        self.left: set[tuple[int, int]] = set()
        self.host = HostTier(arena.backend, arena.gguf) if arena is not None else None
        self.read_in_place = False     # a decode graph reads this tier's addresses: no swap
        self.counters = {"tier_rounds": 0, "tier_swaps": 0, "tier_left_asked": 0}
        # the pairs the plan gave the tier: what it would hold of the same counts without swaps
        self.planned = arena.slot_of >= 0 if arena is not None else None

    @classmethod
    def open(cls, rank: int, backend, gguf, pairs, n_layers: int, n_expert: int,
             adapt_swaps: int = 0) -> "HelperServer":
        try:
            return cls(rank, BlobArena(backend, gguf, [tuple(p) for p in pairs], n_layers, n_expert,
                                       exportable=True), adapt_swaps=adapt_swaps)
        except Exception as e:  # out of memory, most likely
            error = f"helper tier of {len(pairs)} pairs did not open: {e}"
            log.error("%s", error)
            return cls(rank, None, error)

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes if self.arena is not None else 0

    def answer(self, identity: bytes, msg, arrays) -> tuple[object, list] | None:
        """The reply (message, arrays) to one message from a stage; None for anything else."""
        if isinstance(msg, IpcHandle):
            return self._open_link(identity, msg), []
        if isinstance(msg, ExpertTierAsk):
            return self._tier()
        if isinstance(msg, TierCounts):
            return self._rerank(msg, arrays)
        if not isinstance(msg, ExpertRequest):
            return None
        try:
            if self.arena is None:
                raise RuntimeError(self.error or "this rank holds no helper tier")
            self.requests += 1
            if msg.slot is not None:
                link = self.links.get(identity)
                if link is None:
                    raise RuntimeError("rows arrived in a CUDA IPC slot this helper never opened")
                serve_ipc_request(self.arena, link, msg, arrays, self._left_store())
                return ExpertReply(seq=msg.seq, layer=msg.layer, n=msg.n, slot=msg.out), []
            out = serve_request(self.arena, msg, arrays, self._left_store())
            return ExpertReply(seq=msg.seq, layer=msg.layer, n=msg.n), [out]
        except Exception as e:
            return Error(rank=self.rank, request_id=None, message=str(e), code="helper"), []

    def _left_store(self):
        """Where a pair that left this tier is computed when a stage that has not heard yet asks."""
        return (self.left, self.host, self.counters) if self.left else None

    def _rerank(self, msg: TierCounts, arrays) -> tuple[object, list]:
        try:
            held, swaps = self.rerank(msg.lb, msg.le, arrays[0])
        except (RuntimeError, ValueError) as e:
            return Error(rank=self.rank, request_id=None, message=str(e), code="helper"), []
        return TierPairs(seq=msg.seq, pairs=[list(p) for p in held], swaps=swaps), []

    def rerank(self, lb: int, le: int, counts) -> tuple[list, int]:
        """A stage's counts of layers [lb, le) in; one round of swaps over every stage's latest
        counts (module doc). The pairs of [lb, le) held now, and the swaps made. This card's own
        stage calls it directly, another card's stage through TierCounts."""
        a = self.arena
        if a is None:
            raise RuntimeError(self.error or "this rank holds no helper tier")
        counts = np.asarray(counts, dtype=np.float64)
        if (le > self.counts.shape[0] or counts.shape != (le - lb, self.counts.shape[1])
                or not np.isfinite(counts).all() or (counts < 0).any()):
            raise ValueError(f"tier counts {list(counts.shape)} of layers [{lb}, {le}): not finite "
                             f"counts >= 0 of this model's {self.counts.shape[1]} experts")
        self.counts[lb:le] = counts
        swaps = []
        if self.adapt_swaps > 0 and not self.read_in_place:
            sizes = np.array([a.gguf.blob_bytes(l) for l in range(self.counts.shape[0])])
            swaps = pick_swaps(self.counts, a.slot_of >= 0, self.adapt_swaps, size_class=sizes)
            a.swap(swaps)
            for evict, take in swaps:
                self.left.add(evict)
                self.left.discard(take)
            c = self.counters
            c["tier_rounds"] += 1
            c["tier_swaps"] += len(swaps)
            # levels, not totals: the share of the stages' latest missed routing the tier holds
            # after this round, and what the plan's pairs would hold of it
            c["tier_coverage_ppm"] = int(round(coverage(self.counts, a.slot_of >= 0) * 1e6))
            c["tier_planned_coverage_ppm"] = int(round(coverage(self.counts, self.planned) * 1e6))
            if swaps:
                log.info("helper tier swapped %d pairs on layers [%d, %d)'s counts", len(swaps),
                         lb, le)
        return [(l, e) for l, e in a.pairs if lb <= l < le and a.slot_of[l, e] >= 0], len(swaps)

    def _tier(self) -> tuple[object, list]:
        """This tier's buffer for a stage on the same host to read in place (its decode graph),
        or why not (a CPU tier, one that did not open)."""
        export = self.arena.ipc_export if self.arena is not None else None
        if export is None:
            why = self.error or "this rank's helper tier is not in an exportable GPU buffer"
            return Error(rank=self.rank, request_id=None, message=why, code="ipc_tier"), []
        from protocol.cuda_ipc import device_uuid
        a = self.arena
        pairs = np.array(a.pairs, dtype=np.int32).reshape(-1, 2)
        self.read_in_place = True    # a stage's decode graph may hold these addresses from now on
        return (ExpertTier(handle=export.handle, device=export.device, nbytes=export.nbytes,
                           device_uuid=device_uuid(export.device), pid=os.getpid()),
                [pairs, a.offsets[:len(a.pairs)].astype(np.int64)])

    def _open_link(self, identity: bytes, msg: IpcHandle):
        """A stage offers its CUDA IPC buffer for expert requests: open it, or refuse (the stage
        then keeps sending frames)."""
        try:
            from protocol.cuda_ipc import IpcMapping
            if self.arena is None or not self.arena.backend.on_gpu:
                raise RuntimeError("this rank's helper tier is not on a GPU")
            old = self.links.pop(identity, None)
            if old is not None:
                old.close()
            self.links[identity] = IpcMapping(msg, device=self.arena.backend.index)
            return SlotFree(name=msg.name, slot=RowSlot(offset=0, nbytes=0))
        except Exception as e:  # a CPU rank, a GPU this rank cannot see
            log.warning("cannot open a stage's CUDA IPC buffer for expert requests: %s", e)
            return Error(rank=self.rank, request_id=None, message=str(e), code="ipc")


def serve_request(store: BlobArena, msg: ExpertRequest, arrays, left=None) -> np.ndarray:
    """A helper's answer in frames: the unweighted output of every asked (row, rank), zeros elsewhere."""
    be = store.backend
    x = be.asarray(np.ascontiguousarray(arrays[0], dtype=np.float32))
    return np.ascontiguousarray(be.to_host(compute_request(store, msg.layer, x, arrays[1], left)),
                                dtype=np.float32)


def serve_ipc_request(store: BlobArena, mapping, msg: ExpertRequest, arrays, left=None) -> None:
    """A helper's answer through the stage's IPC buffer: rows read at ``msg.slot``, outputs
    written at ``msg.out`` and synchronized before the caller rings the doorbell."""
    be = store.backend
    ids = arrays[0]
    n, k = ids.shape
    x = mapping.view(msg.slot, np.float32, (n, msg.slot.nbytes // (4 * n)))
    y = compute_request(store, msg.layer, x, ids, left)
    mapping.view(msg.out, np.float32, y.shape)[...] = y
    be.synchronize()


def compute_request(store: BlobArena, layer: int, x, ids: np.ndarray, left=None):
    """Outputs (n, k, d) of the asked pairs (ids >= 0) for rows ``x``, as a backend array.
    `left` (HelperServer._left_store): pairs that left the tier, computed from the model file."""
    be = store.backend
    n, k = ids.shape
    y = be.xp.zeros((n, k, x.shape[1]), dtype=np.float32)
    gone = []
    for expert in np.unique(ids[ids >= 0]):
        if store.holds(layer, int(expert)):
            continue
        if left is None or (layer, int(expert)) not in left[0]:
            raise KeyError(f"asked for pair ({layer}, {int(expert)}), which this helper does not hold")
        gone.append(int(expert))
    held = ids >= 0
    for expert in gone:
        held &= ids != expert
        rows, ranks = np.nonzero(ids == expert)
        sel = be.asarray(rows)
        y[sel, be.asarray(ranks)] = left[1].compute(layer, expert, x[sel])
        left[2]["tier_left_asked"] += len(rows)
    store.compute_into(layer, x, ids, held, y)
    return y
