"""Helper tiers: byte budget, disjointness, rank order, stripes, fail soft."""
import numpy as np
import pytest

from test_plan_fixtures import MIB, make_devices, make_shape, skewed_profile
from strata_dist.plan import (HELPER_RESERVE_BYTES, PlanParams, RoutingProfile, make_plan, select_helpers,
                              skip_tier)


def flat(shape, pairs):
    return [l * shape.n_experts + e for l, e in pairs]


@pytest.mark.parametrize("seed", range(5))
def test_selection_respects_budget_disjointness_and_rank_order(seed):
    rng = np.random.default_rng(seed)
    shape = make_shape(n_layers=10, n_experts=16, seed=seed)      # blob sizes differ per layer
    prof = skewed_profile(10, 16, seed)
    rank = prof.ranking()
    held = set(rng.choice(160, 40, replace=False).tolist())       # what the stage caches hold
    devs = make_devices([0, 0, 0])
    offers = [(d, HELPER_RESERVE_BYTES + int(b)) for d, b in zip(devs, rng.integers(5 * MIB, 120 * MIB, 3))]
    tiers = select_helpers(shape, rank, held, offers)

    seen = set()
    for t, (_, left) in zip(tiers, offers):
        ids = flat(shape, t.pairs)
        assert t.budget_bytes == left - HELPER_RESERVE_BYTES
        assert t.bytes == sum(shape.blob_bytes[l] for l, _ in t.pairs) <= t.budget_bytes   # byte budget
        assert not set(ids) & held                        # disjoint from the stage caches
        assert not set(ids) & seen                        # and from each other
        seen |= set(ids)
        pos = {p: i for i, p in enumerate(rank.tolist())}
        assert [pos[p] for p in ids] == sorted(pos[p] for p in ids)   # each tier in rank order
    unheld = [p for p in rank.tolist() if p not in held]
    assert seen == set(unheld[:len(seen)])                # together: a prefix of the unheld ranking
    if len(seen) < len(unheld):                            # stopped at a pair no tier could hold
        nxt = shape.blob_bytes[unheld[len(seen)] // 16]
        assert all(t.budget_bytes - t.bytes < nxt for t in tiers if not t.skipped)


def test_budget_is_bytes_not_slots():
    shape = make_shape(n_layers=2, n_experts=8)
    small, big = sorted(shape.blob_bytes)
    # one tier with room for exactly 3 blobs of the bigger layer's size
    rank = RoutingProfile.uniform(2, 8).ranking()
    (dev,) = make_devices([0])
    (tier,) = select_helpers(shape, rank, [], [(dev, HELPER_RESERVE_BYTES + 3 * big)])
    sizes = [shape.blob_bytes[l] for l, _ in tier.pairs]
    assert sum(sizes) <= 3 * big
    assert len(tier.pairs) == 3 or sum(sizes) + shape.blob_bytes[rank[len(tier.pairs)] // 8] > 3 * big


def test_pairs_are_striped_over_the_tiers():
    shape = make_shape(n_layers=4, n_experts=8)
    rank = RoutingProfile.uniform(4, 8).ranking()
    devs = make_devices([0, 0])
    tiers = select_helpers(shape, rank, [], [(d, HELPER_RESERVE_BYTES + 100 * MIB) for d in devs])
    a, b = (flat(shape, t.pairs) for t in tiers)
    assert a[:3] == rank[0:6:2].tolist() and b[:3] == rank[1:6:2].tolist()


def test_fail_soft_reasons():
    shape = make_shape(n_layers=4, n_experts=8)
    rank = RoutingProfile.uniform(4, 8).ranking()
    devs = make_devices([0, 0])
    small, roomy = (devs[0], HELPER_RESERVE_BYTES + 1 * MIB), (devs[1], HELPER_RESERVE_BYTES + 50 * MIB)
    t_small, t_roomy = select_helpers(shape, rank, [], [small, roomy])
    assert t_small.skipped and "holds no expert" in t_small.reason and t_small.pairs == ()
    assert not t_roomy.skipped and t_roomy.pairs
    off = select_helpers(shape, rank, [], [roomy], enabled=False)[0]
    assert off.skipped and "STRATA_REMOTE_AUTO=0" in off.reason
    full = select_helpers(shape, rank, range(32), [roomy])[0]
    assert full.skipped and "already held" in full.reason


def test_a_tier_holds_only_pairs_of_the_stages_it_serves():
    """GPU stages read tiers of their own host in place; a tier on another host would be asked by
    request, off the decode graph, so it takes none of their pairs. Each tier's pairs are a rank
    prefix of the unheld pairs it may hold; a CPU stage's pairs go to any tier."""
    shape = make_shape(n_layers=4, n_experts=8)
    rank = skewed_profile(4, 8).ranking()
    a0, a1, b0, b1 = make_devices([0] * 4, hosts=["a", "a", "b", "b"])
    readers = [a0, a0, b0, b0]                     # layers 0-1 on host a, 2-3 on host b
    offers = [(a1, HELPER_RESERVE_BYTES + 100 * MIB), (b1, HELPER_RESERVE_BYTES + 100 * MIB)]
    on_a, on_b = select_helpers(shape, rank, [], offers, readers=readers)
    assert {l for l, _ in on_a.pairs} <= {0, 1} and {l for l, _ in on_b.pairs} <= {2, 3}
    pos = {p: i for i, p in enumerate(rank.tolist())}
    for tier, layers in ((on_a, {0, 1}), (on_b, {2, 3})):
        mine = [p for p in rank.tolist() if p // 8 in layers]
        assert flat(shape, tier.pairs) == mine[:len(tier.pairs)] and tier.pairs
        assert [pos[p] for p in flat(shape, tier.pairs)] == sorted(pos[p] for p in flat(shape, tier.pairs))
    # only host b's stage is a CPU rank: host a's tier may now hold its pairs too
    (cpu_b,) = make_devices([0], hosts=["b"], kinds=["cpu"])
    on_a, on_b = select_helpers(shape, rank, [], offers, readers=[a0, a0, cpu_b, cpu_b])
    assert {l for l, _ in on_a.pairs} == {0, 1, 2, 3} and {l for l, _ in on_b.pairs} <= {2, 3}
    # a tier on a host that runs no GPU stage it could serve is skipped, saying why
    (c0,) = make_devices([0], hosts=["c"])
    (lone,) = select_helpers(shape, rank, [], [(c0, HELPER_RESERVE_BYTES + 100 * MIB)], readers=readers)
    assert lone.skipped and "serves no stage" in lone.reason and "other hosts than c" in lone.reason


def test_a_two_host_plan_keeps_each_hosts_tiers_for_its_own_gpu_stages():
    shape = make_shape(n_layers=8, n_experts=32)
    devs = make_devices([900, 900], bw=[300] * 2, hosts=["a", "b"])    # one stage card a host
    plan = make_plan(shape, devs, cells=2048, split=[4], order="as_given",
                     params=PlanParams(stage_cache_slots=10))
    host_of = {l: st.device.host for st in plan.stages for l in range(st.lb, st.le)}
    assert len(set(host_of.values())) == 2 and plan.live_helpers
    for h in plan.live_helpers:
        assert all(host_of[l] == h.device.host for l, _ in h.pairs), h


def test_plan_helpers_take_every_cards_leftover_and_skip_tier_drops_one():
    shape = make_shape(n_layers=8, n_experts=32)
    devs = make_devices([600, 900, 900], bw=[300, 300, 300])
    # pin the stage caches small so the stage cards have leftover and unheld pairs remain
    plan = make_plan(shape, devs, cells=2048, split=[4], order="as_given",
                     params=PlanParams(stage_cache_slots=10))
    assert len(plan.stages) == 2 and plan.expert_slots_stages <= 20
    # the seeds' reporting: every tier of every card; the primary figure is the first card alone
    assert plan.expert_slots_primary == plan.stages[0].cache_slots < plan.expert_slots_stages
    helper_only = [h for h in plan.helpers if plan.stage_on(h.device) is None]
    assert helper_only and not helper_only[0].skipped      # the card that runs no stage is a helper
    stage_tiers = [h for h in plan.helpers if plan.stage_on(h.device) is not None]
    assert any(not h.skipped for h in stage_tiers)         # a stage card's leftover is a tier too
    primary = {p for s in plan.stages for p in s.pairs}
    extra = [p for h in plan.live_helpers for p in h.pairs]
    assert len(extra) == len(set(extra)) and not set(extra) & primary
    assert plan.expert_slots == plan.expert_slots_stages + len(extra)
    for dev in plan.devices:
        assert plan.left_bytes(dev) >= 0

    victim = plan.live_helpers[0]
    soft = skip_tier(plan, victim.device, "cudaMalloc failed")
    tier = soft.helper_on(victim.device)
    assert tier.skipped and tier.reason == "cudaMalloc failed"
    assert soft.expert_slots == plan.expert_slots - len(victim.pairs)
    assert soft.expert_cache_mib == pytest.approx(plan.expert_cache_mib - victim.bytes / MIB)
    assert soft.expert_slots_stages == plan.expert_slots_stages
    assert soft.coverage_all == pytest.approx(plan.coverage_all - victim.mass)


def test_remote_auto_off_keeps_every_tier_skipped():
    shape = make_shape(n_layers=8, n_experts=32)
    plan = make_plan(shape, make_devices([600, 700, 900]), cells=2048, split=[4],
                     params=PlanParams(remote_auto=False, stage_cache_slots=100))
    assert all(h.skipped for h in plan.helpers) and plan.expert_slots == plan.expert_slots_stages
