"""The plan as a value: what each card runs and holds, built by make_plan, sent to the ranks as JSON.

make_plan: order the devices, search (or price explicit split points), fill the chosen stages'
caches, plan the prompt loans, then select helper tiers on every card's leftover. Nothing here
allocates; the ranks allocate exactly what their part of the plan says.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Sequence

from protocol.codec import from_dict as record_from_dict, to_dict as record_to_dict
from protocol.compute_options import ComputeOptions

from .device import Device, order_devices
from .errors import PlanError
from .explicit import ExplicitTier, explicit_tiers, stage_devices as named_stage_devices
from .fill import Fill, coverage_mode
from .helpers import HelperTier, Pair, select_helpers
from .kv_auto import auto_resident, resident_floor
from .lend import Participant, plan_lend, with_own_bytes
from .params import KV_RESIDENT_AUTO, PlanParams
from .pricing import (HANDOFF_ROWS, HELPER_RESERVE_BYTES, KV_SINK_CELLS, MIB, session_host_bytes,
                      stage_fixed_bytes)
from .profile import RoutingProfile
from .score import CostModel
from .search import (Placement, check_split_points, price_split, search, search_exhaustive,
                     search_fixed, shortfall_message)
from .shape import ModelShape

# 9: each stage says its own resident K/V cells (kv_resident; --kv-resident auto gives each card
# its own)
# 8: stages price their kept conversations (--conversation-cache-mib): conversation_bytes/_in
# 7: the launch's compute options (protocol/compute_options.py) kept beside the params
# 6: helper tiers say whether the operator sized them (explicit)
# 4: devices name their card, the token's way back priced; 3: helper tiers priced (saved_ms,
# read_ms); 2: *_stages totals
PLAN_FORMAT = "strata-plan/9"


@dataclass(frozen=True)
class StagePlan:
    """Stage `stage` runs layers [lb, le) on `device`; its cache holds `pairs` (rank order — the
    prompt loan borrows from the tail). budget_bytes = free - weights - session - reserve."""

    stage: int
    device: Device
    lb: int
    le: int
    weights_bytes: int
    session_bytes: int
    reserve_bytes: int
    budget_bytes: int
    pairs: tuple[Pair, ...]
    cache_bytes: int
    slot_bytes: int
    loan_slots: int
    loan_bytes: int
    own_prompt_bytes: int
    mass: float
    note: str = ""
    # --conversation-cache-mib: the most this stage's kept conversations take (its own layers'
    # K/V and state), on its device ("device": taken before its expert cache fills; host memory
    # on a CPU stage) or, where the cards had no room for it, in pinned host memory ("host")
    conversation_bytes: int = 0
    conversation_in: str = "device"
    # --kv-resident: what the stage's sessions keep of K/V in pinned host memory beyond the
    # resident cells (kv_resident) on its device; 0: every cell resident
    kv_host_bytes: int = 0
    # --kv-resident: cells of each K/V this stage keeps on its device (its sinks and ring); 0:
    # every cell. An explicit N is every stage's; auto gives each stage the most its card holds
    kv_resident: int = 0

    @property
    def cache_slots(self) -> int:
        return len(self.pairs)


@dataclass(frozen=True)
class Plan:
    devices: tuple[Device, ...]          # planning order (stage order)
    stages: tuple[StagePlan, ...]
    helpers: tuple[HelperTier, ...]      # one per device, skipped ones included (with a reason)
    cells: int
    prompt_chunk: int
    prompt_chunk_auto: bool
    method: str                          # exhaustive | dp | explicit | single | skip_if_fits
    compute_ms: float
    miss_ms: float                       # host misses with the stage caches alone
    handoff_ms: float
    params: PlanParams = field(default_factory=PlanParams)
    notes: tuple[str, ...] = ()
    # the launch's compute switches: kept, printed and sent with the plan (every rank runs them;
    # the ranks' own environments do not count); they move none of its numbers
    compute: ComputeOptions = field(default_factory=ComputeOptions)

    # --- totals (derived, so they cannot disagree with the parts) --------------------------------
    @property
    def live_helpers(self) -> tuple[HelperTier, ...]:
        return tuple(h for h in self.helpers if not h.skipped)

    @property
    def host_miss_ms(self) -> float:
        """Host misses per decode token once the live helper tiers hold their pairs."""
        return self.miss_ms - sum(h.saved_ms for h in self.live_helpers)

    @property
    def helper_ms(self) -> float:
        """What a decode token spends reading the live helper tiers' pairs."""
        return sum(h.read_ms for h in self.live_helpers)

    @property
    def predicted_ms_per_token(self) -> float:
        """compute + host misses + helper reads + hand-offs (a tier skipped at start, fail
        soft, leaves its pairs to the host misses again)."""
        return self.compute_ms + self.host_miss_ms + self.helper_ms + self.handoff_ms

    # expert_slots / expert_cache_mib: every tier of every card. *_stages: the stage caches.
    # *_primary: the first stage's card alone (the figure single-card reports gave, kept so runs
    # can be compared with them).
    @property
    def expert_slots_stages(self) -> int:
        return sum(s.cache_slots for s in self.stages)

    @property
    def expert_slots_primary(self) -> int:
        return self.stages[0].cache_slots if self.stages else 0

    @property
    def expert_slots(self) -> int:
        return self.expert_slots_stages + sum(len(h.pairs) for h in self.live_helpers)

    @property
    def expert_cache_stages_mib(self) -> float:
        return sum(s.cache_bytes for s in self.stages) / MIB

    @property
    def expert_cache_primary_mib(self) -> float:
        return (self.stages[0].cache_bytes if self.stages else 0) / MIB

    @property
    def expert_cache_mib(self) -> float:
        return self.expert_cache_stages_mib + sum(h.bytes for h in self.live_helpers) / MIB

    @property
    def coverage_primary(self) -> float:
        """Share of routed expert activations the stage caches hold (predicted)."""
        return sum(s.mass for s in self.stages)

    @property
    def coverage_all(self) -> float:
        return self.coverage_primary + sum(h.mass for h in self.live_helpers)

    def resident_by_device(self) -> tuple[int, ...]:
        """Each device's resident K/V cells (planning order): its stage's, or the launch's
        --kv-resident where it runs none (a helper tier has no K/V)."""
        return tuple(st.kv_resident if st is not None else self.params.kv_resident
                     for st in map(self.stage_on, self.devices))

    def stage_on(self, device: Device) -> StagePlan | None:
        return next((s for s in self.stages if s.device == device), None)

    def helper_on(self, device: Device) -> HelperTier | None:
        return next((h for h in self.helpers if h.device == device), None)

    def left_bytes(self, device: Device) -> int:
        """What the device has left after everything the plan puts on it."""
        used = 0
        st = self.stage_on(device)
        if st is not None:
            used += (st.weights_bytes + st.session_bytes + st.reserve_bytes + st.own_prompt_bytes
                     + st.cache_bytes
                     + (st.conversation_bytes if st.conversation_in == "device" else 0))
        h = self.helper_on(device)
        if h is not None:
            used += h.reserve_bytes + h.bytes
        return device.free_bytes - used

    # --- JSON: the value the ranks receive ------------------------------------------------------
    def to_dict(self) -> dict:
        pos = {d: i for i, d in enumerate(self.devices)}
        stages = []
        for s in self.stages:
            d = {k: v for k, v in s.__dict__.items() if k not in ("device", "pairs")}
            if not d["kv_host_bytes"]:
                del d["kv_host_bytes"]     # every cell resident: the stage as it was before
            if not d["kv_resident"]:
                del d["kv_resident"]
            d.update(device=pos[s.device], cache_slots=s.cache_slots, pairs=[list(p) for p in s.pairs])
            stages.append(d)
        helpers = []
        for h in self.helpers:
            d = {k: v for k, v in h.__dict__.items() if k not in ("device", "pairs")}
            d.update(device=pos[h.device], slots=len(h.pairs), pairs=[list(p) for p in h.pairs])
            helpers.append(d)
        return {
            "format": PLAN_FORMAT,
            "cells": self.cells, "prompt_chunk": self.prompt_chunk, "prompt_chunk_auto": self.prompt_chunk_auto,
            "method": self.method,
            "predicted_ms_per_token": self.predicted_ms_per_token, "compute_ms": self.compute_ms,
            "miss_ms": self.miss_ms, "handoff_ms": self.handoff_ms,
            "host_miss_ms": self.host_miss_ms, "helper_ms": self.helper_ms,
            "expert_slots": self.expert_slots, "expert_slots_stages": self.expert_slots_stages,
            "expert_slots_primary": self.expert_slots_primary,
            "expert_cache_mib": self.expert_cache_mib,
            "expert_cache_stages_mib": self.expert_cache_stages_mib,
            "expert_cache_primary_mib": self.expert_cache_primary_mib,
            "devices": [d.to_dict() for d in self.devices],
            "stages": stages, "helpers": helpers,
            "params": self.params.to_dict(), "notes": list(self.notes),
            "compute": record_to_dict(self.compute),
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("format") != PLAN_FORMAT:
            raise ValueError(f"plan format {d.get('format')!r}, expected {PLAN_FORMAT!r}")
        devices = tuple(Device.from_dict(x) for x in d["devices"])

        def pairs(x) -> tuple[Pair, ...]:
            return tuple((int(a), int(b)) for a, b in x)

        stages = tuple(StagePlan(**{**{k: v for k, v in s.items() if k != "cache_slots"},
                                    "device": devices[s["device"]], "pairs": pairs(s["pairs"])})
                       for s in d["stages"])
        helpers = tuple(HelperTier(**{**{k: v for k, v in h.items() if k != "slots"},
                                      "device": devices[h["device"]], "pairs": pairs(h["pairs"])})
                        for h in d["helpers"])
        # a plan written before the prompt chunk had one name keeps it as "chunk", "chunk_auto"
        old = "prompt_chunk" not in d
        plan = cls(devices=devices, stages=stages, helpers=helpers, cells=d["cells"],
                   prompt_chunk=d["chunk" if old else "prompt_chunk"],
                   prompt_chunk_auto=d["chunk_auto" if old else "prompt_chunk_auto"],
                   method=d["method"], compute_ms=d["compute_ms"],
                   miss_ms=d["miss_ms"], handoff_ms=d["handoff_ms"],
                   params=PlanParams.from_dict(d["params"]), notes=tuple(d["notes"]),
                   compute=record_from_dict(ComputeOptions, d["compute"]))
        for key in ("expert_slots", "expert_slots_stages", "expert_slots_primary", "expert_cache_mib",
                    "expert_cache_stages_mib", "expert_cache_primary_mib", "predicted_ms_per_token",
                    "host_miss_ms", "helper_ms"):
            if d[key] != getattr(plan, key):
                raise ValueError(f"plan JSON: {key} = {d[key]} disagrees with its parts ({getattr(plan, key)})")
        return plan

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def skip_tier(plan: Plan, device: Device, reason: str) -> Plan:
    """Fail soft: the helper tier on `device` could not open. It stays in the plan, marked skipped
    with the reason; totals no longer count it."""
    if plan.helper_on(device) is None:
        raise ValueError(f"no helper tier on {device.label}")
    return replace(plan, helpers=tuple(h.skip(reason) if h.device == device else h for h in plan.helpers))


def _skip_if_fits(cm: CostModel, stage_set: Sequence[int] | None) -> Placement | None:
    """--split-skip-if-fits: one card when everything — the FULL dense cost (its free bytes were
    measured before any weights existed), session, reserves and every expert blob — fits there.
    The fastest such card (devices are in stage order, fastest last) of those that may run a
    stage."""
    L, E = cm.shape.n_layers, cm.shape.n_experts
    for d in reversed(range(len(cm.devices)) if stage_set is None else stage_set):
        everything = int(cm.fixed[d, 0, L]) + E * sum(cm.shape.blob_bytes)
        if cm.free[d] >= everything:
            return Placement((d,), (0, L), cm.score((d,), (0, L)), "skip_if_fits")
    return None


def _no_fit_message(cm: CostModel) -> str:
    L = cm.shape.n_layers
    biggest = max(range(len(cm.devices)), key=lambda d: cm.free[d])
    w, s, _ = stage_fixed_bytes(cm.shape, cm.cells, 0, L, weight_slice=cm.params.weight_slice,
                                resident=cm.params.kv_resident, sessions=cm.params.sessions)
    return (f"no placement of the {L} layers fits on {len(cm.devices)} device(s): "
            f"{shortfall_message(cm, biggest, 0, L, 1)}; the whole model's dense weights and session need "
            f"{(w + s) / MIB:.1f} MiB at {cm.cells} cells before per-stage reserves, "
            f"{sum(cm.free) / MIB:.1f} MiB are free in total")


def _place(cm: CostModel, split, skip_if_fits: bool, stage_set: Sequence[int] | None = None,
           placed: Plan | None = None) -> Placement:
    if placed is not None:
        return _kept_placement(cm, placed)
    n = len(cm.devices)
    if not isinstance(split, str):
        check_split_points(split, cm.shape.n_layers, n)   # refuse nonsense even when one card would do
    if skip_if_fits:
        p = _skip_if_fits(cm, stage_set)
        if p is not None:
            return p
    if stage_set is not None:
        return _place_on(cm, split, stage_set)
    if split == "none":
        p = search_exhaustive(cm, max_stages=1)
        if p is None:
            raise PlanError(_no_fit_message(cm))
        return replace(p, method="single")
    if split == "auto":
        if n < 2:
            raise PlanError(f"--layer-split auto needs at least 2 devices, got {n}")
        p = search(cm)
        if p is None:
            raise PlanError(_no_fit_message(cm))
        return p
    if isinstance(split, str):
        raise ValueError(f"split {split!r}: expected 'auto', 'none' or a sequence of split points")
    return price_split(cm, split)


def _kept_placement(cm: CostModel, placed: Plan) -> Placement:
    """`placed`'s stages (devices, layer ranges) priced by cm; PlanError where one no longer fits
    its card."""
    devices = tuple(cm.devices.index(st.device) for st in placed.stages)
    bounds = (*(st.lb for st in placed.stages), placed.stages[-1].le)
    for i, d in enumerate(devices):
        if cm.budget(d, bounds[i], bounds[i + 1]) < 0:
            raise PlanError(shortfall_message(cm, d, bounds[i], bounds[i + 1], i + 1))
    return Placement(devices, bounds, cm.score(devices, bounds), placed.method)


def _place_on(cm: CostModel, split, stage_set: Sequence[int]) -> Placement:
    """--stage-gpus: one stage on each named card, in planning order; the split points explicit
    (as many stages as cards) or searched."""
    if not isinstance(split, str):
        return price_split(cm, split, stage_set)
    if split == "none" and len(stage_set) > 1:
        names = ", ".join(cm.devices[d].label for d in stage_set)
        raise PlanError(f"one stage was asked, but --stage-gpus names {len(stage_set)} cards ({names})")
    if split not in ("auto", "none"):
        raise ValueError(f"split {split!r}: expected 'auto', 'none' or a sequence of split points")
    if len(stage_set) > cm.shape.n_layers:
        raise PlanError(f"--stage-gpus names {len(stage_set)} cards; the model has "
                        f"{cm.shape.n_layers} layers")
    p = search_fixed(cm, stage_set)
    if p is None:
        L = cm.shape.n_layers
        w, s, _ = stage_fixed_bytes(cm.shape, cm.cells, 0, L, weight_slice=cm.params.weight_slice,
                                    resident=cm.params.kv_resident, sessions=cm.params.sessions)
        free = ", ".join(f"{cm.devices[d].label} {cm.free[d] / MIB:.1f}" for d in stage_set)
        raise PlanError(f"no split of the {L} layers over the --stage-gpus cards fits: the whole "
                        f"model's dense weights and session need {(w + s) / MIB:.1f} MiB at "
                        f"{cm.cells} cells before per-stage reserves; those cards have {free} MiB "
                        f"free (after any explicit helper tier on them)")
    return p


def make_plan(shape: ModelShape, devices: Sequence[Device], *, cells: int,
              params: PlanParams = PlanParams(), prompt_chunk: int | None = None, **kw) -> Plan:
    """Plan a run (`plan_for`'s arguments) with --kv-resident resolved: params.kv_resident cells
    of each K/V on the device (checked against its floor, the sinks and a prompt chunk), or with
    KV_RESIDENT_AUTO every cell where a placement fits so, else the most cells with which one
    fits (the expert caches fill what is left), noted in the plan."""
    n = params.kv_resident
    if n == KV_RESIDENT_AUTO:
        return auto_resident(plan_for, shape, devices, cells, params, prompt_chunk, kw)
    if 0 < n < cells and n < resident_floor(prompt_chunk):
        raise PlanError(f"--kv-resident {n} is below its floor of {resident_floor(prompt_chunk)} "
                        f"cells: the {KV_SINK_CELLS} attention sinks plus a ring that holds a "
                        f"whole prompt chunk (--prefill {prompt_chunk or 'auto: its smallest chunk'})")
    return plan_for(shape, devices, cells=cells, params=params, prompt_chunk=prompt_chunk, **kw)


def plan_for(shape: ModelShape, devices: Sequence[Device], *, cells: int,
              profile: RoutingProfile | None = None, params: PlanParams = PlanParams(),
              split: str | Sequence[int] = "auto", order: str = "fastest_last",
              skip_if_fits: bool = False, prompt_chunk: int | None = None,
              stage_gpus: Sequence[str] | None = None,
              helper_tiers: Sequence[ExplicitTier] = (),
              compute: ComputeOptions = ComputeOptions(),
              conversation_bytes: int = 0, resident_on: dict[Device, int] | None = None,
              placed: Plan | None = None) -> Plan:
    """Plan a run of `shape` on `devices` with `cells` context cells.

    split: "auto" (search), "none" (one stage on the best single device), or explicit split points
    K1, K2, ... (first layers of stages 2, 3, ...). order: "fastest_last" or "as_given".
    prompt_chunk: None for the auto prompt chunk, or the operator's explicit chunk.
    stage_gpus: the devices (explicit.py names) that run stages, one each; the others are helper
    tiers only. helper_tiers: explicit helper tiers, sized by the operator — taken off a stage
    card before its cache fills, kept with --no-remote-auto, refused rather than skipped.
    compute: the launch's compute options, kept in the plan (they do not move its numbers).
    conversation_bytes: each stage's budget for kept conversations (--conversation-cache-mib),
    taken off its card before the cache fills; where no placement fits with it there, every
    stage keeps it in pinned host memory instead (noted).
    resident_on: resident K/V cells per device (--kv-resident auto's own per stage; the others
    params.kv_resident). placed: keep that plan's stages (devices and layer ranges) rather than
    search (--kv-resident auto, once each stage's count is known).
    Raises PlanError (a refusal naming the numbers) when the request cannot be honoured.
    """
    if not devices:
        raise PlanError("no devices to plan on")
    ids = [(d.host, d.index) for d in devices]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise PlanError(f"device {dup[0]}:{dup[1]} is listed twice")
    if cells < 1:
        raise PlanError(f"--max-context {cells}: at least 1 cell is needed")
    notes: list[str] = []
    if profile is None:
        profile = RoutingProfile.uniform(shape.n_layers, shape.n_experts)
        notes.append("no routing profile: uniform ranking, coverage from H(f) = 1 - (1 - f)^b")
    ordered = order_devices(devices, order, params.default_bw_gbs)
    kv_cells = (None if resident_on is None
                else [resident_on.get(dev, params.kv_resident) for dev in ordered])
    stage_set = None
    if stage_gpus is not None:
        named = named_stage_devices(stage_gpus, ordered)
        stage_set = [d for d, dev in enumerate(ordered) if dev in named]    # planning order
        helper_only = [dev.label for dev in ordered if dev not in named]
        notes.append(f"--stage-gpus {','.join(stage_gpus)}: stages on "
                     f"{', '.join(ordered[d].label for d in stage_set)}"
                     + (f"; helper tiers only on {', '.join(helper_only)}" if helper_only else ""))
    # the draft model is priced as the kind of device the last stage lands on, a CPU rank when
    # every device that may run a stage is one (a launch has one kind of rank); an inventory
    # that mixes kinds reserves the larger of the two prices wherever the last stage lands (a
    # draft model's GPU copy of its experts is mostly the larger; the MTP block, which copies its
    # experts on both kinds, costs more on a CPU rank, its dense tensors f32 there)
    kinds = {dev.kind for d, dev in enumerate(ordered) if stage_set is None or d in stage_set}
    if kinds == {"cpu"}:
        params = replace(params, draft_bytes=params.draft_cpu_bytes)
    elif "cpu" in kinds:
        params = replace(params, draft_bytes=max(params.draft_bytes, params.draft_cpu_bytes))
    sized = explicit_tiers(helper_tiers, ordered)
    # an explicit tier on a card that may run a stage comes first: the stage's cache fills the rest
    withheld = [sized[dev].budget_bytes + HELPER_RESERVE_BYTES
                if dev in sized and (stage_set is None or d in stage_set) else 0
                for d, dev in enumerate(ordered)]
    if conversation_bytes < 0:
        raise PlanError(f"--conversation-cache-mib: {conversation_bytes} bytes; at least 0")
    conversation_in = "device"
    if conversation_bytes:
        # card first: withheld from every card that may run a stage, as an explicit helper tier
        on_card = [w + (conversation_bytes if stage_set is None or d in stage_set else 0)
                   for d, w in enumerate(withheld)]
        try:
            _place(CostModel(shape, ordered, profile, cells, params, handoff_rows=prompt_chunk
                             if prompt_chunk is not None else HANDOFF_ROWS, withheld=on_card,
                             resident=kv_cells),
                   split, skip_if_fits, stage_set, placed)
            withheld = on_card
        except PlanError:
            conversation_in = "host"
            notes.append(f"conversation cache: {conversation_bytes / MIB:.1f} MiB per stage in "
                         f"pinned host memory (no placement fits with it on the cards)")
    # hand-off buffers hold one prompt chunk: the search prices the largest it may pick (the
    # operator's, or the largest auto chunk); once the chunk is known, the rest goes to the caches
    rows = prompt_chunk if prompt_chunk is not None else HANDOFF_ROWS
    cm = CostModel(shape, ordered, profile, cells, params, handoff_rows=rows, withheld=withheld,
                   resident=kv_cells)
    notes.append(f"coverage model: {coverage_mode(profile, params.coverage)}")
    if params.draft_bytes:
        resident = "" if params.draft_bytes == params.draft_cpu_bytes else " with every expert resident"
        notes.append(f"{params.drafter[0]} ({params.drafter[1]}): {params.draft_bytes / MIB:.1f} MiB of "
                     f"weights{resident}, session and catch-up buffers in the last stage's reserve")
    if params.stage_cache_slots == 0:
        # --expert-cache 0: nothing is resident, but the profile still chooses the placement
        # (searched as if the caches filled; with empty fills every placement would tie)
        searched = CostModel(shape, ordered, profile, cells, replace(params, stage_cache_slots=None),
                             handoff_rows=rows, withheld=withheld, resident=kv_cells)
        placement = _place(searched, split, skip_if_fits, stage_set, placed)
        notes.append("expert cache 0: the placement was searched with filled caches; none is "
                     "filled")
    else:
        placement = _place(cm, split, skip_if_fits, stage_set, placed)

    # stage caches, then the prompt loans (a stage that cannot lend gives its own buffers room)
    fills = [cm.fill(d, lb, le) for d, (lb, le) in zip(placement.devices, placement.ranges)]
    def holds_all(f: Fill) -> bool:
        return len(f.pairs) == (f.le - f.lb) * shape.n_experts

    parts = [Participant(f"stage {i} ({ordered[d].label})", len(f.pairs),
                         min(shape.blob_bytes[f.lb:f.le]), max(0, f.budget),
                         max(0, f.budget - f.bytes) if holds_all(f) else 0, holds_all(f))
             for i, (d, f) in enumerate(zip(placement.devices, fills))]
    # with fewer cells resident (--kv-resident) the ring holds a whole chunk: it caps the chunk
    res = kv_cells if kv_cells is not None else [params.kv_resident] * len(ordered)
    ring = min([res[d] - KV_SINK_CELLS for d in placement.devices if 0 < res[d] < cells],
               default=cells)
    lend = plan_lend(parts, shape.prompt_bytes, prompt_chunk, params.lend_pct, max_chunk=min(cells, ring),
                     loans=params.prompt_loans, resident_bytes=shape.resident_prompt_bytes)
    if lend.prompt_chunk < rows:   # buffers of the chosen chunk: what they leave fills the caches further
        cm = CostModel(shape, ordered, profile, cells, params, handoff_rows=lend.prompt_chunk,
                       withheld=withheld, resident=kv_cells)
        fills = [cm.fill(d, lb, le) for d, (lb, le) in zip(placement.devices, placement.ranges)]
    fills = [f if loan.lends else cm.tables.fill(f.lb, f.le, f.budget - loan.own_bytes, params.stage_cache_slots)
             for f, loan in zip(fills, lend.loans)]
    # a stage whose cache holds every pair and lends nothing streams no miss: its own buffers are
    # the resident layout, as it carves them (stage.py); a cache the smaller hand-off rows filled
    # further may only now hold every pair
    loans = [with_own_bytes(loan, shape.resident_prompt_bytes(lend.prompt_chunk))
             if not loan.lends and holds_all(f) else loan for f, loan in zip(fills, lend.loans)]
    notes += [loan.note for loan in loans if loan.note]

    E = shape.n_experts
    stages = []
    for i, (d, f, loan) in enumerate(zip(placement.devices, fills, loans)):
        w, s, r = stage_fixed_bytes(shape, cells, f.lb, f.le, weight_slice=params.weight_slice,
                                    handoff_rows=cm.handoff_rows, verify_rows=params.verify_rows,
                                    draft_bytes=params.draft_bytes,
                                    sessions=params.sessions, resident=res[d])
        stages.append(StagePlan(
            stage=i, device=ordered[d], lb=f.lb, le=f.le, weights_bytes=w, session_bytes=s, reserve_bytes=r,
            budget_bytes=int(cm.budget(d, f.lb, f.le)), pairs=tuple((p // E, p % E) for p in f.pairs),
            cache_bytes=f.bytes, slot_bytes=parts[i].slot_bytes, loan_slots=loan.slots,
            loan_bytes=loan.bytes, own_prompt_bytes=loan.own_bytes, mass=cm.held_mass(f.pairs),
            note=loan.note, conversation_bytes=conversation_bytes,
            conversation_in=conversation_in,
            kv_host_bytes=params.sessions * session_host_bytes(shape, cells, f.lb, f.le, res[d]),
            kv_resident=res[d] if 0 < res[d] < cells else 0))

    # helper tiers on every card's leftover (stage cards included), after the caches are fixed;
    # an explicit tier offers exactly its size (a stage card withheld it from its stage)
    offers = []
    for dev in ordered:
        st = next((s for s in stages if s.device == dev), None)
        left = dev.free_bytes if st is None else st.budget_bytes - st.own_prompt_bytes - st.cache_bytes
        offers.append((dev, sized[dev].budget_bytes + HELPER_RESERVE_BYTES if dev in sized else left))
    held = [p for f in fills for p in f.pairs]
    readers = [st.device for st in stages for _ in range(st.lb, st.le)]   # each layer's stage
    helpers = select_helpers(shape, cm.ranking, held, offers, params.remote_auto, cm.mass, readers,
                             explicit=[dev in sized for dev in ordered])
    for h in helpers:
        if h.explicit and h.skipped:
            raise PlanError(f"{sized[h.device].flag}: the tier on {h.device.label} would hold "
                            f"nothing: {h.reason}")
    notes += [f"explicit helper tier on {dev.label}: {t.budget_bytes / MIB:.1f} MiB ({t.flag})"
              for dev, t in sized.items()]
    costs = cm.helper_costs([(d, f.lb, f.le) for d, f in zip(placement.devices, fills)], helpers)
    helpers = tuple(replace(h, saved_ms=saved, read_ms=read) if not h.skipped else h
                    for h, (saved, read) in zip(helpers, costs))

    bd = cm.breakdown(placement.devices, placement.bounds, fills)
    return Plan(devices=ordered, stages=tuple(stages), helpers=helpers, cells=cells,
                prompt_chunk=lend.prompt_chunk,
                prompt_chunk_auto=lend.auto, method=placement.method,
                compute_ms=bd["compute_ms"], miss_ms=bd["miss_ms"], handoff_ms=bd["handoff_ms"],
                params=params, notes=tuple(notes), compute=compute)
