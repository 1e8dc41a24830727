"""The split search: the exhaustive search and the DP return the true optimum of the score."""
import numpy as np
import pytest

from test_plan_fixtures import (MIB, brute_force, hybrid_kinds, make_devices, make_shape, reference_score,
                                skewed_profile)
from strata_dist.plan import (CostModel, PlanError, PlanParams, RoutingProfile, make_plan, price_split,
                              search_dp, search_exhaustive)

CELLS = 2048


def rigs():
    """Small rigs where the optimum is not trivial: tight and roomy cards, mixed speeds, two hosts."""
    yield make_devices([260, 300, 420, 650], bw=[200, 450, 300, 600])
    yield make_devices([700, 350, 350], bw=[300, 300, 900])
    yield make_devices([400, 500, 380, 450], bw=[300, 300, 300, 300], hosts=["a", "a", "b", "b"])
    yield make_devices([900, 240], bw=[100, 800])
    # two ranks sharing one card (a GPU listed twice) beside two cards of their own
    yield make_devices([300, 300, 420, 650], bw=[300, 300, 450, 600], cards=["x", "x", "y", "z"])


@pytest.mark.parametrize("rig", list(rigs()), ids=lambda r: f"{len(r)}dev")
@pytest.mark.parametrize("profile_kind", ["uniform", "skewed"])
def test_exhaustive_equals_brute_force(rig, profile_kind):
    shape = make_shape(n_layers=9, n_experts=5, seed=11)
    prof = RoutingProfile.uniform(9, 5) if profile_kind == "uniform" else skewed_profile(9, 5)
    params = PlanParams(miss_ms=0.4)
    cm = CostModel(shape, rig, prof, CELLS, params)
    got = search_exhaustive(cm)
    want, where = brute_force(shape, rig, prof, CELLS, params)
    assert where is not None and got is not None
    assert got.score == pytest.approx(want, rel=1e-12)
    # and the placement it returns really scores that (by the definition, not the tables)
    assert reference_score(shape, rig, prof, CELLS, params, got.devices, got.bounds) == pytest.approx(got.score)


@pytest.mark.parametrize("n_dev", [5, 6, 7, 8])
def test_dp_equals_brute_force_for_5_to_8_devices(n_dev):
    rng = np.random.default_rng(n_dev)
    shape = make_shape(n_layers=8, n_experts=4, seed=n_dev, kinds=hybrid_kinds(8))
    free = rng.integers(200, 520, n_dev).tolist()
    bw = rng.integers(150, 900, n_dev).tolist()
    hosts = ["a" if i < n_dev // 2 else "b" for i in range(n_dev)]
    cards = ["shared", "shared"] + [f"c{i}" for i in range(2, n_dev)]   # ranks 0 and 1 share a card
    devs = make_devices(free, bw=bw, hosts=hosts, cards=cards)
    prof = skewed_profile(8, 4, seed=n_dev)
    params = PlanParams(miss_ms=0.5, handoff_ms=0.02)
    got = search_dp(CostModel(shape, devs, prof, CELLS, params))
    want, _ = brute_force(shape, devs, prof, CELLS, params)
    assert got.score == pytest.approx(want, rel=1e-12)
    assert reference_score(shape, devs, prof, CELLS, params, got.devices, got.bounds) == pytest.approx(got.score)


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_exhaustive_up_to_4_devices(seed):
    rng = np.random.default_rng(seed)
    shape = make_shape(n_layers=20, n_experts=8, seed=seed)
    devs = make_devices(rng.integers(250, 900, 4).tolist(), bw=rng.integers(100, 900, 4).tolist())
    cm = CostModel(shape, devs, skewed_profile(20, 8, seed), CELLS, PlanParams(miss_ms=0.3))
    ex, dp = search_exhaustive(cm), search_dp(cm)
    assert (ex is None) == (dp is None)
    if ex is not None:
        assert dp.score == pytest.approx(ex.score, rel=1e-12)


def test_search_with_the_stage_cache_pin_and_no_slicing():
    shape = make_shape(n_layers=7, n_experts=5, seed=2)
    devs = make_devices([800, 900, 700], bw=[300, 500, 400])
    for params in (PlanParams(stage_cache_slots=4), PlanParams(weight_slice=False)):
        cm = CostModel(shape, devs, RoutingProfile.uniform(7, 5), CELLS, params)
        want, _ = brute_force(shape, devs, RoutingProfile.uniform(7, 5), CELLS, params)
        assert search_exhaustive(cm).score == pytest.approx(want, rel=1e-12)


def test_a_card_may_run_no_stage():
    # one card is too small for any stage: the search skips it, the plan makes it a helper
    shape = make_shape(n_layers=6, n_experts=4)
    devs = make_devices([600, 150, 600], bw=[300, 300, 300])
    plan = make_plan(shape, devs, cells=CELLS, split="auto", order="as_given")
    assert "gpu1" not in {s.device.name for s in plan.stages}
    assert plan.stage_on(devs[1]) is None and plan.helper_on(devs[1]) is not None


def test_faster_card_runs_the_last_stage():
    shape = make_shape(n_layers=8, n_experts=4)
    devs = make_devices([500, 500], bw=[900, 200])
    plan = make_plan(shape, devs, cells=CELLS, split=[4])
    assert plan.stages[-1].device.name == "gpu0"
    plan = make_plan(shape, devs, cells=CELLS, split=[4], order="as_given")
    assert plan.stages[-1].device.name == "gpu1"


def test_cross_host_hand_offs_cost_more():
    shape = make_shape(n_layers=8, n_experts=4)
    same = CostModel(shape, make_devices([500, 500]), RoutingProfile.uniform(8, 4), CELLS, PlanParams())
    apart = CostModel(shape, make_devices([500, 500], hosts=["a", "b"]), RoutingProfile.uniform(8, 4), CELLS,
                      PlanParams())
    assert apart.links[0, 1] > same.links[0, 1] == PlanParams().handoff_ms


# --- explicit split points ------------------------------------------------------------------------------
def test_explicit_split_is_priced_as_given():
    shape = make_shape(n_layers=10, n_experts=4)
    devs = make_devices([500, 500, 500], bw=[300, 300, 300])
    prof = RoutingProfile.uniform(10, 4)
    cm = CostModel(shape, devs, prof, CELLS, PlanParams())
    p = price_split(cm, [3, 7])
    assert p.bounds == (0, 3, 7, 10) and p.devices == (0, 1, 2)
    assert p.score == pytest.approx(reference_score(shape, devs, prof, CELLS, PlanParams(), (0, 1, 2), p.bounds))
    plan = make_plan(shape, devs, cells=CELLS, split=[3, 7])
    assert [(s.lb, s.le) for s in plan.stages] == [(0, 3), (3, 7), (7, 10)]
    assert plan.method == "explicit"


def test_explicit_split_with_fewer_stages_than_devices_picks_devices():
    shape = make_shape(n_layers=10, n_experts=4)
    devs = make_devices([500, 500, 500], bw=[100, 300, 900])
    plan = make_plan(shape, devs, cells=CELLS, split=[5], order="as_given")
    assert len(plan.stages) == 2
    assert plan.stages[-1].device.name == "gpu2"     # the fastest pair wins


@pytest.mark.parametrize("points, n_dev, match", [
    ([5, 5], 3, r"must rise strictly.*stage 2 would run \[5, 5\), which is empty"),
    ([6, 3], 3, r"must rise strictly.*stage 2 would run \[6, 3\)"),
    ([0], 2, r"stage 1 would run \[0, 0\)"),
    ([10], 2, r"stage 2 would run \[10, 10\)"),
    ([2, 4, 6], 3, "makes 4 stages but only 3 devices"),
    ([5], 1, "needs at least 2 devices, got 1"),
])
def test_split_point_refusals(points, n_dev, match):
    shape = make_shape(n_layers=10, n_experts=4)
    with pytest.raises(PlanError, match=match):
        make_plan(shape, make_devices([900] * n_dev), cells=CELLS, split=points)


def test_a_device_listed_twice_is_refused():
    d = make_devices([500])[0]
    with pytest.raises(PlanError, match="localhost:0 is listed twice"):
        make_plan(make_shape(), [d, d], cells=CELLS)


def test_auto_split_with_one_device_is_refused():
    with pytest.raises(PlanError, match="--layer-split auto needs at least 2 devices, got 1"):
        make_plan(make_shape(), make_devices([900]), cells=CELLS, split="auto")


def test_stage_without_room_is_refused_with_the_numbers():
    shape = make_shape(n_layers=10, n_experts=4)
    devs = make_devices([600, 100])
    with pytest.raises(PlanError) as e:
        make_plan(shape, devs, cells=CELLS, split=[5], order="as_given")
    msg = str(e.value)
    assert "stage 2 [5, 10) on 1 gpu1 needs" in msg and "MiB free" in msg and "100.0 MiB free" in msg


def test_nothing_fits_is_refused_with_the_numbers():
    shape = make_shape(n_layers=10, n_experts=4)
    with pytest.raises(PlanError, match=r"no placement of the 10 layers fits on 2 device\(s\).*MiB free"):
        make_plan(shape, make_devices([120, 130]), cells=CELLS, split="auto")


def test_skip_if_fits_uses_one_card_counting_its_full_dense_cost():
    shape = make_shape(n_layers=6, n_experts=48)      # enough slots to lend above the 128-slot floor
    from strata_dist.plan.pricing import stage_fixed_bytes
    everything = sum(stage_fixed_bytes(shape, CELLS, 0, 6)) + 48 * sum(shape.blob_bytes)
    fits = make_devices([400, everything / MIB + 1], bw=[300, 300])
    plan = make_plan(shape, fits, cells=CELLS, split="auto", skip_if_fits=True)
    assert plan.method == "skip_if_fits" and len(plan.stages) == 1
    assert plan.stages[0].device.name == "gpu1"
    assert plan.stages[0].weights_bytes == sum(shape.layer_dense_bytes) + shape.embed_bytes + shape.head_bytes
    assert plan.expert_slots_primary == 6 * 48 and plan.stages[0].own_prompt_bytes == 0
    # one byte short of everything: the split search runs instead
    short = make_devices([400, (everything - 1) / MIB], bw=[300, 300])
    assert make_plan(shape, short, cells=CELLS, split="auto", skip_if_fits=True).method == "exhaustive"


def test_eight_devices_use_the_dp():
    shape = make_shape(n_layers=16, n_experts=4)
    plan = make_plan(shape, make_devices([300] * 8), cells=CELLS, split="auto")
    assert plan.method == "dp"


@pytest.mark.parametrize("rig", list(rigs()), ids=lambda r: f"{len(r)}dev")
def test_expert_cache_zero_keeps_the_profile_in_the_search(rig):
    """--expert-cache 0 (stage_cache_slots=0): nothing is resident, yet the placement is the one
    the profile chooses with filled caches (with empty fills every placement would tie, and a
    skewed and a uniform profile would give the same plan)."""
    shape = make_shape(n_layers=9, n_experts=5, seed=11)
    for prof in (RoutingProfile.uniform(9, 5), skewed_profile(9, 5)):
        auto = make_plan(shape, rig, cells=CELLS, profile=prof, params=PlanParams(miss_ms=0.4))
        none = make_plan(shape, rig, cells=CELLS, profile=prof,
                         params=PlanParams(miss_ms=0.4, stage_cache_slots=0))
        assert [(s.device, s.lb, s.le) for s in none.stages] == \
            [(s.device, s.lb, s.le) for s in auto.stages]
        assert all(not s.pairs and s.cache_bytes == 0 for s in none.stages)
        assert none.predicted_ms_per_token >= auto.predicted_ms_per_token


@pytest.mark.parametrize("n_dev,method", [(3, "exhaustive"), (6, "dp")])
def test_equal_cards_get_equal_shares_when_scores_tie(n_dev, method):
    """Every pair cached on every card of an even split, so many splits score the same (the
    compute is the same bytes over the same bandwidth): the tie goes to the split whose most-asked
    card is asked least, not to one that leaves the first card mostly idle."""
    from dataclasses import replace as dc_replace
    L = 48
    shape = dc_replace(make_shape(n_layers=L, n_experts=8), layer_dense_bytes=[20 * MIB] * L,
                       router_bytes=[MIB // 2] * L, blob_bytes=[4 * MIB] * L,
                       kv_bytes_per_cell=[1024] * L, embed_bytes=0, head_bytes=0)
    per_layer = 20 * MIB + 8 * 4 * MIB + 1024 * CELLS
    # a card holds a bit more than its share: several splits cache everything and tie
    free = (L * per_layer / n_dev * 1.25 + 600 * MIB) / MIB
    devs = make_devices([free] * n_dev, bw=[300] * n_dev)
    cm = CostModel(shape, devs, RoutingProfile.uniform(L, 8), CELLS, PlanParams(handoff_ms=0.0))
    got = search_exhaustive(cm, max_stages=n_dev) if method == "exhaustive" else search_dp(cm)
    sizes = [e - b for b, e in got.ranges]
    # equal shares of memory: the last card also holds the head's reserve, middle ones two
    # hand-off buffers, so layer counts differ by a layer or two at most
    assert len(sizes) == n_dev and max(sizes) - min(sizes) <= 2, got.ranges


@pytest.mark.parametrize("cards", [["c0", "c0", "c1"], ["c1", "c0", "c0"]])
def test_a_split_does_not_cross_two_ranks_sharing_a_card(cards):
    """Two ranks on one card take turns on it (shared_card_handoff_ms a hop, and the token's way
    back is a hop too), so two stages go on two cards when either choice fits."""
    shape = make_shape(n_layers=8, n_experts=4)
    devs = make_devices([400, 400, 400], bw=[300, 300, 300], cards=cards)
    plan = make_plan(shape, devs, cells=CELLS, order="as_given")
    a, b = (s.device for s in plan.stages)
    assert not a.shares_card_with(b)
    assert plan.handoff_ms == pytest.approx(2 * PlanParams().handoff_ms)
    shared = [d for d in devs if d.card == "c0"]
    cm = CostModel(shape, shared, RoutingProfile.uniform(8, 4), CELLS, PlanParams())
    assert cm.links[0, 1] == cm.back[1, 0] == PlanParams().shared_card_handoff_ms
    forced = make_plan(shape, shared, cells=CELLS, split=[4], order="as_given")
    assert forced.handoff_ms == pytest.approx(2 * PlanParams().shared_card_handoff_ms)
    from strata_dist.plan import render_table
    a, b = shared
    assert f"{a.label} and {b.label} share one card" in render_table(forced)
    apart = make_plan(shape, make_devices([400, 400], cards=["c0", "c1"]), cells=CELLS, split=[4])
    assert "share one card" not in render_table(apart)


def test_ranks_of_one_card_that_measured_it_alone_split_its_free_memory():
    """Two ranks started without budgets on one card each see all of it free: the plan gives each
    half; a rank a budget capped keeps its budget and the other takes the rest; other cards and
    ranks without a card are left as they are."""
    from strata_dist.plan import Device, split_shared_cards
    gib = 1 << 30
    card = dict(total_bytes=140 * gib, host="h")
    alone = [Device("a", free_bytes=100 * gib, index=0, card="u0", **card),
             Device("b", free_bytes=100 * gib, index=1, card="u0", **card),
             Device("c", free_bytes=100 * gib, index=2, card="u1", **card),
             Device("cpu", total_bytes=8 * gib, free_bytes=8 * gib, index=3)]
    assert [d.free_bytes // gib for d in split_shared_cards(alone)] == [50, 50, 100, 8]
    budgeted = [Device("a", total_bytes=30 * gib, free_bytes=30 * gib, host="h", index=0, card="u0"),
                alone[1]]
    assert [d.free_bytes // gib for d in split_shared_cards(budgeted)] == [30, 70]
    split = [Device("a", total_bytes=50 * gib, free_bytes=50 * gib, host="h", index=i, card="u0")
             for i in range(2)]
    assert split_shared_cards(split) == split


@pytest.mark.parametrize("seed", range(3))
def test_dp_over_runs_of_identical_devices_equals_brute_force(seed):
    """Runs of identical ranks (one card listed many times, many CPU ranks) are cut to L devices
    each before the DP (interchangeable_runs_cut): the optimum is still the brute force's, over
    runs longer than L, runs sharing a card, and runs on two hosts."""
    from strata_dist.plan.search import interchangeable_runs_cut
    rng = np.random.default_rng(seed)
    L = 3
    shape = make_shape(n_layers=L, n_experts=4, seed=seed, kinds=hybrid_kinds(L))
    tight, roomy = (int(x) for x in rng.integers(200, 320, 2))
    free = [tight] * 5 + [roomy] * 4 + [tight] * 2
    cards = [""] * 5 + ["s"] * 4 + [""] * 2
    hosts = ["a"] * 9 + ["b"] * 2
    devs = make_devices(free, bw=[300] * 5 + [500] * 4 + [300] * 2, hosts=hosts, cards=cards)
    prof = skewed_profile(L, 4, seed=seed)
    params = PlanParams(miss_ms=0.5, handoff_ms=0.02, shared_card_handoff_ms=0.3)
    cm = CostModel(shape, devs, prof, CELLS, params)
    assert interchangeable_runs_cut(cm) == [0, 1, 2, 5, 6, 7, 9, 10]
    got = search_dp(cm)
    want, _ = brute_force(shape, devs, prof, CELLS, params)
    assert got.score == pytest.approx(want, rel=1e-12)
    assert reference_score(shape, devs, prof, CELLS, params, got.devices, got.bounds) == pytest.approx(got.score)


@pytest.mark.timeout(60)
def test_plan_for_a_thousand_identical_ranks_is_quick():
    """The DP sees L devices of a run of identical ranks, not all of them (it was cubic in their
    number: 256 CPU ranks took 26 s, 1,000 did not finish in a minute)."""
    import time
    shape = make_shape(n_layers=6, n_experts=4)
    devs = make_devices([300] * 1000, bw=[300] * 1000, kinds=["cpu"] * 1000)
    t0 = time.monotonic()
    plan = make_plan(shape, devs, cells=CELLS)
    assert time.monotonic() - t0 < 20
    assert plan.stages
