"""Profile ranking, coverage model, stage-cache fill and its memoisation."""
import numpy as np
import pytest

from test_plan_fixtures import MIB, make_devices, make_shape, skewed_profile
from strata_dist.plan import (CostModel, PlanParams, RankTables, RoutingProfile, cover_h, fill_stage,
                              pair_masses)


# --- profile ----------------------------------------------------------------------------------------
def test_uniform_ranking_interleaves_layers():
    prof = RoutingProfile.uniform(3, 4)
    assert prof.is_uniform
    # (e0,l0), (e0,l1), (e0,l2), (e1,l0), ... as flat ids layer*4+expert
    assert prof.ranking().tolist()[:6] == [0, 4, 8, 1, 5, 9]


def test_measured_ranking_is_by_mass_and_per_layer_descending():
    counts = np.array([[1, 5, 3, 0], [10, 0, 0, 30]], dtype=float)
    prof = RoutingProfile(counts)
    assert not prof.is_uniform
    rank = prof.ranking().tolist()
    assert rank[0] == 1 * 4 + 3       # 30/40 = 0.75 of layer 1 is the hottest share
    for layer in range(2):            # restricted to one layer: that layer's descending order
        mine = [p % 4 for p in rank if p // 4 == layer]
        assert [counts[layer, e] for e in mine] == sorted(counts[layer], reverse=True)
    np.testing.assert_allclose(prof.mass().sum(), 1.0)


def test_profile_round_trips():
    prof = skewed_profile(5, 7)
    assert RoutingProfile.from_bytes(prof.to_bytes()) == prof
    assert RoutingProfile.from_dict(prof.to_dict()) == prof
    with pytest.raises(ValueError, match="bad magic"):
        RoutingProfile.from_bytes(b"nope" * 8)
    with pytest.raises(ValueError, match="expected 280"):
        RoutingProfile.from_bytes(prof.to_bytes()[:-8])
    with pytest.raises(ValueError, match="the model is"):
        prof.check(5, 8)


def test_profile_is_a_value():
    counts = np.ones((2, 2))
    prof = RoutingProfile(counts)
    counts[0, 0] = 99
    assert prof.counts[0, 0] == 1
    with pytest.raises(ValueError):
        prof.counts[0, 0] = 5


# --- coverage -----------------------------------------------------------------------------------------
def test_cover_h_matches_the_validated_fit():
    # seed #390: 20,000 of 24,576 pairs held (f = 0.8138) gives 99.35% at b = 3
    assert cover_h(20000 / 24576, 3) == pytest.approx(0.99354, abs=1e-5)


def test_model_masses_are_increments_of_h_over_the_global_rank():
    prof = RoutingProfile.uniform(4, 8)
    rank = prof.ranking()
    m = pair_masses(prof, rank, "auto", 3.0)
    assert m.sum() == pytest.approx(1.0)
    held = rank[:10]                        # the 10 hottest pairs hold H(10/32)
    assert m[held].sum() == pytest.approx(cover_h(10 / 32, 3.0))
    assert np.all(np.diff(m[rank]) <= 1e-15)    # hotter pairs never take less


def test_measured_masses_used_for_non_uniform_profiles():
    prof = skewed_profile(3, 5)
    rank = prof.ranking()
    np.testing.assert_array_equal(pair_masses(prof, rank, "auto", 3.0), prof.mass().ravel())
    forced = pair_masses(prof, rank, "model", 3.0)
    assert forced[rank[0]] == pytest.approx(cover_h(1 / 15, 3.0))


# --- fill ---------------------------------------------------------------------------------------------
def test_fill_stops_at_the_first_pair_that_does_not_fit():
    shape = make_shape(n_layers=2, n_experts=3)
    rank = RoutingProfile.uniform(2, 3).ranking()   # 0(l0), 3(l1), 1(l0), 4(l1), ...
    b0, b1 = shape.blob_bytes
    f = fill_stage(shape, rank, 0, 2, b0 + b1 + b0 - 1)
    assert f.pairs == (0, 3) and f.bytes == b0 + b1
    # own layers only: a stage on [1, 2) never holds a layer-0 pair
    f = fill_stage(shape, rank, 1, 2, 10 * b1)
    assert f.pairs == (3, 4, 5)


@pytest.mark.parametrize("cap", [None, 0, 3, 7])
@pytest.mark.parametrize("profile_kind", ["uniform", "skewed"])
def test_tables_fill_equals_the_walk_on_every_range(cap, profile_kind):
    shape = make_shape(n_layers=7, n_experts=5, seed=3)     # blob sizes differ per layer
    prof = RoutingProfile.uniform(7, 5) if profile_kind == "uniform" else skewed_profile(7, 5)
    rank = prof.ranking()
    tables = RankTables(shape, rank, pair_masses(prof, rank, "auto", 3.0))
    rng = np.random.default_rng(0)
    for lb in range(7):
        for le in range(lb + 1, 8):
            for budget in [0, 1, shape.blob_bytes[lb], *rng.integers(0, 40 * MIB, 6).tolist(), 10 ** 12]:
                assert tables.fill(lb, le, budget, cap) == fill_stage(shape, rank, lb, le, budget, cap)


def test_memoisation_changes_nothing():
    shape = make_shape(n_layers=9, n_experts=6, seed=5)
    devs = make_devices([300, 420, 700], bw=[200, 300, 500])
    prof = skewed_profile(9, 6)
    params = PlanParams()
    warm = CostModel(shape, devs, prof, 2048, params)
    S, T = warm.stage_table()
    rng = np.random.default_rng(1)
    keys = [(d, lb, le) for d in range(3) for lb in range(9) for le in range(lb + 1, 10)]
    for i in rng.permutation(len(keys)):       # visit in a random order, twice
        d, lb, le = keys[i]
        first = warm.fill(d, lb, le)
        assert warm.fill(d, lb, le) is first
        cold = CostModel(shape, devs, prof, 2048, params)   # a fresh memo for every query
        assert cold.fill(d, lb, le) == first
        assert first == fill_stage(shape, prof.ranking(), lb, le, warm.budget(d, lb, le))
        # the vectorised table (all ranges at once) agrees with the memoised scalar path
        assert S[d, lb, le] == pytest.approx(cold.stage_term(d, lb, le), rel=1e-12, abs=1e-12)
        if warm.budget(d, lb, le) >= 0:
            assert len(first.pairs) == int(warm.tables.span(warm.tables.count, lb, le, T[d, lb, le]))
