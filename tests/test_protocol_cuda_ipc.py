"""CUDA IPC: the pure slot bookkeeping everywhere; the real handle exchange only on a GPU (-m gpu)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from protocol import cuda_ipc
from protocol import messages as m
from protocol.cuda_ipc import SlotRing, check_slot
from protocol.transport import Channel, Endpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_module_imports_without_cupy():
    assert isinstance(cuda_ipc.HAVE_CUPY, bool)
    if not cuda_ipc.HAVE_CUPY:
        with pytest.raises(RuntimeError, match="CuPy"):
            cuda_ipc.IpcExport(1024, 0, "hidden")


def test_slot_ring_hands_out_aligned_slots_and_backpressure():
    ring = SlotRing(SlotRing.bytes_for(3, 1000), 1000)
    assert ring.n_slots == 3 and ring.stride == 1024
    slots = [ring.acquire() for _ in range(3)]
    assert [s.offset for s in slots] == [0, 1024, 2048] and all(s.nbytes == 1000 for s in slots)
    assert ring.acquire() is None and ring.free == 0  # all in flight: wait for SlotFree
    ring.release(slots[1])
    assert ring.acquire() == slots[1]
    with pytest.raises(ValueError):
        ring.release(m.RowSlot(offset=5, nbytes=1000))
    ring.release(slots[0])
    with pytest.raises(ValueError):
        ring.release(slots[0])
    with pytest.raises(ValueError):
        SlotRing(100, 1000)


def test_check_slot():
    check_slot(m.RowSlot(offset=0, nbytes=64), 64, 64)
    with pytest.raises(ValueError, match="outside"):
        check_slot(m.RowSlot(offset=32, nbytes=64), 64)
    with pytest.raises(ValueError, match="do not fit"):
        check_slot(m.RowSlot(offset=0, nbytes=16), 64, 32)


# The exporting process: fills slot 1 of its buffer, sends the handle and a doorbell, waits for SlotFree.
EXPORTER = r"""
import sys, cupy as cp
from protocol import messages as m
from protocol.cuda_ipc import IpcExport, SlotRing
from protocol.transport import Channel
ring = SlotRing(SlotRing.bytes_for(2, 4 * 8 * 4), 4 * 8 * 4)
with Channel("pair", peer="reader") as ch, IpcExport(ring.capacity, 0, "hidden", "float32") as buf:
    ch.connect(sys.argv[1])
    ch.send(buf.message(host="test"))
    ring.acquire()
    slot = ring.acquire()
    buf.view(slot, "float32", (4, 8))[...] = cp.arange(32, dtype=cp.float32).reshape(4, 8)
    cp.cuda.Stream.null.synchronize()  # rows are complete before the doorbell rings
    ch.send(m.Hidden(request_id=1, session_id=1, pos=0, n=4, dtype="float32", shape=[4, 8], slot=slot))
    msg, _ = ch.recv(20000)
    assert isinstance(msg, m.SlotFree) and msg.slot == slot
    ring.release(msg.slot)
print("exporter ok")
"""


@pytest.mark.gpu
def test_ipc_rows_between_two_processes():
    import cupy as cp
    with Endpoints() as eps, Channel("pair", peer="writer") as ch:
        ep = ch.bind(eps.ipc("ipc-test"))
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen([sys.executable, "-c", EXPORTER, ep], env=env, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            handle, _ = ch.recv(60000, what="IpcHandle")
            assert isinstance(handle, m.IpcHandle) and len(handle.handle) == 64 and handle.pid == proc.pid
            with cuda_ipc.IpcMapping(handle) as peer:
                bell, _ = ch.recv(20000, what="Hidden doorbell")
                rows = peer.view(bell.slot, bell.dtype, bell.shape).get()
                assert np.array_equal(rows, np.arange(32, dtype=np.float32).reshape(4, 8))
                ch.send(m.SlotFree(name=handle.name, slot=bell.slot))
            out, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0 and "exporter ok" in out, out
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert cp.cuda.runtime.getDeviceCount() >= 1
