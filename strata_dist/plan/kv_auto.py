"""--kv-resident auto (plan.py make_plan): the most resident K/V cells with which a placement fits
everywhere, then each stage the most its own card holds. `plan_for` comes from plan.py (which
imports this module), so the search here plans through it."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

from .device import Device
from .errors import PlanError
from .lend import LEND_CHUNKS, own_prompt_room
from .params import PlanParams
from .pricing import kv_resident_floor
from .shape import ModelShape
# a plan.Plan: that module imports this one, so it is not imported back here
Plan = Any

def resident_floor(prompt_chunk: int | None) -> int:
    """--kv-resident's floor for the operator's chunk, or with --prefill auto (None) for the
    smallest chunk it picks (the ring then caps the chunk it picks)."""
    return kv_resident_floor(prompt_chunk or min(LEND_CHUNKS))


def auto_resident(plan_for: Callable[..., Plan], shape: ModelShape, devices: Sequence[Device],
                  cells: int, params: PlanParams, prompt_chunk: int | None, kw: dict) -> Plan:
    """--kv-resident auto: every cell when that fits, else a search for the most resident cells
    that fit, down to the floor (a placement fits or not; fewer cells never fit worse)."""
    def attempt(n: int) -> Plan:
        return plan_for(shape, devices, cells=cells, params=replace(params, kv_resident=n),
                        prompt_chunk=prompt_chunk, **kw)
    try:
        return attempt(0)
    except PlanError as e:
        whole = e
    lo, hi = resident_floor(prompt_chunk), cells - 1
    if lo > hi:
        raise whole
    try:
        best = attempt(lo)
    except PlanError as e:
        raise PlanError(f"--kv-resident auto: not even its floor of {lo} resident cells fits "
                        f"(every cell does not either): {e}") from None
    while lo < hi:                     # best fits with lo cells; is there room for more?
        mid = (lo + hi + 1) // 2
        try:
            best, lo = attempt(mid), mid
        except PlanError:
            hi = mid - 1
    # the placement that fits at `lo` cells everywhere; each stage then takes the most its own
    # card holds (stages differ in layers and cards in size): the card the search was bound by
    # keeps `lo`, the others grow into what their expert caches would have filled
    own = _resident_per_stage(shape, best, params.sessions, params.lend_pct)
    per_stage = best
    if any(n != lo for n in own.values()):
        try:
            per_stage = plan_for(shape, devices, cells=cells,
                                 params=replace(params, kv_resident=lo), prompt_chunk=prompt_chunk,
                                 resident_on=own, placed=best, **kw)
        except PlanError as e:   # not by the arithmetic above; said, and the uniform plan stands
            per_stage = replace(best, notes=best.notes + (
                f"--kv-resident auto: each stage's own count was refused ({e}); every stage "
                f"keeps {lo}",))
    said = ", ".join(f"stage {st.stage} ({st.device.label}) "
                     + (f"{st.kv_resident}" if st.kv_resident else f"all {cells}")
                     for st in per_stage.stages)
    return replace(per_stage, notes=per_stage.notes + (
        f"--kv-resident auto: cells of each K/V on the device per stage: {said} of {cells} "
        f"(every cell does not fit everywhere), the rest read from pinned host memory",))


def _resident_per_stage(shape: ModelShape, plan: Plan, sessions: int,
                        lend_pct: int) -> dict[Device, int]:
    """Each stage's resident cells for --kv-resident auto: its plan's count (the smallest that
    fit everywhere) plus what its cache budget holds of further cells, less the room its own
    prompt buffers of the plan's chunk take (an auto chunk's within its cap, lend.py), so the
    prompt path fits whether or not its shrunk cache can still lend; 0 (every cell) where the
    whole context fits."""
    out = {}
    prompt = own_prompt_room(shape.prompt_bytes(plan.prompt_chunk), plan.prompt_chunk_auto,
                             lend_pct)
    for st in plan.stages:
        per_cell = sessions * sum(shape.kv_bytes_per_cell[layer] for layer in range(st.lb, st.le)
                                  if shape.layer_kind[layer] == "attention")
        n = st.kv_resident or plan.cells
        if per_cell and st.kv_resident:
            n += max(0, st.budget_bytes - prompt) // per_cell
        out[st.device] = n if n < plan.cells else 0
    return out
