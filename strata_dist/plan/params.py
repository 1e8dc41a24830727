"""PlanParams: every tunable of the planner in one value, and the one place the environment is read.

Pure functions take a PlanParams; only params_from_env looks at an environment mapping (the caller
passes os.environ), so a plan is reproducible from its inputs and its recorded params.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping

from protocol.env_table import EnvVar, checked_table, record_from_env, switch

COVERAGE_MODES = ("auto", "model", "measured")
KV_RESIDENT_AUTO = -1      # --kv-resident auto: the plan picks the resident cells


@dataclass(frozen=True)
class PlanParams:
    """Constants of the cost model and the kill switches.

    cover_b          exponent of the coverage model H(f) = 1 - (1 - f)^b (STRATA_SPLIT_COVER_B).
    coverage         "model": pair masses from H over the global rank; "measured": the profile's own
                     normalised counts; "auto": measured when the profile is non-uniform, else model.
    host_gbs         GB/s at which a decode token reads an expert's blob from host memory (the
                     graph's kernels read a missing blob in place over PCIe): ONE expert computed
                     from host memory costs miss_ms + its blob's bytes / host_gbs
                     (STRATA_SPLIT_HOST_GBS). 34 is what an H200 measured (docs/BENCHMARKS.md,
                     2026-12-02, commit 1d2eeb6: 7.67 ms a token with half the Q4_K experts in
                     host memory, 5.1 ms of it for the plan's 66.5 host activations of 2.65 MB;
                     for a Q8_0 blob of 5.0 MB it gives the 0.15 ms the model took before).
    miss_ms          fixed ms a host miss costs beyond its bytes (STRATA_SPLIT_MISS_MS).
    peer_gbs         GB/s at which a stage's kernels read a blob in place from a helper tier on
                     another card of the same host (CUDA IPC; over NVLink where the cards have
                     it) (STRATA_SPLIT_PEER_GBS). 300 is an estimate below the ~390 GB/s two H200s
                     copy at over NVLink; no in-place read across cards has been measured yet
                     (docs/BENCHMARKS.md, issue 16). A tier on the stage's own card is read at
                     the card's bandwidth, one on another host by a request (score.py).
    layer_ms         fixed ms a decode token spends in each layer beyond its bytes: the decode graph's
                     ~7 launches and their serial reductions (STRATA_SPLIT_LAYER_MS). 0.038 is what
                     an H200 measured (docs/BENCHMARKS.md, 2026-12-02, commit dfe1689: 2.53 and 2.77 ms
                     a token against 0.74 and 0.93 of bytes over 48 layers, Q4_K and Q8_0). Every
                     placement holds every layer once, so it moves the prediction, never the choice.
    handoff_ms       ms per stage boundary between cards of one host (STRATA_SPLIT_HANDOFF_MS). A
                     token crosses every boundary and then returns from the last stage to the
                     first, so K stages pay K hops a token (score.py).
    shared_card_handoff_ms  ms per boundary between two ranks on ONE card (a GPU listed twice):
                     the processes take turns on it (STRATA_SPLIT_SHARED_CARD_HANDOFF_MS). 0.5 is
                     what `strata-dist calibrate` measured on an H200 (docs/BENCHMARKS.md,
                     2026-12-04).
    link_ms, link_gbs  a boundary between hosts costs handoff_ms + link_ms + hidden row / link_gbs
                     (STRATA_SPLIT_LINK_MS, STRATA_SPLIT_LINK_GBS).
    default_bw_gbs   bandwidth for a device that reports none.
    kv_fill          mean fraction of the context a decode token reads from KV (0.5: a context
                     filled uniformly over its life).
    lend_pct         cap on the AUTO prompt loan, percent of a stage's cache slots (STRATA_PREFILL_LEND_PCT).
    prompt_loans     prompts borrow the tail of each stage's cache (STRATA_PROMPT_LOANS=0 /
                     --no-prompt-loans: every stage withholds its own prompt buffers instead).
    remote_auto      helper tiers on leftover VRAM (STRATA_REMOTE_AUTO=0 / --no-remote-auto turn off).
    weight_slice     a stage loads only its own layers' dense weights (STRATA_WEIGHT_SLICE=0: all).
    stage_cache_slots  pin: at most this many pairs per stage cache (STRATA_STAGE_CACHE_SLOTS, tests).
    verify_rows      rows of a speculative verify window every stage keeps room for (--spec K:
                     K + 1; 0: no speculation), priced by pricing.verify_window_bytes.
    sessions         sessions every stage carves (--parallel: a request at once each), each priced
                     as one session of the context.
    draft_bytes      what the draft model (--draft-model) takes on the last stage, which carries
                     it, where that is a GPU's: weights with every expert resident, session and
                     catch-up buffers (draft_model.plan_bytes; the MTP block: mtp_draft.plan_bytes);
                     0: none.
    draft_cpu_bytes  ... where the last stage is a CPU rank's: a draft model's less the experts,
                     which it reads where the file maps them; the MTP block's with its experts
                     copied and its dense tensors f32. make_plan prices the kind of the device the
                     last stage lands on, the larger of the two where the stages' devices mix
                     kinds (the plan's params then say that price in draft_bytes).
    drafter          what draft_bytes holds and its flag, as the plan's notes name them.
    kv_resident      cells of each session's K/V every stage keeps on its device (--kv-resident):
                     the attention sinks and a ring of the newest cells; every cell also lives in
                     pinned host memory, and a decode token reads the others from there over
                     PCIe at host_gbs (pricing.kv_host_read_ms). 0: every cell resident (no host
                     part); KV_RESIDENT_AUTO (-1): make_plan picks it (plan.py): each stage the
                     most its card holds (StagePlan.kv_resident), this the fewest of them. Kept out of the plan's JSON while 0, so a plan without it
                     is byte for byte what it was.
    """

    cover_b: float = 3.0
    coverage: str = "auto"
    host_gbs: float = 34.0
    miss_ms: float = 0.0
    peer_gbs: float = 300.0
    layer_ms: float = 0.038
    handoff_ms: float = 0.05
    shared_card_handoff_ms: float = 0.5
    link_ms: float = 0.2
    link_gbs: float = 1.25
    default_bw_gbs: float = 300.0
    kv_fill: float = 0.5
    lend_pct: int = 85
    prompt_loans: bool = True
    remote_auto: bool = True
    weight_slice: bool = True
    stage_cache_slots: int | None = None
    verify_rows: int = 0
    sessions: int = 1
    draft_bytes: int = 0
    draft_cpu_bytes: int = 0
    drafter: tuple[str, str] = ("draft model", "--draft-model")
    kv_resident: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cover_b) and self.cover_b > 0):
            raise ValueError(f"cover_b must be > 0, got {self.cover_b}")
        if self.coverage not in COVERAGE_MODES:
            raise ValueError(f"coverage {self.coverage!r}: expected one of {COVERAGE_MODES}")
        for name in ("miss_ms", "layer_ms", "handoff_ms", "shared_card_handoff_ms", "link_ms"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be >= 0, got {v}")
        for name in ("link_gbs", "default_bw_gbs", "host_gbs", "peer_gbs"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0, got {v}")
        if not 0 <= self.kv_fill <= 1:
            raise ValueError(f"kv_fill must be in [0, 1], got {self.kv_fill}")
        if not 1 <= self.lend_pct <= 100:
            raise ValueError(f"lend_pct must be in [1, 100], got {self.lend_pct}")
        for name in ("draft_bytes", "draft_cpu_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.verify_rows < 0:
            raise ValueError(f"verify_rows must be >= 0, got {self.verify_rows}")
        if self.kv_resident < KV_RESIDENT_AUTO:
            raise ValueError(f"kv_resident must be >= 0 (or {KV_RESIDENT_AUTO}: auto), "
                             f"got {self.kv_resident}")
        if self.sessions < 1:
            raise ValueError(f"sessions must be >= 1, got {self.sessions}")
        if self.stage_cache_slots is not None and self.stage_cache_slots < 0:
            raise ValueError(f"stage_cache_slots must be >= 0, got {self.stage_cache_slots}")

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        if not d["kv_resident"]:
            del d["kv_resident"]       # every cell resident: the plan as it was before the field
        d["drafter"] = list(d["drafter"])     # as JSON carries it (from_dict makes it a pair again)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlanParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"PlanParams: unknown field {unknown[0]!r}")
        if "drafter" in d:     # JSON has no tuples: the pair comes back a list
            d = {**d, "drafter": tuple(d["drafter"])}
        return cls(**d)


# env var -> the PlanParams field it sets and the parser of its text (read by protocol/env_table.py,
# the one reader ComputeOptions uses too)
ENV_VARS: dict[str, EnvVar] = checked_table(PlanParams, {
    "STRATA_SPLIT_COVER_B": EnvVar("cover_b", float),
    "STRATA_SPLIT_COVERAGE": EnvVar("coverage", str),
    "STRATA_SPLIT_MISS_MS": EnvVar("miss_ms", float),
    "STRATA_SPLIT_HOST_GBS": EnvVar("host_gbs", float),
    "STRATA_SPLIT_PEER_GBS": EnvVar("peer_gbs", float),
    "STRATA_SPLIT_LAYER_MS": EnvVar("layer_ms", float),
    "STRATA_SPLIT_HANDOFF_MS": EnvVar("handoff_ms", float),
    "STRATA_SPLIT_SHARED_CARD_HANDOFF_MS": EnvVar("shared_card_handoff_ms", float),
    "STRATA_SPLIT_LINK_MS": EnvVar("link_ms", float),
    "STRATA_SPLIT_LINK_GBS": EnvVar("link_gbs", float),
    "STRATA_PREFILL_LEND_PCT": EnvVar("lend_pct", int),
    "STRATA_PROMPT_LOANS": EnvVar("prompt_loans", switch),
    "STRATA_REMOTE_AUTO": EnvVar("remote_auto", switch),
    "STRATA_WEIGHT_SLICE": EnvVar("weight_slice", switch),
    "STRATA_STAGE_CACHE_SLOTS": EnvVar("stage_cache_slots", int),
})


def params_from_env(environ: Mapping[str, str], base: PlanParams | None = None) -> PlanParams:
    """PlanParams from the STRATA_* variables in `environ` (unset or empty keeps `base`'s value;
    each new value is checked by PlanParams' construction). Raises ValueError naming the variable
    and its value."""
    return record_from_env(ENV_VARS, environ, base or PlanParams())
