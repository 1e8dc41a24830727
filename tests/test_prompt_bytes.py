"""A prompt chunk's buffers on the GPU path are the fixed layout the plan prices (plan/workspace.py:
ModelShape.prompt_bytes is what a loan or a stage's own prompt buffers are sized by, and the same
layout is what the stage carves), for qwen3moe and qwen3next at two geometries each
(tests/prompt_bytes_check.py: the backend's Python on numpy stand-ins for CuPy whose arrays count
their bytes while they live). A chunk that allocated outside its layout would take memory the
plan never priced; a buffer no path writes would be cache lent for nothing."""

import pytest

from stand_ins import run_check

pytestmark = pytest.mark.timeout(600)
NAMES = ["qwen3moe", "qwen3moe, 8 of 32 experts", "qwen3next", "qwen3next, 8 heads"]
# written by one path only: the runner (every expert resident) groups on the device and streams
# nothing; the stage (a partial cache) writes both groupings (a short chunk's on the host) and
# streams its misses
HOST_GROUPED = {"pack", "pack_blobs", "stream"}


@pytest.fixture(scope="module")
def measured():
    return run_check("prompt_bytes_check.py", timeout=540)


def test_both_architectures_at_two_geometries_were_measured(measured):
    assert sorted(measured) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_what_is_carved_is_what_is_priced(measured, name):
    m = measured[name]
    for part in ("runner", "stage"):
        assert m[part]["carved"] == m[part]["priced"], (part, m[part])
        assert m[part]["overflow"] == 0, (part, m[part])
    # the loan the plan sizes for the stage's chunk holds the layout
    assert m["stage"]["lent"] >= m["stage"]["carved"], m["stage"]
    assert m["stage"]["streamed"] > 0, m["stage"]       # the misses went through the workspace


@pytest.mark.parametrize("name", NAMES)
def test_a_one_chunk_prompt_borrows_only_what_its_rows_take(measured, name):
    """A prompt shorter than the plan's chunk lends the slots its own rows' layout takes (fewer
    pairs evicted, streamed and refilled), carves that layout, overflows nothing, and gives every
    slot back."""
    s = measured[name]["stage"]["short"]
    assert s["lent_slots"] == s["want_slots"] < s["plan_slots"], s
    assert s["carved"] == s["priced"] and s["overflow"] == 0, s
    assert s["resident_after"] == s["cached"], s


@pytest.mark.parametrize("name", NAMES)
def test_a_stage_that_holds_every_pair_carves_no_stream_buffer(measured, name):
    """Its cache holds every pair and it lends nothing, so no miss streams: its own buffers are the
    resident layout the plan prices for it (plan/lend.py), allocated once, and nothing overflows."""
    r = measured[name]["resident_stage"]
    assert r["carved"] == r["priced"] == r["own"], r
    assert "stream" in measured[name]["layout"] and "stream" not in r["layout"], r["layout"]
    assert r["overflow"] == 0 and r["streamed"] == 0, r
    assert len(set(r["outside"].values())) == 1, r["outside"]
    assert r["priced"] < measured[name]["stage"]["priced"]


@pytest.mark.parametrize("name", NAMES)
def test_a_chunk_allocates_nothing_that_grows_with_it(measured, name):
    """Outside the workspace a chunk allocates only what does not depend on its length (the
    head's logits after the last chunk, kernel tables): the same bytes at either chunk size."""
    for part in ("runner", "stage"):
        outside = measured[name][part]["outside"]
        assert len(set(outside.values())) == 1, (part, outside)


@pytest.mark.parametrize("name", NAMES)
def test_every_priced_buffer_is_written(measured, name):
    m = measured[name]
    layout, runner, stage = set(m["layout"]), set(m["runner"]["taken"]), set(m["stage"]["taken"])
    assert runner <= layout and stage <= layout
    assert layout - runner <= HOST_GROUPED, layout - runner
    assert layout - stage == set(), layout - stage
    assert runner | stage == layout
