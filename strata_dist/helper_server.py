"""The server half of a helper tier: the experts a card holds for other stages (docs/ARCHITECTURE.md).

A stage asks with ExpertRequest (rows in frames, or in the stage's CUDA IPC buffer once the helper
has opened it) and gets the unweighted outputs of the asked (row, rank) pairs back. The client half
is `tiers.HelperClient`. Nothing here touches a socket: `HelperServer.answer` takes one message and
returns the reply, so the rank's shell owns the socket and this module owns the arithmetic."""
from __future__ import annotations

import logging
import os

import numpy as np

from protocol import Error, ExpertReply, ExpertRequest, ExpertTier, ExpertTierAsk, IpcHandle, SlotFree
from protocol.messages import RowSlot

from .experts import BlobArena

log = logging.getLogger("strata.helper")


class HelperServer:
    """One card's helper tier. Fail-soft: a tier that could not open answers every request with an
    Error (the stages then compute those experts from host memory)."""

    def __init__(self, rank: int, arena: BlobArena | None, error: str = ""):
        self.rank, self.arena, self.error = rank, arena, error
        self.links: dict[bytes, object] = {}   # stage identity -> its opened CUDA IPC buffer
        self.requests = 0

    @classmethod
    def open(cls, rank: int, backend, gguf, pairs, n_layers: int, n_expert: int) -> "HelperServer":
        try:
            return cls(rank, BlobArena(backend, gguf, [tuple(p) for p in pairs], n_layers, n_expert,
                                       exportable=True))
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
                serve_ipc_request(self.arena, link, msg, arrays)
                return ExpertReply(seq=msg.seq, layer=msg.layer, n=msg.n, slot=msg.out), []
            out = serve_request(self.arena, msg, arrays)
            return ExpertReply(seq=msg.seq, layer=msg.layer, n=msg.n), [out]
        except Exception as e:
            return Error(rank=self.rank, request_id=None, message=str(e), code="helper"), []

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


def serve_request(store: BlobArena, msg: ExpertRequest, arrays) -> np.ndarray:
    """A helper's answer in frames: the unweighted output of every asked (row, rank), zeros elsewhere."""
    be = store.backend
    x = be.asarray(np.ascontiguousarray(arrays[0], dtype=np.float32))
    return np.ascontiguousarray(be.to_host(compute_request(store, msg.layer, x, arrays[1])),
                                dtype=np.float32)


def serve_ipc_request(store: BlobArena, mapping, msg: ExpertRequest, arrays) -> None:
    """A helper's answer through the stage's IPC buffer: rows read at ``msg.slot``, outputs
    written at ``msg.out`` and synchronized before the caller rings the doorbell."""
    be = store.backend
    ids = arrays[0]
    n, k = ids.shape
    x = mapping.view(msg.slot, np.float32, (n, msg.slot.nbytes // (4 * n)))
    y = compute_request(store, msg.layer, x, ids)
    mapping.view(msg.out, np.float32, y.shape)[...] = y
    be.synchronize()


def compute_request(store: BlobArena, layer: int, x, ids: np.ndarray):
    """Outputs (n, k, d) of the asked pairs (ids >= 0) for rows ``x``, as a backend array."""
    be = store.backend
    n, k = ids.shape
    y = be.xp.zeros((n, k, x.shape[1]), dtype=np.float32)
    for expert in np.unique(ids[ids >= 0]):
        if not store.holds(layer, int(expert)):
            raise KeyError(f"asked for pair ({layer}, {int(expert)}), which this helper does not hold")
    store.compute_into(layer, x, ids, ids >= 0, y)
    return y
