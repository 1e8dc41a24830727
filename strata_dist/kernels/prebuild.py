"""Build the kernel binaries ahead, with nvcc, where device time is not spent (kernels/__init__.py:
$STRATA_KERNEL_CUBINS). Each source is built once per KernelShape asked for (decode.cu takes the
shapes' -D defines; the other sources none), from the same inlined text and options `module`
hands NVRTC, into files named by `cubin_name`:

    python -m strata_dist.kernels.prebuild --out .kcubins --shape int_gate_up=0,int_down=0
    STRATA_KERNEL_CUBINS=$PWD/.kcubins python ...      # on the GPU machine

They are not NVRTC's binaries bit for bit: CuPy appends -ftz=true to the options of every NVRTC
compile (this build flushes no denormal), and the libnvrtc CuPy loads may be another release of
the compiler than this nvcc. So two runs compare like with like only where both load binaries of one
kind: an older tree's arm (benchmarks/tree_arm.py) builds its own into the same folder.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import COMPILE_OPTIONS, cubin_name, source_text, sources
from .abi import KernelShape

SHAPED = "decode.cu"          # the one source whose build depends on the KernelShape


def builds(shapes: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(source, defines) for every source at the default shape, and decode.cu at each shape."""
    out = [(p.name, ()) for p in sources()]
    for text in shapes:
        defines = KernelShape.parse(text).defines()
        if (SHAPED, defines) not in out:
            out.append((SHAPED, defines))
    return out


def build(nvcc: str, name: str, defines: tuple[str, ...], arch: str, out: Path) -> Path:
    target = out / cubin_name(name, defines, arch)
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / name
        src.write_text(source_text(name))
        done = subprocess.run([nvcc, f"-arch=sm_{arch}", "-cubin", *COMPILE_OPTIONS, *defines,
                               "-o", str(Path(tmp) / "k.cubin"), str(src)],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc {name} {' '.join(defines)}: {done.stderr.strip()}")
        shutil.move(str(Path(tmp) / "k.cubin"), target)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the cubins")
    ap.add_argument("--arch", default="90", help="compute capability (default 90: H100/H200)")
    ap.add_argument("--shape", action="append", default=[],
                    help="a KernelShape text to build decode.cu for (repeatable; the default "
                         "shape is always built)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("error: nvcc is not on PATH", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        todo = builds(args.shape)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = [pool.submit(build, nvcc, name, d, args.arch, out) for name, d in todo]
        try:
            for (name, d), f in zip(todo, futures):
                print(f"{f.result().name}  {name} {' '.join(d)}".rstrip())
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
