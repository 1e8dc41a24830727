"""The split planner (DESIGN §4): pure arithmetic — no I/O, no GPU, no sockets.

    shape = ModelShape(...)                         # from the GGUF reader, in loader bytes
    devices = devices_from_json(json.load(f))       # or from NVML
    plan = make_plan(shape, devices, cells=32768, profile=prof, params=params_from_env(os.environ))
    print(render_table(plan)); wire = plan.to_json(); Plan.from_json(wire) == plan
"""
from .device import Device, devices_from_json, order_devices, split_shared_cards
from .errors import PlanError
from .explicit import ExplicitTier, parse_explicit_tiers
from .fill import Fill, RankTables, cover_h, fill_stage, pair_masses
from .helpers import HelperTier, select_helpers
from .lend import LEND_CHUNKS, SLOT_FLOOR, LendPlan, Loan, Participant, loan_slots, plan_lend
from .params import PlanParams, params_from_env
from .plan import Plan, StagePlan, make_plan, skip_tier
from .pricing import (HANDOFF_ROWS, HEAD_RESERVE_BYTES, HELPER_RESERVE_BYTES, STAGE_WORK_RESERVE_BYTES,
                      blob_bytes, handoff_bytes, reserve_bytes, session_bytes, session_parts, weights_bytes)
from .profile import RoutingProfile
from .render import render_table
from .score import CostModel
from .search import Placement, price_split, search, search_dp, search_exhaustive
from .shape import ModelShape, estimate_prompt_bytes_per_token, qwen3_30b_a3b_shape, shape_from_geometry

__all__ = [
    "Device", "devices_from_json", "order_devices", "split_shared_cards", "PlanError", "ExplicitTier",
    "parse_explicit_tiers", "Fill", "RankTables", "cover_h", "fill_stage",
    "pair_masses", "HelperTier", "select_helpers", "LEND_CHUNKS", "SLOT_FLOOR", "LendPlan", "Loan",
    "Participant", "loan_slots", "plan_lend", "PlanParams", "params_from_env", "Plan", "StagePlan",
    "make_plan", "skip_tier", "HANDOFF_ROWS", "HEAD_RESERVE_BYTES", "HELPER_RESERVE_BYTES",
    "STAGE_WORK_RESERVE_BYTES", "blob_bytes", "handoff_bytes", "reserve_bytes", "session_bytes",
    "session_parts", "weights_bytes", "RoutingProfile", "render_table", "CostModel", "Placement",
    "price_split", "search", "search_dp", "search_exhaustive", "ModelShape",
    "estimate_prompt_bytes_per_token", "qwen3_30b_a3b_shape", "shape_from_geometry",
]
