"""plan/sessions.py: how many requests a server batches when --parallel is not given, read from
real plans of Qwen3-30B-A3B's geometry (the planner's own arithmetic, no stand-in)."""
from dataclasses import replace

from strata_dist.plan import Device, PlanParams, make_plan, qwen3_30b_a3b_shape
from strata_dist.plan.sessions import SESSIONS_AUTO, most_sessions

GIB = 1 << 30
CELLS = 32768


def _planner(free_gib: float):
    shape = qwen3_30b_a3b_shape()
    devices = [Device("card", int(free_gib * GIB) + GIB, int(free_gib * GIB), 3000.0, index=0)]
    asked = []

    def plan_for(sessions: int):
        asked.append(sessions)
        return make_plan(shape, devices, cells=CELLS, params=replace(PlanParams(), sessions=sessions),
                         split="none")
    return plan_for, asked


def test_a_card_with_room_to_spare_batches_the_most_candidates():
    """Every expert resident with tens of GiB left: 8 sessions cost no expert slot."""
    plan_for, asked = _planner(140)
    base = plan_for(1)
    plan = most_sessions(plan_for, base)
    assert plan.params.sessions == max(SESSIONS_AUTO) == 8
    assert plan.expert_slots == base.expert_slots
    assert plan.stages[0].session_bytes == 8 * base.stages[0].session_bytes


def test_a_card_whose_experts_fill_it_keeps_one_session():
    """A card too small for every expert: each session's K/V would take expert slots, so none is
    added (the rule never slows a single stream to batch)."""
    plan_for, asked = _planner(12)
    base = plan_for(1)
    assert base.expert_slots < 48 * 128                     # not every pair fits
    plan = most_sessions(plan_for, base)
    assert plan is base and plan.params.sessions == 1
    assert asked == [1, *sorted(SESSIONS_AUTO, reverse=True)]   # each candidate was priced


def test_the_most_that_fit_beside_every_slot_is_taken():
    """Room for every expert and a few sessions' K/V but not eight: the largest that fits."""
    plan_for, _ = _planner(140)
    every = plan_for(1)
    one_session = every.stages[0].session_bytes
    spare = every.stages[0].budget_bytes - every.stages[0].cache_bytes
    # a card whose spare memory beside every slot holds about 5 more sessions' K/V
    free = (every.devices[0].free_bytes - spare + 5 * one_session) / GIB
    plan_for, _ = _planner(free)
    base = plan_for(1)
    assert base.expert_slots == every.expert_slots
    plan = most_sessions(plan_for, base)
    assert plan.params.sessions == 4 and plan.expert_slots == base.expert_slots
