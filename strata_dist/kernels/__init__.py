"""CUDA C kernels of the GPU backend, kept as package data (`*.cu` beside this file).

`module(name)` compiles a source once per process with NVRTC through CuPy's `RawModule`. CuPy
keeps the compiled binary on disk (`CUPY_CACHE_DIR`, default `~/.cupy/kernel_cache`) under a key
made of the source, the compile options, the device's compute capability and the CuPy and NVRTC
versions, so a later process loads it without compiling. `tests/test_kernels_compile.py` builds
every source with `nvcc -arch=sm_90` where nvcc exists, so a syntax error costs no GPU time.

Binaries built ahead: with $STRATA_KERNEL_CUBINS naming a directory, `module` first loads the
cubin `kernels/prebuild.py` wrote there for the same source text, options, defines and compute
capability (`cubin_name`), and compiles with NVRTC only when there is none or it does not load.
A GPU machine lent for minutes then spends none of them compiling what nvcc built elsewhere.

CuPy is imported only when a module is asked for: CPU ranks never load this."""
from __future__ import annotations

import hashlib
import logging
import os
import re
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("strata.kernels")
CUBINS_ENV = "STRATA_KERNEL_CUBINS"

KERNEL_DIR = Path(__file__).resolve().parent
# STRATA_KERNEL_LINEINFO=1: source lines in the binaries, for Nsight Compute
# (benchmarks/ncu_decode.sh). Read here from each process's environment, like $STRATA_KERNEL_CUBINS,
# and not a compute option (protocol/compute_options.py): a line table changes no instruction a
# kernel runs, so ranks built with and without it run the same code; it is read once, at import,
# because the binaries' names (cubin_name) hash the options they were compiled with.
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


def cubin_name(name: str, defines: tuple[str, ...], arch: str) -> str:
    """The file a prebuilt binary of source `name` has: its stem, the compute capability
    (e.g. "90") and a hash of everything compiled (the inlined source, options, defines)."""
    key = hashlib.sha256("\0".join((source_text(name), *COMPILE_OPTIONS, *defines, arch))
                         .encode()).hexdigest()[:24]
    return f"{Path(name).stem}-sm{arch}-{key}.cubin"


@lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    log.warning("%s", message)


def _prebuilt(name: str, defines: tuple[str, ...], arch: str):
    """The RawModule of a prebuilt cubin under $STRATA_KERNEL_CUBINS, or None."""
    import cupy as cp
    folder = os.environ.get(CUBINS_ENV)
    if folder and not Path(folder).is_dir():
        _warn_once(f"${CUBINS_ENV}={folder} is not a directory: compiling the kernels with NVRTC")
        return None
    path = Path(folder) / cubin_name(name, defines, arch) if folder else None
    if path is None or not path.is_file():
        return None
    from .abi import source_kernel_names
    try:
        mod = cp.RawModule(path=str(path))
        mod.get_function(source_kernel_names(name)[0])      # loads the binary now
        return mod
    except Exception as e:     # another toolkit's binary, a truncated file: compile instead
        log.warning("prebuilt %s does not load (%s); compiling with NVRTC", path, e)
        return None


@lru_cache(maxsize=None)
def module(name: str, device: int = 0, defines: tuple[str, ...] = ()):
    """The compiled RawModule of `name` (e.g. "decode.cu") for a device, once per process and per
    set of `-D` defines (kernels/abi.py KernelShape)."""
    import cupy as cp
    with cp.cuda.Device(device):
        arch = str(cp.cuda.Device(device).compute_capability)
        mod = _prebuilt(name, tuple(defines), arch)
        if mod is None:
            mod = cp.RawModule(code=source_text(name), options=COMPILE_OPTIONS + tuple(defines))
            mod.compile()
    return mod


@lru_cache(maxsize=None)
def function(name: str, kernel: str, device: int = 0, defines: tuple[str, ...] = ()):
    """Kernel `kernel` of module `name`, looked up once: the prompt path asks for its kernels at
    every layer, and a lookup through the module costs tens of microseconds of host time
    (docs/BENCHMARKS.md, a 512-token prompt's profile)."""
    return module(name, device, tuple(defines)).get_function(kernel)
