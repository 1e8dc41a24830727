"""A numpy stand-in for the parts of CuPy the GPU backend calls, for tests/launch_abi_check.py
only (it is on the path of that check's own process, never of the test run): device arrays are
numpy arrays whose `.data.ptr` is their host address, streams, events and graphs do nothing,
copies are memmoves. Kernels are not run; the check replaces strata_dist.kernels.function."""
import contextlib
import ctypes
import weakref

import numpy as _np


class _Track:
    """Device bytes live at once while tracking is on (tests/prompt_bytes_check.py): every array
    that owns its memory, from a constructor or an operation's result, counted until it dies."""
    on, epoch, live, peak = False, 0, 0, 0

    @classmethod
    def alloc(cls, a: _np.ndarray) -> None:
        if not cls.on or a.nbytes == 0:
            return
        cls.live += a.nbytes
        cls.peak = max(cls.peak, cls.live)
        weakref.finalize(a, cls._free, int(a.nbytes), cls.epoch)

    @classmethod
    def _free(cls, nbytes: int, epoch: int) -> None:
        if epoch == cls.epoch:
            cls.live -= nbytes


def track_start() -> None:
    """From now on count the device bytes of new arrays (live and peak start at 0)."""
    _Track.on, _Track.live, _Track.peak = True, 0, 0
    _Track.epoch += 1


def track_stop() -> tuple[int, int]:
    """(peak, still live) bytes since track_start."""
    _Track.on = False
    return _Track.peak, _Track.live


class _Ptr:
    def __init__(self, a):
        self.ptr = a.ctypes.data if a.size else 0
        self.device_id = 0


class ndarray(_np.ndarray):
    def __array_finalize__(self, obj):
        if self.base is None:          # an operation's result, not a view
            _Track.alloc(self)

    @property
    def data(self):
        return _Ptr(self.view(_np.ndarray))

    def get(self, stream=None):
        return _np.array(self.view(_np.ndarray))

    def set(self, arr, stream=None):
        self.view(_np.ndarray)[...] = _np.asarray(arr).reshape(self.shape)


def _wrap(x):
    if isinstance(x, _np.ndarray) and not isinstance(x, ndarray):
        if x.base is None:             # new memory (a constructor's, or an upload's)
            _Track.alloc(x)
        return x.view(ndarray)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    return x


def asarray(x, dtype=None):
    return _wrap(_np.asarray(x, dtype=dtype))


def array(x, dtype=None, copy=True):
    return _wrap(_np.array(x, dtype=dtype))


def ascontiguousarray(x, dtype=None):
    return _wrap(_np.ascontiguousarray(x, dtype=dtype))


def asnumpy(x, stream=None):
    return _np.array(x.view(_np.ndarray) if isinstance(x, _np.ndarray) else x)


def empty(shape, dtype=_np.float32, order="C"):
    return _wrap(_np.zeros(shape, dtype=dtype))      # zeros: no kernel fills them here


def zeros(shape, dtype=_np.float32):
    return _wrap(_np.zeros(shape, dtype=dtype))


def full(shape, value, dtype=None):
    return _wrap(_np.full(shape, value, dtype=dtype))


def copyto(dst, src, **kw):
    _np.copyto(dst, src, **kw)


float16, float32, float64 = _np.float16, _np.float32, _np.float64
int8, int32, int64, uint8, uint32, uint64, bool_ = (_np.int8, _np.int32, _np.int64, _np.uint8,
                                                    _np.uint32, _np.uint64, _np.bool_)


def __getattr__(name):
    f = getattr(_np, name)
    if callable(f) and not isinstance(f, type):
        return lambda *a, **kw: _wrap(f(*a, **kw))
    return f


class _Runtime:
    memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice = 1, 2, 3

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self):
        self._pinned = {}

    def getDeviceCount(self):
        return 1

    def memGetInfo(self):
        return 120 << 30, 140 << 30

    def memcpyAsync(self, dst, src, n, kind, stream):
        ctypes.memmove(int(dst), int(src), int(n))

    def hostAlloc(self, n, flags):
        buf = (ctypes.c_uint8 * int(n))()
        self._pinned[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def freeHost(self, ptr):
        self._pinned.pop(int(ptr), None)

    def pointerGetAttributes(self, ptr):
        return type("Attributes", (), {"devicePointer": ptr})()


class _Graph:
    def launch(self, stream=None):
        pass


class Stream:
    _current: list = []

    def __init__(self, non_blocking=False):
        self.ptr = 0

    def __enter__(self):
        Stream._current.append(self)
        return self

    def __exit__(self, *exc):
        Stream._current.pop()

    def synchronize(self):
        pass

    def wait_event(self, event):
        pass

    def begin_capture(self):
        pass

    def end_capture(self):
        return _Graph()


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Device:
    def __init__(self, index=0):
        self.id, self.compute_capability = index, "90"

    def use(self):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class UnownedMemory:
    def __init__(self, ptr, size, owner, device_id=0):
        self.ptr, self.size = ptr, size


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, getattr(mem, "ptr", 0) + offset


class _Pool:
    def malloc(self, n):
        return MemoryPointer(UnownedMemory(0, n, None), 0)

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_all_blocks(self):
        pass


def get_default_memory_pool():
    return _Pool()


def get_default_pinned_memory_pool():
    return _Pool()


_null = Stream()
Stream.null = _null


class _Cuda:
    runtime = _Runtime()
    Stream, Event, Device = Stream, Event, _Device
    UnownedMemory, MemoryPointer = UnownedMemory, MemoryPointer

    @staticmethod
    def get_current_stream():
        return Stream._current[-1] if Stream._current else _null

    @staticmethod
    def get_elapsed_time(start, end):
        return 0.01

    @staticmethod
    @contextlib.contextmanager
    def using_allocator(allocator=None):
        yield


cuda = _Cuda()


class RawModule:
    def __init__(self, *a, **kw):
        raise RuntimeError("the launch check replaces strata_dist.kernels.function: no module is built")
