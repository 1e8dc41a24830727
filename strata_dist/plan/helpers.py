"""Helper tiers: every card's leftover VRAM holds the globally hottest pairs no stage cache holds.

Runs after the placement is chosen and the stage caches are filled, so it never changes what the
search picked (seed #390). Selection is by BYTE budget — blob_bytes varies per layer in mixed-quant
files, so a slot count would be a poor proxy. The selected pairs are a prefix of the global ranking
of unheld pairs (the walk stops at the first pair that fits no tier), striped round-robin over the
tiers so the hottest pairs' remote requests spread over the cards. Disjoint from every stage cache
and from each other by construction. A tier that cannot hold anything is kept in the plan, marked
skipped with its reason (fail soft); totals count only tiers that are not skipped.
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

    @property
    def reserve_bytes(self) -> int:
        """What the tier allocates besides its blobs (0 when skipped: it never opens)."""
        return 0 if self.skipped else HELPER_RESERVE_BYTES

    def skip(self, reason: str) -> "HelperTier":
        return replace(self, pairs=(), bytes=0, mass=0.0, skipped=True, reason=reason,
                       saved_ms=0.0, read_ms=0.0)


def select_helpers(shape: ModelShape, ranking: np.ndarray, held: Iterable[int],
                   offers: Sequence[tuple[Device, int]], enabled: bool = True,
                   mass: np.ndarray | None = None) -> tuple[HelperTier, ...]:
    """Helper tiers for `offers` = (device, leftover bytes) in device order.

    held: flat pair ids (layer * n_experts + expert) the stage caches hold.
    A tier's blob budget is its leftover minus HELPER_RESERVE_BYTES. mass (per flat pair id), if
    given, sets each tier's held routing mass.
    """
    E = shape.n_experts
    held_set = set(int(p) for p in held)
    unheld = [int(p) for p in ranking if int(p) not in held_set]
    smallest = min((shape.blob_bytes[p // E] for p in unheld), default=0)

    tiers = [HelperTier(dev, max(0, left - HELPER_RESERVE_BYTES)) for dev, left in offers]
    open_ = []
    for i, (tier, (_, left)) in enumerate(zip(tiers, offers)):
        if not enabled:
            tiers[i] = tier.skip("helper tiers are off (STRATA_REMOTE_AUTO=0 / --no-remote-auto)")
        elif not unheld:
            tiers[i] = tier.skip("every pair is already held by a stage cache")
        elif tier.budget_bytes < smallest:
            tiers[i] = tier.skip(f"leftover {left / MIB:.1f} MiB minus the {HELPER_RESERVE_BYTES / MIB:.0f} MiB "
                                 f"helper reserve holds no expert (smallest unheld {smallest / MIB:.2f} MiB)")
        else:
            open_.append(i)

    room = {i: tiers[i].budget_bytes for i in open_}
    taken: dict[int, list[int]] = {i: [] for i in open_}
    cursor = 0
    for p in unheld if open_ else ():
        size = shape.blob_bytes[p // E]
        for j in range(len(open_)):
            i = open_[(cursor + j) % len(open_)]
            if room[i] >= size:
                taken[i].append(p)
                room[i] -= size
                cursor = (cursor + j + 1) % len(open_)
                break
        else:
            break   # fits no tier: stop, so the selection stays a rank prefix

    for i in open_:
        if not taken[i]:
            tiers[i] = tiers[i].skip("nothing to hold: the ranked unheld pairs ran out, or stopped at one "
                                      "no tier had room for")
        else:
            tiers[i] = replace(tiers[i], pairs=tuple((p // E, p % E) for p in taken[i]),
                               bytes=tiers[i].budget_bytes - room[i],
                               mass=float(mass[taken[i]].sum()) if mass is not None else 0.0)
    return tuple(tiers)
