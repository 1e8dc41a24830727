"""Programmatic dependent launch (Hopper): a kernel launched with the programmatic-serialization
attribute may be scheduled while its predecessor on the stream is still finishing; the kernels
wait at `pdl_wait()` (decode.cu) before reading anything the predecessor wrote, so results are
unchanged and only the gap between kernels shrinks. Launches go through the driver's
cuLaunchKernelEx (CuPy's RawKernel call has no launch attributes); captured into a CUDA graph the
attribute becomes a programmatic edge.

On by default in the decode runner (measured: docs/BENCHMARKS.md); STRATA_PDL=0 turns it off."""
from __future__ import annotations

import ctypes

import numpy as np

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # cuda.h (checked with nvcc)


class _AttrValue(ctypes.Union):
    _fields_ = [("programmatic", ctypes.c_int), ("pad", ctypes.c_char * 64)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


_CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
           np.dtype(np.float32): ctypes.c_float}


def _arg(a):
    """A kernel argument as the ctypes value whose address goes into kernelParams."""
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    if ptr is not None:                      # a CuPy array: its device address
        return ctypes.c_uint64(int(ptr))
    return _CTYPES[np.asarray(a).dtype](a.item() if hasattr(a, "item") else a)


class ProgrammaticLauncher:
    def __init__(self):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.cuda.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p,
                                               ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self.cuda.cuLaunchKernelEx.restype = ctypes.c_int
        self._attr = _Attr(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attr.value.programmatic = 1

    def launch(self, kernel, grid, block, args, stream_ptr: int, shared_mem: int = 0) -> None:
        """`kernel`: a CuPy RawKernel; launched on the stream with the programmatic attribute and
        `shared_mem` bytes of dynamic shared memory."""
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        values = [_arg(a) for a in args]
        params = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        cfg = _Config(*grid, *block, int(shared_mem), ctypes.c_void_p(stream_ptr),
                      ctypes.pointer(self._attr), 1)
        rc = self.cuda.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(kernel.kernel.ptr),
                                        params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")
