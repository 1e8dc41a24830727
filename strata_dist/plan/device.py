"""Device inventory: what each card offers, and the order stages take them in."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

from .pricing import MIB

ORDERS = ("fastest_last", "as_given")
KINDS = ("cuda", "cpu")


@dataclass(frozen=True)
class Device:
    """One card (or CPU rank) as the coordinator sees it before anything is allocated.

    free_bytes is measured BEFORE this run's weights exist, so the planner subtracts every byte the
    run will allocate (DESIGN §4; seed #390: --split-skip-if-fits must add the full dense cost).
    mem_bandwidth_gbs is the speed figure (NVML for GPUs, flags for CPU ranks); None means unknown
    and the planner uses PlanParams.default_bw_gbs. index is the device ordinal on its host (cuda:N).
    card names the physical card (its NVML UUID; "" when unknown or a CPU rank): two ranks listed
    on one GPU are two Devices of one card, which take turns on it (`shares_card_with`). kind is
    "cuda" (a stage there decodes as one graph, `decodes_as_graph`) or "cpu".
    """

    name: str
    total_bytes: int
    free_bytes: int
    mem_bandwidth_gbs: float | None = None
    host: str = "localhost"
    index: int = 0
    card: str = ""
    kind: str = "cuda"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"device {self.name!r}: kind {self.kind!r}, expected one of {KINDS}")

    @property
    def decodes_as_graph(self) -> bool:
        """Whether a stage here runs a decode token as one device graph, reading every expert in
        place (cache, helper tiers of its host, pinned host memory); a request to a helper on
        another host would take its decode off that graph (helpers.py `serves`)."""
        return self.kind == "cuda"

    def shares_card_with(self, other: "Device") -> bool:
        """Whether `other` is a rank on this one's physical card (asked of two different ranks)."""
        return bool(self.card) and self.card == other.card and self.host == other.host

    @property
    def label(self) -> str:
        where = "" if self.host == "localhost" else f"{self.host}:"
        return f"{where}{self.index} {self.name}"

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "Device":
        return cls(**d)


_REQUIRED = ("name", "total_mib", "free_mib")
_OPTIONAL = ("mem_bandwidth_gbs", "host", "index", "card", "kind")


def _number(entry_name: str, key: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{entry_name}: {key} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{entry_name}: {key} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def devices_from_json(obj: Any) -> list[Device]:
    """Parse the `--inventory rig.json` value (already json-decoded) into Devices.

    Format: a non-empty JSON list of objects with `name`, `total_mib`, `free_mib` and optionally
    `mem_bandwidth_gbs` (number or null), `host` (default "localhost"), `index` (default: the
    entry's position), `card` (entries of one host naming the same card are ranks sharing it:
    their free_mib are their shares of it) and `kind` ("cuda", the default, or "cpu"). Unknown keys are refused so a typo ("free_mb") is not
    silently ignored.
    Raises ValueError naming the entry and the field.
    """
    if not isinstance(obj, list) or not obj:
        raise ValueError("inventory: expected a non-empty JSON list of device objects")
    out: list[Device] = []
    seen: set[tuple[str, int]] = set()
    for i, entry in enumerate(obj):
        where = f"inventory entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
        if isinstance(entry.get("name"), str) and entry["name"]:
            where = f"inventory entry {i} ({entry['name']!r})"
        for key in _REQUIRED:
            if key not in entry:
                raise ValueError(f"{where}: missing field {key!r}")
        unknown = sorted(set(entry) - set(_REQUIRED) - set(_OPTIONAL))
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(_REQUIRED + _OPTIONAL)})")
        if not isinstance(entry["name"], str) or not entry["name"]:
            raise ValueError(f"{where}: name must be a non-empty string, got {entry['name']!r}")
        total = _number(where, "total_mib", entry["total_mib"])
        free = _number(where, "free_mib", entry["free_mib"])
        if free > total:
            raise ValueError(f"{where}: free_mib {entry['free_mib']} exceeds total_mib {entry['total_mib']}")
        bw = entry.get("mem_bandwidth_gbs")
        if bw is not None:
            bw = _number(where, "mem_bandwidth_gbs", bw, positive=True)
        host = entry.get("host", "localhost")
        if not isinstance(host, str) or not host:
            raise ValueError(f"{where}: host must be a non-empty string, got {host!r}")
        index = entry.get("index", i)
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"{where}: index must be an integer >= 0, got {index!r}")
        if (host, index) in seen:
            raise ValueError(f"{where}: device {host}:{index} is listed twice")
        seen.add((host, index))
        card = entry.get("card", "")
        if not isinstance(card, str):
            raise ValueError(f"{where}: card must be a string, got {card!r}")
        kind = entry.get("kind", "cuda")
        if kind not in KINDS:
            raise ValueError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        out.append(Device(name=entry["name"], total_bytes=int(round(total * MIB)),
                          free_bytes=int(round(free * MIB)), mem_bandwidth_gbs=bw, host=host, index=index,
                          card=card, kind=kind))
    return out


def split_shared_cards(devices: Sequence[Device]) -> list[Device]:
    """Ranks of one card that each measured its free memory alone (started by hand or by units,
    without budgets splitting it) split it, as strata-launch splits a GPU listed twice: a rank a
    budget capped (free == total == its budget) keeps it, the others take equal parts of what is
    left of the card's free memory (the largest figure they measured). So a plan never asks one
    card twice for the same bytes."""
    out = list(devices)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, d in enumerate(out):
        if d.card:
            groups.setdefault((d.host, d.card), []).append(i)
    for ranks in groups.values():
        open_ = [i for i in ranks if out[i].free_bytes < out[i].total_bytes]
        if len(ranks) < 2 or not open_:
            continue
        capped = sum(out[i].free_bytes for i in ranks if i not in open_)
        share = max(0, max(out[i].free_bytes for i in open_) - capped) // len(open_)
        for i in open_:
            out[i] = replace(out[i], free_bytes=min(out[i].free_bytes, share))
    return out


def order_devices(devices: Sequence[Device], order: str, default_bw_gbs: float) -> tuple[Device, ...]:
    """The order stages take devices in: stage i runs on a device before stage i+1's.

    "fastest_last" (default): a stable sort by bandwidth, slowest first, so the last stage — which also
    reads the output head every token — lands on the fastest card. "as_given" keeps the inventory order.
    """
    if order not in ORDERS:
        raise ValueError(f"device order {order!r}: expected one of {ORDERS}")
    if order == "as_given":
        return tuple(devices)
    return tuple(sorted(devices, key=lambda d: d.mem_bandwidth_gbs or default_bw_gbs))
