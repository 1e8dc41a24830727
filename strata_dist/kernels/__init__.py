"""CUDA C kernels of the GPU backend, kept as package data (`*.cu` beside this file).

`module(name)` compiles a source once per process with NVRTC through CuPy's `RawModule`. CuPy
keeps the compiled binary on disk (`CUPY_CACHE_DIR`, default `~/.cupy/kernel_cache`) under a key
made of the source, the compile options, the device's compute capability and the CuPy and NVRTC
versions, so a later process loads it without compiling. `tests/test_kernels_compile.py` builds
every source with `nvcc -arch=sm_90` where nvcc exists, so a syntax error costs no GPU time.

CuPy is imported only when a module is asked for: CPU ranks never load this."""
from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
# STRATA_KERNEL_LINEINFO=1: source lines in the binaries, for Nsight Compute
# (benchmarks/ncu_decode.sh)
LINEINFO = ("-lineinfo",) if os.environ.get("STRATA_KERNEL_LINEINFO") == "1" else ()
COMPILE_OPTIONS = ("--std=c++17",) + LINEINFO


def sources() -> list[Path]:
    """Every kernel source of the package (the `*.cuh` headers they include are not compiled on
    their own)."""
    return sorted(KERNEL_DIR.glob("*.cu"))


_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"[^\n]*$', re.MULTILINE)


def source_text(name: str, _seen: set[str] | None = None) -> str:
    """The source `name` with its local `#include "x.cuh"` lines replaced by the files (once each):
    NVRTC then needs no include path, and CuPy's cache key, made of the source text, changes
    whenever any byte compiled does."""
    seen = set() if _seen is None else _seen
    seen.add(name)

    def inline(match: re.Match) -> str:
        header = match.group(1)
        if header in seen:
            return ""
        return source_text(header, seen)
    return _LOCAL_INCLUDE.sub(inline, (KERNEL_DIR / name).read_text())


@lru_cache(maxsize=None)
def module(name: str, device: int = 0, defines: tuple[str, ...] = ()):
    """The compiled RawModule of `name` (e.g. "decode.cu") for a device, once per process and per
    set of `-D` defines (kernels/abi.py KernelShape)."""
    import cupy as cp
    with cp.cuda.Device(device):
        mod = cp.RawModule(code=source_text(name), options=COMPILE_OPTIONS + tuple(defines))
        mod.compile()
    return mod


def function(name: str, kernel: str, device: int = 0, defines: tuple[str, ...] = ()):
    return module(name, device, tuple(defines)).get_function(kernel)
