"""Moving hidden rows from one stage to the next.

Two paths with one interface: frames over ZeroMQ (CPU ranks, ranks on different hosts, and the
fallback), and CUDA IPC between GPU ranks that report the same host identity — the sender writes
the rows into a slot of a device buffer whose handle the receiver opened once, and the ZeroMQ
message is only the doorbell. A slot is reused after the receiver's SlotFree; when none is free,
or the receiver could not open the handle, the rows go in the frame instead (never a wait)."""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from protocol import Channel, Error, Hidden, IpcHandle, SlotFree
from protocol.messages import RowSlot

log = logging.getLogger("strata.handoff")

IPC_NAME = "hidden"
IPC_SLOTS = 4


class HandoffSender:
    def __init__(self, channel: Channel, backend, host: str, use_ipc: bool, max_rows: int,
                 hidden: int, timeout_ms: int):
        self.ch, self.backend, self.timeout_ms = channel, backend, timeout_ms
        self.export = self.ring = None
        self.ipc_ready = False
        self.sent_ipc = self.sent_frames = 0
        if use_ipc and backend.on_gpu:
            from protocol.cuda_ipc import IpcExport, SlotRing
            slot_bytes = max_rows * hidden * 4
            self.export = IpcExport(SlotRing.bytes_for(IPC_SLOTS, slot_bytes), backend.index,
                                    IPC_NAME, "float32")
            self.ring = SlotRing(self.export.nbytes, slot_bytes)
            self.channel_host = host

    @property
    def nbytes(self) -> int:
        return self.export.nbytes if self.export else 0

    def offer(self) -> None:
        """Send the IPC handle once; rows travel in frames until the receiver accepts it."""
        if self.export is not None:
            self.ch.send(self.export.message(host=self.channel_host), timeout_ms=self.timeout_ms)

    def on_reply(self, msg) -> bool:
        """A SlotFree or refusal from the receiver; True when the message was for us."""
        if isinstance(msg, SlotFree) and msg.name == IPC_NAME and self.ring is not None:
            if msg.slot.nbytes == 0:
                self.ipc_ready = True          # the receiver opened the handle
            else:
                self.ring.release(msg.slot)
            return True
        if isinstance(msg, Error) and msg.code == "ipc" and self.export is not None:
            log.warning("CUDA IPC refused by the next stage (%s); rows go in frames", msg.message)
            self.ipc_ready = False
            self.ring = None
            return True
        return False

    def send(self, rows, **header) -> None:
        """Rows with the Hidden fields in ``header`` (n, dtype and shape are filled in)."""
        shape = [int(d) for d in rows.shape]
        self.send_hidden(Hidden(**dict(header, n=shape[0], dtype="float32", shape=shape)), rows)

    def send_hidden(self, msg: Hidden, rows) -> None:
        """A Hidden message whose rows go in a free IPC slot, or in the frame when none is."""
        slot = self.ring.acquire() if (self.ipc_ready and self.ring is not None) else None
        if slot is not None and rows.nbytes <= slot.nbytes:
            where = RowSlot(offset=slot.offset, nbytes=rows.nbytes)
            self.export.view(where, np.float32, rows.shape)[...] = rows
            self.backend.synchronize()          # the rows are in place before the doorbell rings
            self.ch.send(replace(msg, slot=where), timeout_ms=self.timeout_ms)
            self.sent_ipc += 1
            return
        if slot is not None:
            self.ring.release(slot)
        host_rows = np.ascontiguousarray(self.backend.to_host(rows), dtype=np.float32)
        self.ch.send(replace(msg, slot=None), [host_rows], timeout_ms=self.timeout_ms)
        self.sent_frames += 1


class HandoffReceiver:
    """Opens the upstream stage's buffer and copies rows out of it, acknowledging each slot."""

    def __init__(self, backend, upstream: Channel | None, timeout_ms: int):
        self.backend, self.up, self.timeout_ms = backend, upstream, timeout_ms
        self.mapping = None
        self._held: RowSlot | None = None   # the slot whose rows are being computed on

    def on_handle(self, msg: IpcHandle) -> None:
        try:
            from protocol.cuda_ipc import IpcMapping
            if not self.backend.on_gpu:
                raise RuntimeError("this rank computes on the CPU")
            self.mapping = IpcMapping(msg, device=self.backend.index)
            reply = SlotFree(name=msg.name, slot=RowSlot(offset=0, nbytes=0))
        except Exception as e:  # a GPU this rank cannot see, a CPU rank: frames it is
            log.warning("cannot open the upstream CUDA IPC buffer: %s", e)
            reply = Error(rank=None, request_id=None, message=str(e), code="ipc")
        if self.up is not None:
            self.up.send(reply, timeout_ms=self.timeout_ms)

    def rows(self, msg: Hidden, arrays):
        """The rows of a Hidden message as a backend array of this rank. Rows in an IPC slot are
        read in place (no copy); call release() once they have been consumed."""
        if msg.slot is None:
            return self.backend.asarray(np.asarray(arrays[0], dtype=np.float32))
        if self.mapping is None:
            raise RuntimeError("rows arrived in a CUDA IPC slot before its buffer was opened")
        self._held = msg.slot
        return self.mapping.view(msg.slot, np.float32, msg.shape)

    def release(self) -> None:
        """The stage is done with the rows: the upstream stage may reuse their slot. Sent after
        the stage has handed its own result on, so the acknowledgement is off the critical path."""
        if self._held is not None:
            slot, self._held = self._held, None
            self.backend.synchronize()          # every kernel that read the slot has finished
            self.up.send(SlotFree(name=IPC_NAME, slot=slot), timeout_ms=self.timeout_ms)
