"""Whether a stage pins the experts its cache lacks (strata_dist/experts/host_pinning.py): by default
wherever no other card's helper tier holds pairs for it, never past the host's available memory
unless forced. The helper-pair rule is read off real stages on CPU ranks with a real helper link."""

import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from strata_dist.experts.host_pinning import PIN_SHARE, pin_room_error, reads_host_in_place
from strata_dist.rank.stage import Stage, StageConfig


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tiny_qwen3moe(5, hidden=64, top_k=2, n_experts=8, n_layers=2),
                      tmp_path_factory.mktemp("pinning") / "m.gguf", "q8_0")


def _stage(model, helpers=()):
    return Stage(StageConfig(str(model), "cpu", 0, 2, True, True, 64,
                             cache_pairs=[(0, 0), (1, 0)], helpers=list(helpers)))


def test_default_pins_where_no_helper_holds_pairs(model, monkeypatch):
    monkeypatch.delenv("STRATA_HOST_MAPPED", raising=False)
    alone = _stage(model)
    # a helper link to an endpoint nobody serves: connecting is lazy, nothing is asked here
    helped = _stage(model, [(1, "tcp://127.0.0.1:9", [(0, 3), (1, 5)], False)])
    past_range = _stage(model, [(1, "tcp://127.0.0.1:9", [(7, 3)], False)])
    # this card's own helper tier, opened after the stage, holding pairs of its layers
    own_card = Stage(StageConfig(str(model), "cpu", 0, 2, True, True, 64,
                                 cache_pairs=[(0, 0), (1, 0)], local_helper_pairs=[(1, 4)]))
    try:
        assert not alone.tiers.asks_helpers and reads_host_in_place(alone.tiers)
        assert helped.tiers.asks_helpers and not reads_host_in_place(helped.tiers)
        # a helper whose pairs are all outside the stage's layers is no helper of this stage
        assert not past_range.tiers.asks_helpers and reads_host_in_place(past_range.tiers)
        # this card's own tier is read in place (by the decode graph, on a GPU): it asks no one
        assert not own_card.tiers.asks_helpers and reads_host_in_place(own_card.tiers)
        assert own_card.tiers.local_helper_pairs == 1
        monkeypatch.setenv("STRATA_HOST_MAPPED", "auto")
        assert reads_host_in_place(alone.tiers) and not reads_host_in_place(helped.tiers)
        monkeypatch.setenv("STRATA_HOST_MAPPED", "1")
        assert reads_host_in_place(helped.tiers)
        monkeypatch.setenv("STRATA_HOST_MAPPED", "0")
        assert not reads_host_in_place(alone.tiers)
        monkeypatch.setenv("STRATA_HOST_MAPPED", "yes")
        with pytest.raises(ValueError, match="STRATA_HOST_MAPPED='yes'"):
            reads_host_in_place(alone.tiers)
    finally:
        for st in (helped, past_range):
            for h in st.tiers.helpers:
                h.ch.close()


def test_default_leaves_room_in_host_memory(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       67108864 kB\nMemAvailable:   16777216 kB\n")  # 16 GiB
    monkeypatch.delenv("STRATA_HOST_MAPPED", raising=False)
    fits = int(PIN_SHARE * 16 * 2**30)
    assert pin_room_error(fits, str(meminfo)) == ""
    why = pin_room_error(fits + 2**30, str(meminfo))
    assert "16.0 GiB available" in why and "STRATA_HOST_MAPPED=1" in why
    monkeypatch.setenv("STRATA_HOST_MAPPED", "1")          # forced: the allocation decides
    assert pin_room_error(fits + 2**30, str(meminfo)) == ""
    assert pin_room_error(1, str(tmp_path / "absent")) == ""
