"""The plan as a value: JSON round trip, the table, and a Qwen3-30B-A3B-geometry plan end to end."""
import json

import pytest

from test_plan_fixtures import (MIB, hybrid_kinds, make_devices, make_shape, reference_helper_ms,
                                reference_score, skewed_profile)
from strata_dist.plan import (Plan, PlanParams, RoutingProfile, devices_from_json, make_plan, qwen3_30b_a3b_shape,
                              render_table, session_bytes, skip_tier, weights_bytes)

RIG = [  # two 12 GB and two 16 GB cards
    {"name": "RTX 3060", "total_mib": 12288, "free_mib": 11900, "mem_bandwidth_gbs": 360},
    {"name": "RTX 3060", "total_mib": 12288, "free_mib": 11900, "mem_bandwidth_gbs": 360},
    {"name": "RTX 5060 Ti", "total_mib": 16311, "free_mib": 15900, "mem_bandwidth_gbs": 448},
    {"name": "RTX 5060 Ti", "total_mib": 16311, "free_mib": 15900, "mem_bandwidth_gbs": 448},
]


@pytest.fixture(scope="module")
def qwen_plan():
    return make_plan(qwen3_30b_a3b_shape(), devices_from_json(RIG), cells=32768, split="auto")


def test_json_round_trip_is_exact(qwen_plan):
    text = qwen_plan.to_json()
    back = Plan.from_json(text)
    assert back == qwen_plan
    assert back.to_json() == text


def test_json_round_trip_with_skipped_tiers_fallbacks_and_a_measured_profile():
    shape = make_shape(n_layers=8, n_experts=32, kinds=hybrid_kinds(8))
    plan = make_plan(shape, make_devices([600, 900, 900], bw=[250, 300, None], hosts=["a", "a", "b"]),
                     cells=2048, split=[4], profile=skewed_profile(8, 32),
                     params=PlanParams(stage_cache_slots=10, cover_b=2.5))
    assert plan.live_helpers and any(st.own_prompt_bytes for st in plan.stages)
    assert Plan.from_json(plan.to_json()) == plan
    soft = skip_tier(plan, plan.live_helpers[0].device, "could not open")
    assert Plan.from_json(soft.to_json()) == soft != plan


def test_json_shape(qwen_plan):
    d = json.loads(qwen_plan.to_json())
    assert d["expert_slots"] == qwen_plan.expert_slots and d["expert_slots_primary"] == qwen_plan.expert_slots_primary
    assert d["expert_slots_stages"] == sum(len(s["pairs"]) for s in d["stages"])
    for s, st in zip(d["stages"], qwen_plan.stages):
        assert (s["lb"], s["le"]) == (st.lb, st.le)
    d["expert_slots"] += 1
    with pytest.raises(ValueError, match="expert_slots .* disagrees"):
        Plan.from_dict(d)


def test_qwen3_30b_plan_is_consistent(qwen_plan):
    shape = qwen3_30b_a3b_shape()
    plan = qwen_plan
    # stages tile [0, 48) in order
    assert plan.stages[0].lb == 0 and plan.stages[-1].le == 48
    assert all(a.le == b.lb for a, b in zip(plan.stages, plan.stages[1:]))
    for st in plan.stages:
        first, last = st.lb == 0, st.le == 48
        assert st.weights_bytes == weights_bytes(shape, st.lb, st.le, first, last)
        assert st.session_bytes == session_bytes(shape, 32768, st.lb, st.le)
        assert all(st.lb <= l < st.le for l, _ in st.pairs)          # own layers only
        assert st.cache_bytes == len(st.pairs) * shape.blob_bytes[0]
        assert plan.left_bytes(st.device) >= 0
    # every pair held at most once across all tiers
    everything = [p for s in plan.stages for p in s.pairs] + [p for h in plan.live_helpers for p in h.pairs]
    assert len(everything) == len(set(everything)) == plan.expert_slots
    assert plan.expert_cache_mib == pytest.approx(plan.expert_slots * shape.blob_bytes[0] / MIB)
    assert plan.prompt_chunk in (8192, 6144, 4096, 3072, 2048, 1024, 512, 256) and plan.prompt_chunk_auto
    # the reported prediction is the score of the chosen placement, with its helper tiers priced
    devs = list(plan.devices)
    idx = tuple(devs.index(s.device) for s in plan.stages)
    bounds = tuple(s.lb for s in plan.stages) + (48,)
    uniform = RoutingProfile.uniform(48, 128)
    assert plan.compute_ms + plan.miss_ms + plan.handoff_ms == pytest.approx(reference_score(
        shape, devs, uniform, 32768, PlanParams(), idx, bounds))
    assert plan.live_helpers
    assert plan.helper_ms - (plan.miss_ms - plan.host_miss_ms) == pytest.approx(
        reference_helper_ms(shape, plan, uniform, PlanParams()))
    assert plan.helper_ms < plan.miss_ms - plan.host_miss_ms   # a tier read in place beats the host


def test_render_table(qwen_plan):
    text = render_table(qwen_plan)
    for word in ("role", "[lb, le)", "weights", "session", "loan", "cache", "helper", "slots", "left",
                 "expert_slots", "ms/token", "prompt chunk"):
        assert word in text
    assert (f"expert_slots {qwen_plan.expert_slots} (stage caches {qwen_plan.expert_slots_stages}, "
            f"the first card's {qwen_plan.expert_slots_primary})") in text
    for st in qwen_plan.stages:
        assert f"[{st.lb}, {st.le})" in text
    assert len(text.splitlines()) >= 2 + len(qwen_plan.devices)


def test_stage_cache_pin_and_fallback_refill():
    shape = make_shape(n_layers=8, n_experts=32)
    plan = make_plan(shape, make_devices([900, 900]), cells=2048, split=[4],
                     params=PlanParams(stage_cache_slots=20))
    assert all(st.cache_slots <= 20 for st in plan.stages)
    # a stage that cannot lend gives its own buffers room from its cache
    plan = make_plan(shape, make_devices([600, 600]), cells=2048, split=[4], prompt_chunk=1024)
    for st in plan.stages:
        if st.own_prompt_bytes:
            assert st.loan_slots == 0 and st.note
            assert st.cache_bytes + st.own_prompt_bytes <= st.budget_bytes
        assert plan.left_bytes(st.device) >= 0


def test_hand_off_buffers_are_priced_for_the_plans_own_chunk():
    """A boundary reserves one prompt chunk of hidden rows (what a rank allocates), not the
    largest chunk there could be: with a chunk below HANDOFF_ROWS, the difference is cache."""
    from strata_dist.plan import HANDOFF_ROWS, STAGE_WORK_RESERVE_BYTES, HEAD_RESERVE_BYTES
    shape = qwen3_30b_a3b_shape()
    rig = devices_from_json(RIG)
    for cells, prompt_chunk in ((32768, 1024), (32768, 4096), (2048, None)):   # the last: auto chunk
        plan = make_plan(shape, rig, cells=cells, split=[16, 32], order="as_given",
                         prompt_chunk=prompt_chunk)
        assert plan.prompt_chunk < HANDOFF_ROWS and plan.prompt_chunk == (prompt_chunk or plan.prompt_chunk)
        for st in plan.stages:
            ends = (st.stage > 0) + (st.stage < len(plan.stages) - 1)
            head = HEAD_RESERVE_BYTES if st.stage == len(plan.stages) - 1 else 0
            assert st.reserve_bytes == (STAGE_WORK_RESERVE_BYTES + head
                                        + ends * plan.prompt_chunk * shape.hidden * 4)
    wide = make_plan(shape, rig, cells=32768, split=[16, 32], order="as_given", prompt_chunk=8192)
    narrow = make_plan(shape, rig, cells=32768, split=[16, 32], order="as_given", prompt_chunk=1024)
    middle = 1
    freed = 2 * (8192 - 1024) * shape.hidden * 4
    assert narrow.stages[middle].reserve_bytes == wide.stages[middle].reserve_bytes - freed


def test_the_fixed_cost_per_layer_moves_the_prediction_never_the_choice():
    """Every placement holds every layer once: layer_ms adds n_layers * layer_ms to each score."""
    shape = make_shape(n_layers=8, n_experts=32, kinds=hybrid_kinds(8))
    devices = make_devices([600, 900, 900], bw=[250, 300, None], hosts=["a", "a", "b"])
    kwargs = dict(cells=2048, split="auto", profile=skewed_profile(8, 32))
    without = make_plan(shape, devices, params=PlanParams(layer_ms=0.0), **kwargs)
    default = make_plan(shape, devices, **kwargs)
    assert [(s.device, s.lb, s.le, s.pairs) for s in default.stages] == \
           [(s.device, s.lb, s.le, s.pairs) for s in without.stages]
    assert default.predicted_ms_per_token == pytest.approx(
        without.predicted_ms_per_token + 8 * PlanParams().layer_ms)
    assert default.compute_ms == pytest.approx(without.compute_ms + 8 * PlanParams().layer_ms)


@pytest.mark.parametrize("peer_gbs", [300.0, 20.0])
@pytest.mark.parametrize("stage_kind", ["cuda", "cpu"])
def test_helper_tiers_are_priced_by_where_they_sit(peer_gbs, stage_kind):
    """A stage's own card, another card of its host, another host: each tier's pairs are priced
    as read from there (the reference walks pair by pair), the host misses they spare are taken
    off, and a tier skipped at start gives its pairs back to the host misses. GPU stages read
    tiers of their host in place and hold none on another host (a request would take their
    decode off its graph); CPU stages ask every tier but their own by request."""
    shape = make_shape(n_layers=8, n_experts=32)
    prof = skewed_profile(8, 32)
    params = PlanParams(stage_cache_slots=6, peer_gbs=peer_gbs, miss_ms=0.01)
    plan = make_plan(shape, make_devices([700, 700, 900, 900], bw=[250, 300, 300, 200],
                                         hosts=["a", "a", "a", "b"],
                                         kinds=[stage_kind] * 3 + ["cuda"]),
                     cells=2048, split=[4], profile=prof, params=params, order="as_given")
    stage_devices = {s.device for s in plan.stages}
    assert {s.device.host for s in plan.stages} == {"a"}
    kinds = {("own" if h.device in stage_devices else "peer" if h.device.host == "a" else "host")
             for h in plan.live_helpers}
    if stage_kind == "cpu":
        assert kinds == {"own", "peer", "host"}, plan.helpers
    else:
        assert kinds == {"own", "peer"}, plan.helpers
        (other_host,) = [h for h in plan.helpers if h.device.host == "b"]
        assert other_host.skipped and "serves no stage" in other_host.reason
    assert plan.helper_ms - (plan.miss_ms - plan.host_miss_ms) == pytest.approx(
        reference_helper_ms(shape, plan, prof, params))
    assert plan.predicted_ms_per_token == pytest.approx(
        plan.compute_ms + plan.host_miss_ms + plan.helper_ms + plan.handoff_ms)
    assert "helper reads" in render_table(plan)
    bare = plan
    for h in plan.live_helpers:
        bare = skip_tier(bare, h.device, "could not open")
    assert bare.helper_ms == 0 and bare.host_miss_ms == bare.miss_ms == plan.miss_ms
    assert bare.predicted_ms_per_token == pytest.approx(
        plan.compute_ms + plan.miss_ms + plan.handoff_ms)


def test_a_tier_on_a_rank_sharing_the_stages_card_is_read_at_the_cards_bandwidth():
    """Two ranks listed on one GPU: the tier of one is the other's card memory, so its reads are
    priced at that card's bandwidth whatever peer_gbs says; on two cards they are not."""
    shape = make_shape(n_layers=8, n_experts=32)
    prof = skewed_profile(8, 32)
    helper_ms = {}
    for cards in (["x", "x"], ["x", "y"]):
        for peer_gbs in (300.0, 1.0):
            params = PlanParams(stage_cache_slots=6, peer_gbs=peer_gbs, miss_ms=0.01)
            plan = make_plan(shape, make_devices([700, 900], bw=[250, 250], cards=cards), cells=2048,
                             split=[4], profile=prof, params=params, order="as_given")
            assert plan.live_helpers, plan.helpers
            assert plan.helper_ms - (plan.miss_ms - plan.host_miss_ms) == pytest.approx(
                reference_helper_ms(shape, plan, prof, params))
            helper_ms[cards[1], peer_gbs] = plan.helper_ms
    assert helper_ms["x", 300.0] == pytest.approx(helper_ms["x", 1.0])
    assert helper_ms["y", 1.0] > helper_ms["y", 300.0]

