"""A batched step's last stage on a GPU, run on the CuPy stand-ins (tests/batched_rows_check.py):
the replays of a step go out back to back, the rows' logits stay on the card (only each row's
greedy token and two flags come back), and each row's token is the one the host sampler draws
from the same row (greedy, and seeded sampling), a row with a NaN or no finite logit refused
for its own request only. The kernels do not run: the GPU's numbers are
tests/test_gpu_batched_decode.py's."""
import pytest

from stand_ins import run_check


@pytest.fixture(scope="module")
def report():
    return run_check("batched_rows_check.py", timeout=300)


def test_the_replays_of_a_step_go_out_before_any_wait(report):
    assert report["graph"] == "DecodeGraph"
    assert report["events"] == ["launch 0", "launch 1", "wait 0", "wait 1"]


def test_no_row_of_logits_is_copied_to_the_host(report):
    # ten rows' greedy tokens, finite flags and NaN flags: 30 numbers, never a vocabulary row
    assert 0 < report["largest_copy_back"] < report["vocab"], report


def test_each_row_draws_what_the_host_sampler_draws_from_it(report):
    assert report["tokens_as_host_draws"], (report["got"], report["want"])
    assert report["got"]["106"] == "NaN" and report["got"]["103"] == "not numbers"
