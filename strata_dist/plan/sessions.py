"""How many requests a server batches when the operator does not say (`strata-launch --port`
without --parallel): the most sessions the plan carves without giving up anything a single
session's plan has. Pure: the caller passes how to plan for B sessions.

Why this rule: a batched decode step of B rows reads each chosen expert once per row group, so
up to B streams share one step's weight reads (the serve records in docs/BENCHMARKS.md), but each
session's K/V is carved from the same memory the expert cache fills. A default that evicted
experts to make room for sessions would slow every single stream; one that keeps every expert
slot (and the split) costs nothing but memory that was idle."""
from __future__ import annotations

from typing import Callable

from .errors import PlanError
from .plan import Plan

# the candidates, most first: 8 streams keep most of the batched step's gain measured on one
# card (4 streams 1.65x, 16 streams 1.71x one stream's aggregate rate) at half 16's latency
SESSIONS_AUTO = (8, 4, 2)


def most_sessions(plan_for: Callable[[int], Plan], base: Plan,
                  candidates: tuple[int, ...] = SESSIONS_AUTO) -> Plan:
    """The plan of the most sessions among `candidates` whose stages keep `base`'s layer ranges
    and every one of its expert slots (stage caches and helper tiers); `base` (one session)
    where none does. `plan_for(b)` plans for b sessions (PlanError: b does not fit)."""
    for b in sorted(candidates, reverse=True):
        if b <= base.params.sessions:
            break
        try:
            plan = plan_for(b)
        except PlanError:
            continue
        same_split = [(s.lb, s.le) for s in plan.stages] == [(s.lb, s.le) for s in base.stages]
        if same_split and plan.expert_slots >= base.expert_slots:
            return plan
    return base
