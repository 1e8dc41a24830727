"""The plan's price for a prompt chunk's buffers (ModelShape.prompt_bytes_per_token: what a loan
or a stage's own prompt buffers are sized by) against what the GPU path's chunk really holds at
once, for qwen3moe and qwen3next at two geometries each (tests/prompt_bytes_check.py: the
backend's Python on numpy stand-ins for CuPy whose arrays count their bytes while they live). A
price below the path's live bytes is a loan that overflows into CuPy's pool, outside the budget;
one far above it is cache lent for nothing."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def measured():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE / "fake_cupy"), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(HERE / "prompt_bytes_check.py")], env=env,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_both_architectures_at_two_geometries_were_measured(measured):
    assert sorted(measured) == ["qwen3moe", "qwen3moe, 8 of 32 experts", "qwen3next",
                                "qwen3next, 8 heads"]
    for name, m in measured.items():
        # the buffers grow with the chunk (the peak at 256 tokens is well above the one at 64)
        assert m["peaks"]["256"] > 3 * m["peaks"]["64"], (name, m)


@pytest.mark.parametrize("name", ["qwen3moe", "qwen3moe, 8 of 32 experts", "qwen3next",
                                  "qwen3next, 8 heads"])
def test_the_price_covers_a_chunks_buffers(measured, name):
    m = measured[name]
    assert m["priced_per_token"] >= m["per_token"], m
    # the price sums a layer's phases; on these files it stays within about 1.6x of the live set
    assert m["priced_per_token"] <= 1.6 * m["per_token"], m
    # what does not grow with the chunk (a quantized dense matrix decoded to f16 for one GEMM)
    # stays inside the stage's work reserve
    from strata_dist.plan.pricing import STAGE_WORK_RESERVE_BYTES
    assert m["fixed"] <= STAGE_WORK_RESERVE_BYTES // 8, m
