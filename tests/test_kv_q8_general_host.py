"""Why tests/test_gpu_kv_q8_mirror.py's general case failed its write check on the H100 (issue 47:
from step 0 on, layer 3's K and V cells with scales 2 f16 ulps and 4-9 % of codes one step from
the graph's), shown on the host with the general path's own code (tests/kv_q8_general_check.py:
that case's sequence on the CuPy backend's numpy stand-ins, numpy's float32 runner taking the
decode graph's steps).

The general path's q8_0 write is the graph's arithmetic, but at the default compute options its
dense products are f16 (ops/linear.py gemm_f16: rows, q8_0 weights and product rounded to f16),
in decode steps as in prompts, so the K and V it quantizes are not the floats the graph's
float32 matvecs give: every step's cells part from the graph's by the H100's signature (scales
two ulps or more, several percent of codes one step), while the prompt, written by the general
path on both sides, agrees. Under the options the mirror test now builds its runners with
(REFERENCE_OPTIONS: float32_prompt_kernels' float32 products) every step is within its write
bound (kv_mirror.WRITE_BOUND); with the options it had (none), the second test here fails."""
import pytest

from kv_mirror import WRITE_BOUND, beyond_write_bound
from stand_ins import run_check

pytestmark = pytest.mark.timeout(600)
STEPS = 40          # the mirror test's general case's


@pytest.fixture(scope="module")
def measured():
    return run_check("kv_q8_general_check.py", timeout=540)


def test_both_attention_layers_the_prompt_and_every_step_were_compared(measured):
    for options in ("default", "mirror"):
        m = measured[options]
        assert m["layers"] == [3, 7]
        assert len(m["steps"]) == STEPS
        # the prompt is the general path's on both sides, as on the GPU
        assert not beyond_write_bound(m["prompt"]), (options, m["prompt"])


def test_under_the_mirror_tests_options_every_step_writes_the_graphs_cells(measured):
    beyond = [(i, d) for i, d in enumerate(measured["mirror"]["steps"]) if beyond_write_bound(d)]
    assert not beyond, (beyond, WRITE_BOUND)


def test_at_the_default_options_every_step_parts_by_f16_roundings(measured):
    """Past the bound at every step, but never by more than one code step (a wrong block,
    scale, head or cell would move most codes by many)."""
    for i, d in enumerate(measured["default"]["steps"]):
        assert beyond_write_bound(d), (i, d)
        assert d["code_max"] == 1, (i, d)
        assert d["scale_ulps"] >= 2, (i, d)
