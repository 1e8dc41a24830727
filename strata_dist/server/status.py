"""What `/v1/status`, `/metrics` and the Monitor page show: the plan, one entry per rank (= one
device: a rank that runs a stage and hosts a helper tier is one entry), its allocation, memory as
the device reports it (NVML for local GPUs, the rank process's RSS for local CPU ranks, the
rank's own gauges when it sends them), and its counters with hit rates per expert tier."""
from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

MIB = 2 ** 20


@dataclass
class RankView:
    """Static facts about one rank, fixed once the launch has loaded."""
    rank: int
    role: str                       # stage | helper | stage+helper
    device_name: str
    device_kind: str                # cpu | cuda
    host: str
    pid: int
    total_bytes: int                # as registered (CPU ranks: their --vram-budget)
    free_bytes: int
    stage: int | None = None
    lb: int | None = None
    le: int | None = None
    allocated: dict[str, int] = field(default_factory=dict)
    planned: dict[str, int] = field(default_factory=dict)   # weights/session/loan/cache/helper bytes
    cache_slots: int = 0
    helper_slots: int = 0
    gpu_index: int | None = None    # NVML index on this host, for local GPU ranks
    # experts held per layer (index = layer): in the stage's expert cache, in the helper tier
    cache_per_layer: list[int] = field(default_factory=list)
    helper_per_layer: list[int] = field(default_factory=list)

    def card_bytes(self) -> dict[str, int]:
        """The card's numbers: what the rank allocated where it says, else what the plan priced."""
        out = {}
        for kind, key in (("weights", "weights"), ("kv", "session"), ("prompt_loan", "loan"),
                          ("expert_cache", "cache"), ("helper", "helper")):
            out[kind] = int(self.allocated.get(key, self.planned.get(key, 0)))
        return out

    def mib(self) -> dict[str, float]:
        return {k: round(v / MIB, 3) for k, v in self.card_bytes().items()}


def rank_views(plan, slots, ready: dict[int, dict], gpu_of_rank: dict[int, int] | None = None
               ) -> list[RankView]:
    """One view per rank from the plan, the coordinator's rank slots and what each allocated."""
    gpu_of_rank = gpu_of_rank or {}
    stage_of = {st.device.index: st for st in plan.stages}
    helper_of = {h.device.index: h for h in plan.live_helpers}
    n_layers = max((st.le for st in plan.stages), default=0)
    out = []
    for s in slots:
        dev = s.register.devices[0]
        st, h = stage_of.get(s.rank), helper_of.get(s.rank)
        role = ("stage+helper" if h else "stage") if st else "helper"
        planned = {"weights": st.weights_bytes if st else 0, "session": st.session_bytes if st else 0,
                   "loan": st.loan_bytes if st else 0, "cache": st.cache_bytes if st else 0,
                   "helper": h.bytes if h else 0}
        out.append(RankView(
            rank=s.rank, role=role, device_name=dev.name, device_kind=str(dev.kind),
            host=s.register.host, pid=s.register.pid, total_bytes=dev.total_bytes,
            free_bytes=dev.free_bytes, stage=st.stage if st else None,
            lb=st.lb if st else None, le=st.le if st else None,
            allocated=dict(ready.get(s.rank, {}) or {}), planned=planned,
            cache_slots=st.cache_slots if st else 0, helper_slots=len(h.pairs) if h else 0,
            gpu_index=gpu_of_rank.get(s.rank) if str(dev.kind) == "cuda" else None,
            cache_per_layer=per_layer(st.pairs if st else (), n_layers),
            helper_per_layer=per_layer(h.pairs if h else (), n_layers)))
    return out


def per_layer(pairs, n_layers: int) -> list[int]:
    """How many of the (layer, expert) pairs fall in each layer."""
    counts = [0] * n_layers
    for layer, _expert in pairs:
        if 0 <= layer < n_layers:
            counts[layer] += 1
    return counts


class MemoryProbe:
    """Used/total memory per rank, read at most once a second."""

    def __init__(self, views: list[RankView]):
        self.views = views
        self.here = socket.gethostname()
        self.lock = threading.Lock()
        self.cache: dict[int, dict] = {}
        self.at = 0.0
        self._nvml = None

    def read(self, gauges: dict[int, dict[str, float]] | None = None) -> dict[int, dict]:
        with self.lock:
            if time.monotonic() - self.at < 1.0 and self.cache:
                return self.cache
            gauges = gauges or {}
            out = {}
            for v in self.views:
                out[v.rank] = self._one(v, gauges.get(v.rank, {}))
            self.cache, self.at = out, time.monotonic()
            return out

    def _one(self, v: RankView, g: dict[str, float]) -> dict:
        if "mem_used_bytes" in g and "mem_total_bytes" in g:
            return {"used_bytes": int(g["mem_used_bytes"]), "total_bytes": int(g["mem_total_bytes"]),
                    "source": "rank"}
        if v.device_kind == "cuda" and v.gpu_index is not None and v.host == self.here:
            mem = self._nvml_mem(v.gpu_index)
            if mem is not None:
                return {"used_bytes": mem[0], "total_bytes": mem[1], "source": "nvml"}
        if v.device_kind == "cpu" and v.host == self.here:
            rss = _rss_bytes(v.pid)
            if rss is not None:
                return {"used_bytes": rss, "total_bytes": v.total_bytes, "source": "rss"}
        return {"used_bytes": max(v.total_bytes - v.free_bytes, 0), "total_bytes": v.total_bytes,
                "source": "registered"}

    def _nvml_mem(self, index: int) -> tuple[int, int] | None:
        try:
            import pynvml
            if self._nvml is None:
                pynvml.nvmlInit()
                self._nvml = pynvml
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            m = pynvml.nvmlDeviceGetMemoryInfo(h)
            return int(m.used), int(m.total)
        except Exception:   # no driver, or not this host's GPU: fall back to registered numbers
            return None


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# ---- expert tiers -----------------------------------------------------------------------------------

# Counter names a rank may send for its expert lookups, by tier. "<tier>_hits" names a tier too.
_TIER_KEYS = {"hits": "stage", "stage_hits": "stage", "cache_hits": "stage",
              "remote": "helper", "remote_hits": "helper", "helper_hits": "helper",
              "remote_requests": "helper",
              "misses": "host", "host_misses": "host", "host": "host"}
_TIER_RE = re.compile(r"^(?:expert_)?(?P<tier>[a-z0-9]+)_hits$")


def tier_counts(counters: dict[str, int]) -> dict[str, int]:
    tiers: dict[str, int] = {}
    for k, v in counters.items():
        tier = _TIER_KEYS.get(k)
        if tier is None:
            m = _TIER_RE.match(k)
            tier = m.group("tier") if m else None
        if tier is not None:
            tiers[tier] = tiers.get(tier, 0) + int(v)
    return tiers


def hit_rates(counters: dict[str, int]) -> dict[str, float]:
    """Share of expert lookups each tier served (stage cache, helper, host), when counted."""
    tiers = tier_counts(counters)
    total = sum(tiers.values())
    if total <= 0:
        return {}
    return {t: n / total for t, n in sorted(tiers.items())}


# ---- the status value --------------------------------------------------------------------------------

# The plan's figure and the measured one are flagged apart past this factor either way
PREDICTION_OFF_BY = 2.0


def prediction(plan, snapshot: dict) -> dict[str, Any]:
    """The plan's ms/token beside the measured one: the running request's decode rate, else the
    last finished request's; `off_by` is measured / predicted, flagged past PREDICTION_OFF_BY."""
    predicted = plan.predicted_ms_per_token if plan is not None else None
    running = snapshot.get("running")
    measured, source = None, None
    if running and running.get("tokens_per_second"):
        measured, source = 1e3 / running["tokens_per_second"], "running request"
    elif (snapshot.get("last") or {}).get("decode_tokens_per_second"):
        measured, source = 1e3 / snapshot["last"]["decode_tokens_per_second"], "last request"
    ratio = measured / predicted if measured is not None and predicted else None
    return {"predicted_ms_per_token": predicted,
            "measured_ms_per_token": round(measured, 4) if measured is not None else None,
            "measured_from": source,
            "off_by": round(ratio, 3) if ratio is not None else None,
            "flagged": ratio is not None and not (1 / PREDICTION_OFF_BY <= ratio <= PREDICTION_OFF_BY)}


def status_value(*, model: dict, plan, views: list[RankView], snapshot: dict,
                 memory: dict[int, dict], loading: dict | None, started: float,
                 recent_requests: list[dict] | None = None) -> dict[str, Any]:
    counters = snapshot.get("rank_counters", {})
    ranks = []
    for v in views:
        c = counters.get(v.rank, {})
        ranks.append({
            "rank": v.rank, "role": v.role, "stage": v.stage, "lb": v.lb, "le": v.le,
            "device": {"name": v.device_name, "kind": v.device_kind, "host": v.host, "pid": v.pid},
            "allocated_bytes": v.allocated, "planned_bytes": v.planned,
            "bytes": v.card_bytes(), "mib": v.mib(),
            "expert_slots": v.cache_slots, "helper_slots": v.helper_slots,
            "memory": memory.get(v.rank), "counters": c, "hit_rates": hit_rates(c),
            "gauges": snapshot.get("rank_gauges", {}).get(v.rank, {}),
            "experts_per_layer": {"cache": v.cache_per_layer, "helper": v.helper_per_layer},
        })
    all_counters: dict[str, int] = {}
    for c in counters.values():
        for k, n in c.items():
            all_counters[k] = all_counters.get(k, 0) + n
    running = snapshot.get("running")
    # /metrics' decode gauge keeps the last request's rate when idle; `idle` says it is the last
    live = running["tokens_per_second"] if running else snapshot.get("last", {}).get(
        "decode_tokens_per_second", 0.0)
    return {
        "object": "strata.status",
        "state": snapshot.get("state"), "error": snapshot.get("error"),
        "uptime_s": round(time.time() - started, 3),
        "model": model,
        "loading": loading,
        "plan": plan.to_dict() if plan is not None else None,
        "totals": {
            "expert_slots": plan.expert_slots if plan else 0,
            "expert_slots_stages": plan.expert_slots_stages if plan else 0,
            "expert_slots_primary": plan.expert_slots_primary if plan else 0,
            "expert_cache_mib": round(plan.expert_cache_mib, 3) if plan else 0.0,
            "expert_cache_primary_mib": round(plan.expert_cache_primary_mib, 3) if plan else 0.0,
            "predicted_ms_per_token": plan.predicted_ms_per_token if plan else None,
        },
        "prediction": prediction(plan, snapshot),
        "ranks": ranks,
        "hit_rates": hit_rates(all_counters),
        "queue": snapshot.get("queue"),
        "requests": snapshot.get("totals"),
        "recent_requests": recent_requests or [],
        "throughput": {
            # idle: nothing generating, nothing waiting, no token in the rate window (a gap between
            # two requests is not idle)
            "idle": (running is None and not (snapshot.get("queue") or {}).get("waiting")
                     and not snapshot.get("decode_tokens_per_second")),
            "tokens_per_second": live,
            "window_tokens_per_second": snapshot.get("decode_tokens_per_second", 0.0),
            "running": running, "last": snapshot.get("last"),
        },
        "stats_age_s": snapshot.get("stats_age_s"),
    }


def is_loopback(host: str) -> bool:
    if host in ("localhost", "::1"):
        return True
    return host.startswith("127.")


__all__ = ["RankView", "rank_views", "per_layer", "MemoryProbe", "hit_rates", "tier_counts",
           "prediction", "PREDICTION_OFF_BY", "status_value", "is_loopback"]
