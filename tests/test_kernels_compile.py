"""The CUDA kernels compile (nvcc -arch=sm_90, no GPU needed) and their argument tables have the
layout Python writes (kernels/abi.py), so a syntax error or a drifted struct never costs GPU time.
Skips where nvcc is not installed."""
import os
import shutil
import subprocess

import pytest

from strata_dist.kernels import KERNEL_DIR, sources
from strata_dist.kernels.abi import STRUCTS

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def test_the_package_has_kernel_sources():
    assert [p.name for p in sources()] == ["decode.cu"]


@needs_nvcc
@pytest.mark.parametrize("source", [p.name for p in sources()])
def test_kernel_compiles_for_hopper(tmp_path, source):
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "--std=c++17", "-Werror=all-warnings",
                           "-o", str(tmp_path / "k.cubin"), str(KERNEL_DIR / source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@needs_nvcc
def test_argument_tables_match_the_structs(tmp_path):
    """A host program built from decode.cu prints sizeof and every field's offset; they must be
    the numpy dtypes' (what the runner uploads)."""
    lines = []
    for struct, dtype in STRUCTS.items():
        lines.append(f'printf("{struct} size %zu\\n", sizeof({struct}));')
        for field in dtype.names:
            lines.append(f'printf("{struct} {field} %zu\\n", offsetof({struct}, {field}));')
    main = tmp_path / "abi.cu"
    main.write_text(f'#include <cstdio>\n#include <cstddef>\n#include "{KERNEL_DIR / "decode.cu"}"\n'
                    f'int main() {{ {" ".join(lines)} return 0; }}\n')
    exe = tmp_path / "abi"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", "-o", str(exe), str(main)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.split("\n")
    want = []
    for struct, dtype in STRUCTS.items():
        want.append(f"{struct} size {dtype.itemsize}")
        want += [f"{struct} {f} {dtype.fields[f][1]}" for f in dtype.names]
    assert [line for line in got if line] == want


def _nvrtc():
    """libnvrtc (the nvidia-cuda-nvrtc wheel of the test extras, or the system's), or None."""
    import ctypes
    import ctypes.util
    import glob
    import importlib.util
    paths = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        paths += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")))
    found = ctypes.util.find_library("nvrtc")
    paths += [found] if found else []
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _cuda_include():
    root = os.path.dirname(os.path.dirname(os.path.realpath(NVCC))) if NVCC else ""
    for d in (os.path.join(root, "include"), "/usr/local/cuda/include"):
        if os.path.exists(os.path.join(d, "cuda_fp16.h")):
            return d
    return None


@pytest.mark.parametrize("source", [p.name for p in sources()])
def test_kernel_compiles_with_nvrtc_as_cupy_does(source):
    """CuPy compiles the sources at run time with NVRTC, which has no system headers (no
    <math.h>): build them the same way here, so what nvcc accepts but NVRTC refuses shows too."""
    import ctypes
    from strata_dist.kernels import COMPILE_OPTIONS
    lib, include = _nvrtc(), _cuda_include()
    if lib is None or include is None:
        pytest.skip("no NVRTC library or CUDA headers")
    prog = ctypes.c_void_p()
    src = (KERNEL_DIR / source).read_text().encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, source.encode(), 0, None, None) == 0
    opts = [o.encode() for o in (*COMPILE_OPTIONS, "-arch=compute_90", f"-I{include}")]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, log.value.decode(errors="replace")
