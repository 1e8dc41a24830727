"""Running the GPU rank's Python without a GPU: a check script of tests/ as its own process, with
the numpy stand-ins for CuPy (tests/fake_cupy) first on its path."""
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def stand_in_env() -> dict[str, str]:
    """This process's environment with tests/fake_cupy and the repo first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE / "fake_cupy"), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))


def run_check(script: str, *args: str, timeout: float) -> dict:
    """Run tests/`script` with `args` on the stand-ins; it must exit 0, and its report is the
    JSON object on the last line it prints."""
    done = subprocess.run([sys.executable, str(HERE / script), *args], env=stand_in_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
