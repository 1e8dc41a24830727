"""Helper tiers: every card's leftover VRAM holds the globally hottest pairs no stage cache holds.

Runs after the placement is chosen and the stage caches are filled, so it never changes what the
search picked (seed #390). Selection is by BYTE budget — blob_bytes varies per layer in mixed-quant
files, so a slot count would be a poor proxy. The selected pairs are a prefix of the global ranking
of unheld pairs (the walk stops at the first pair that fits no tier), striped round-robin over the
tiers so the hottest pairs' remote requests spread over the cards. Disjoint from every stage cache
and from each other by construction. A tier that cannot hold anything is kept in the plan, marked
skipped with its reason (fail soft); totals count only tiers that are not skipped.

A tier holds only pairs of stages it serves (`serves`): a GPU stage reads a tier of its own host
in place, inside its decode graph, but a tier on another host only by a request over the network,
which takes the stage's decode off its graph (the general path: 4.9 against 169 tok/s on an H200,
docs/BENCHMARKS.md, issue 16) to spare host misses its graph reads in place for about 55 us each.
So tiers of other hosts hold pairs of CPU stages only; with `readers` (the device of each layer's
stage) each tier's pairs are a rank prefix of the pairs it may hold.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import numpy as np

from .device import Device
from .pricing import HELPER_RESERVE_BYTES, MIB
from .shape import ModelShape

Pair = tuple[int, int]   # (layer, expert)


@dataclass(frozen=True)
class HelperTier:
    """A helper expert tier on `device`: budget_bytes for blobs (after HELPER_RESERVE_BYTES)."""

    device: Device
    budget_bytes: int
    pairs: tuple[Pair, ...] = ()
    bytes: int = 0
    mass: float = 0.0         # share of all routed activations its pairs take (filled by the planner)
    skipped: bool = False
    reason: str = ""
    # per decode token (score.py CostModel.helper_costs): the host misses its pairs spare, and
    # what reading them where they are costs instead
    saved_ms: float = 0.0
    read_ms: float = 0.0
    # sized by the operator (--expert-cache-device): kept with remote_auto off, and a hard
    # requirement where it opens (the launch stops if it cannot), never skipped
    explicit: bool = False

    @property
    def reserve_bytes(self) -> int:
        """What the tier allocates besides its blobs (0 when skipped: it never opens)."""
        return 0 if self.skipped else HELPER_RESERVE_BYTES

    def skip(self, reason: str) -> "HelperTier":
        return replace(self, pairs=(), bytes=0, mass=0.0, skipped=True, reason=reason,
                       saved_ms=0.0, read_ms=0.0)


def serves(tier: Device, reader: Device) -> bool:
    """Whether a helper tier on `tier` may hold pairs the stage on `reader` computes: a tier of
    the stage's own host (its decode graph reads the tier in place: the same card, or another
    through CUDA IPC), or any tier for a stage with no decode graph (a CPU rank asks it by
    request, as it computes any expert it lacks on the general path)."""
    return tier.host == reader.host or not reader.decodes_as_graph


def select_helpers(shape: ModelShape, ranking: np.ndarray, held: Iterable[int],
                   offers: Sequence[tuple[Device, int]], enabled: bool = True,
                   mass: np.ndarray | None = None,
                   readers: Sequence[Device] | None = None,
                   explicit: Sequence[bool] | None = None) -> tuple[HelperTier, ...]:
    """Helper tiers for `offers` = (device, leftover bytes) in device order.

    held: flat pair ids (layer * n_experts + expert) the stage caches hold.
    A tier's blob budget is its leftover minus HELPER_RESERVE_BYTES. mass (per flat pair id), if
    given, sets each tier's held routing mass. readers (per layer: the device of the stage that
    runs it), if given, limits each tier to the layers it `serves`; without it every tier may hold
    every pair. explicit (per offer), if given, marks the tiers the operator sized: they stay on
    when `enabled` is False (which turns off the automatic ones only).
    """
    E = shape.n_experts
    held_set = set(int(p) for p in held)
    unheld = [int(p) for p in ranking if int(p) not in held_set]
    smallest = min((shape.blob_bytes[p // E] for p in unheld), default=0)
    n_layers = len(shape.blob_bytes)
    may = np.ones((len(offers), n_layers), dtype=bool)      # may[tier, layer]
    if readers is not None:
        for i, (dev, _) in enumerate(offers):
            may[i] = [serves(dev, r) for r in readers]

    sized = list(explicit) if explicit is not None else [False] * len(offers)
    tiers = [HelperTier(dev, max(0, left - HELPER_RESERVE_BYTES), explicit=bool(x))
             for (dev, left), x in zip(offers, sized)]
    open_ = []
    for i, (tier, (_, left)) in enumerate(zip(tiers, offers)):
        if not enabled and not tier.explicit:
            tiers[i] = tier.skip("helper tiers are off (STRATA_REMOTE_AUTO=0 / --no-remote-auto)")
        elif not unheld:
            tiers[i] = tier.skip("every pair is already held by a stage cache")
        elif not any(may[i, p // E] for p in unheld):
            tiers[i] = tier.skip(f"serves no stage: the stages its pairs would go to are GPU stages on "
                                 f"other hosts than {tier.device.host}, whose decode graphs read their "
                                 f"misses from host memory in place (a request over the network would "
                                 f"take them off the graph)")
        elif tier.budget_bytes < smallest:
            tiers[i] = tier.skip(f"leftover {left / MIB:.1f} MiB minus the {HELPER_RESERVE_BYTES / MIB:.0f} MiB "
                                 f"helper reserve holds no expert (smallest unheld {smallest / MIB:.2f} MiB)")
        else:
            open_.append(i)

    room = {i: tiers[i].budget_bytes for i in open_}
    taken: dict[int, list[int]] = {i: [] for i in open_}
    filling = set(open_)       # tiers still taking pairs: each stops at the first it has no room for
    cursor = 0
    for p in unheld:
        size, layer = shape.blob_bytes[p // E], p // E
        candidates = [open_[(cursor + j) % len(open_)] for j in range(len(open_))]
        candidates = [i for i in candidates if may[i, layer] and i in filling]
        if not candidates:
            if not filling:
                break
            continue            # no tier still filling may hold it: it stays a host miss
        for i in candidates:
            if room[i] >= size:
                taken[i].append(p)
                room[i] -= size
                cursor = (open_.index(i) + 1) % len(open_)
                break
        else:
            filling -= set(candidates)   # fits none of them: they stop, so each stays a rank prefix

    for i in open_:
        if not taken[i]:
            tiers[i] = tiers[i].skip("nothing to hold: the ranked unheld pairs ran out, or stopped at one "
                                      "no tier had room for")
        else:
            tiers[i] = replace(tiers[i], pairs=tuple((p // E, p % E) for p in taken[i]),
                               bytes=tiers[i].budget_bytes - room[i],
                               mass=float(mass[taken[i]].sum()) if mass is not None else 0.0)
    return tuple(tiers)
