"""CUDA IPC buffers between ranks on one host: the handle is exchanged once, then messages carry only RowSlots.

    writer                                   reader
    buf = IpcExport(nbytes, device, "hidden")
    send(buf.message(host=...))   ───────▶   peer = IpcMapping(msg)          (once per link)
    slot = ring.acquire(); write rows into buf.view(slot, ...); stream.synchronize()
    send(Hidden(..., slot=slot))  ───────▶   rows = peer.view(slot, dtype, shape); copy them out
    ring.release(slot)            ◀───────   send(SlotFree(name, slot))

Rules (PROTOCOL.md §IPC): only between ranks reporting the same host identity; the writer synchronizes its stream
before ringing the doorbell; a slot is reused only after its SlotFree; both processes must see the exporting GPU
(a rank whose CUDA_VISIBLE_DEVICES hides that GPU cannot open the handle — fall back to frames over ZeroMQ).
CuPy is optional: this module imports without it, and only the classes that touch a GPU need it.
"""

from __future__ import annotations

import os
from typing import Any

from .messages import IpcHandle, RowSlot

try:  # optional: CPU ranks and CI have no CuPy
    import cupy as cp
    HAVE_CUPY = True
except Exception:  # ImportError, or a CuPy that cannot find its CUDA libraries
    cp = None
    HAVE_CUPY = False

IPC_HANDLE_BYTES = 64
SLOT_ALIGN = 256  # keeps every slot aligned for any dtype and for coalesced loads


def _need_cupy() -> Any:
    if cp is None:
        raise RuntimeError("CUDA IPC needs CuPy (pip install strata-dist[cuda12]); use frames over ZeroMQ instead")
    return cp


def device_uuid(index: int) -> str:
    """The GPU's UUID as hex ('' if unknown): identifies a device across processes with different numbering."""
    try:
        uuid = _need_cupy().cuda.runtime.getDeviceProperties(index).get("uuid", b"")
        return uuid.hex() if isinstance(uuid, (bytes, bytearray)) else str(uuid)
    except Exception:
        return ""


def check_slot(slot: RowSlot, capacity: int, need: int | None = None) -> None:
    """Raise ValueError unless ``slot`` lies inside a buffer of ``capacity`` bytes (and holds ``need`` bytes)."""
    if slot.offset < 0 or slot.nbytes < 0 or slot.offset + slot.nbytes > capacity:
        raise ValueError(f"slot [{slot.offset}, {slot.offset + slot.nbytes}) outside the {capacity}-byte buffer")
    if need is not None and need > slot.nbytes:
        raise ValueError(f"{need} bytes do not fit the {slot.nbytes}-byte slot at {slot.offset}")


class SlotRing:
    """Pure bookkeeping of equal slots in one IPC buffer, handed out in ring order (no GPU needed).

    The writer acquires a slot, fills it, sends its RowSlot, and releases it when the reader's SlotFree arrives.
    acquire() returning None means every slot is in flight: wait for a SlotFree (that is the back-pressure).
    """

    def __init__(self, capacity: int, slot_bytes: int, align: int = SLOT_ALIGN):
        if slot_bytes <= 0 or align <= 0:
            raise ValueError(f"slot_bytes and align must be > 0, got {slot_bytes}, {align}")
        self.stride = -(-slot_bytes // align) * align
        self.slot_bytes = slot_bytes
        self.n_slots = capacity // self.stride
        if self.n_slots == 0:
            raise ValueError(f"a {capacity}-byte buffer holds no {slot_bytes}-byte slot")
        self.capacity = capacity
        self._busy: set[int] = set()
        self._next = 0

    @staticmethod
    def bytes_for(n_slots: int, slot_bytes: int, align: int = SLOT_ALIGN) -> int:
        """Buffer size that holds ``n_slots`` slots (what to allocate)."""
        return n_slots * (-(-slot_bytes // align) * align)

    @property
    def free(self) -> int:
        return self.n_slots - len(self._busy)

    def acquire(self) -> RowSlot | None:
        for k in range(self.n_slots):
            i = (self._next + k) % self.n_slots
            if i not in self._busy:
                self._busy.add(i)
                self._next = (i + 1) % self.n_slots
                return RowSlot(offset=i * self.stride, nbytes=self.slot_bytes)
        return None

    def release(self, slot: RowSlot) -> None:
        i, rem = divmod(slot.offset, self.stride)
        if rem or i not in self._busy:
            raise ValueError(f"slot at offset {slot.offset} was not handed out by this ring")
        self._busy.remove(i)


class _Mapped:
    """Shared helpers for a device buffer of ``nbytes`` at ``ptr``."""

    nbytes: int
    device: int
    _ptr: int
    _owner: Any

    @property
    def ptr(self) -> int:
        """The buffer's device address in this process (0 once closed)."""
        return self._ptr

    def view(self, slot: RowSlot, dtype: Any, shape: tuple[int, ...] | list[int]) -> Any:
        """A cupy array of ``shape``/``dtype`` over the slot's bytes (no copy)."""
        cpm = _need_cupy()
        if self._ptr == 0:
            raise ValueError("IPC buffer is closed")
        dt = cpm.dtype(dtype)
        need = dt.itemsize
        for d in shape:
            need *= int(d)
        check_slot(slot, self.nbytes, need)
        mem = cpm.cuda.UnownedMemory(self._ptr, self.nbytes, self._owner, device_id=self.device)
        return cpm.ndarray(tuple(shape), dt, cpm.cuda.MemoryPointer(mem, slot.offset))

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class IpcExport(_Mapped):
    """A device buffer this process owns and shares. Allocated directly with cudaMalloc, not from CuPy's pool:
    an IPC handle names a whole allocation, and a pool block would be an unknown offset inside a larger one."""

    def __init__(self, nbytes: int, device: int, name: str, dtype: str = "uint8"):
        cpm = _need_cupy()
        if nbytes <= 0:
            raise ValueError(f"IPC buffer needs nbytes > 0, got {nbytes}")
        self.nbytes, self.device, self.name, self.dtype = int(nbytes), int(device), name, dtype
        with cpm.cuda.Device(self.device):
            self._mem = cpm.cuda.Memory(self.nbytes)
        self._ptr, self._owner = self._mem.ptr, self._mem
        self.handle: bytes = bytes(cpm.cuda.runtime.ipcGetMemHandle(self._ptr))

    def message(self, host: str = "") -> IpcHandle:
        """The IpcHandle to send once to the reader."""
        return IpcHandle(name=self.name, handle=self.handle, device=self.device, nbytes=self.nbytes,
                         dtype=self.dtype, device_uuid=device_uuid(self.device), host=host, pid=os.getpid())

    def close(self) -> None:
        """Free the buffer. Readers must have closed their mappings first (their views become invalid)."""
        self._mem = self._owner = None
        self._ptr = 0


class IpcMapping(_Mapped):
    """A peer's buffer opened in this process from its IpcHandle; close() unmaps it (idempotent)."""

    def __init__(self, msg: IpcHandle, device: int | None = None):
        cpm = _need_cupy()
        if msg.pid == os.getpid():
            raise ValueError("a CUDA IPC handle cannot be opened in the process that exported it")
        if len(msg.handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"IPC handle is {len(msg.handle)} bytes, expected {IPC_HANDLE_BYTES}")
        self.name, self.nbytes, self.dtype = msg.name, msg.nbytes, msg.dtype
        # Map into our own current device; lazy peer access lets it be another GPU of the same host.
        self.device = cpm.cuda.runtime.getDevice() if device is None else int(device)
        with cpm.cuda.Device(self.device):
            self._ptr = int(cpm.cuda.runtime.ipcOpenMemHandle(
                msg.handle, getattr(cpm.cuda.runtime, "cudaIpcMemLazyEnablePeerAccess", 1)))
        self._owner = self

    def close(self) -> None:
        if getattr(self, "_ptr", 0):
            ptr, self._ptr = self._ptr, 0
            with cp.cuda.Device(self.device):
                cp.cuda.runtime.ipcCloseMemHandle(ptr)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # interpreter shutdown: the driver unmaps on process exit anyway


__all__ = ["HAVE_CUPY", "RowSlot", "SlotRing", "IpcExport", "IpcMapping", "check_slot", "device_uuid",
           "SLOT_ALIGN"]
