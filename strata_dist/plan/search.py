"""The split search: every contiguous placement of the layers on the (ordered) devices, priced.

A placement picks an order-preserving subsequence of the devices (a card may run no stage and
serve only as a helper tier) and splits [0, L) into one non-empty range per picked device.

- search_exhaustive: scores EVERY placement with up to `max_stages` stages (vectorised: for each
  device subsequence one broadcast sum over all split points). Used for up to 4 devices.
- search_dp: dynamic programming over (device, layer). The score is additive over stages and
  boundaries (score.py), so the best placement whose last stage is device d ending at layer e
  extends the best placement of [0, b) ending on some earlier device d'. That is a shortest path in
  a DAG, run once per first device (the token's way back joins the last stage to the first):
  EXACT, O(D^3 L + D^2 L^2). Used beyond 4 devices; tests check it against brute force. It sees
  at most L devices of each run of interchangeable ones (interchangeable_runs_cut), so D counts
  distinct devices, not identical ranks.
Both read the same memoised stage table (one fill per (device, range)). Placements whose scores
tie (to TIE_REL) are told apart by the load table: the one whose most-asked card is asked least
wins (cm.load_table), so equal cards get equal shares rather than one card left mostly idle.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import PlanError
from .pricing import MIB
from .score import INF, CostModel

EXHAUSTIVE_MAX_DEVICES = 4
TIE_REL = 1e-13   # scores this close (relative) are a tie: sums in another order differ by ulps


def _tie(value):
    """How close to `value` (a float or an array) a score still ties it."""
    return TIE_REL * np.maximum(1.0, np.abs(value))


@dataclass(frozen=True)
class Placement:
    """Stage i runs on cm.devices[devices[i]] over layers [bounds[i], bounds[i+1])."""

    devices: tuple[int, ...]
    bounds: tuple[int, ...]
    score: float
    method: str

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds, self.bounds[1:]))


def search_exhaustive(cm: CostModel, max_stages: int = EXHAUSTIVE_MAX_DEVICES) -> Placement | None:
    """The best placement among all with 1..max_stages stages (ties: the least-asked most-asked
    card); None if none fits."""
    S, _ = cm.stage_table()
    U = cm.load_table()
    L, D = cm.shape.n_layers, len(cm.devices)
    tables = []                        # (combo, total, load) over every split point of each combo
    for s in range(1, min(max_stages, D, L) + 1):
        for combo in itertools.combinations(range(D), s):
            # total[k1, ..., k_{s-1}] over all split points; non-rising points hit S = inf
            if s == 1:
                total, load = np.array(S[combo[0], 0, L]), np.array(U[combo[0], 0, L])
            else:
                total, load = S[combo[0], 0, :], U[combo[0], 0, :]
                for i in range(1, s - 1):
                    total = total[..., :, None] + cm.links[combo[i - 1], combo[i]] + S[combo[i]]
                    load = np.maximum(load[..., :, None], U[combo[i]])
                total = (total + cm.links[combo[-2], combo[-1]] + S[combo[-1], :, L]
                         + cm.back[combo[-1], combo[0]])
                load = np.maximum(load, U[combo[-1], :, L])
            tables.append((combo, total, load))
    lowest = min((float(t.min()) for _, t, _ in tables), default=INF)
    if lowest >= INF:
        return None
    best, best_key = None, None
    for combo, total, load in tables:
        near = np.flatnonzero(total.ravel() <= lowest + _tie(lowest))
        if near.size == 0:
            continue
        pick = int(near[np.argmin(load.ravel()[near])])
        key = (float(load.ravel()[pick]), float(total.ravel()[pick]))
        if best_key is None or key < best_key:
            ks = np.unravel_index(pick, total.shape) if len(combo) > 1 else ()
            best_key = key
            best = Placement(combo, (0, *map(int, ks), L), key[1] + cm.baseline_ms(), "exhaustive")
    return best


def interchangeable_runs_cut(cm: CostModel) -> list[int]:
    """The devices the DP needs to see, in order: of each run of consecutive devices that are
    interchangeable for the score (the same stage and load rows, the same host and card, so the
    same hand-offs to every other device and among themselves), the first L only. A placement
    has at most L stages, and any placement using later members of a run costs (and loads)
    exactly what the one using its first members in the same order does, so the DP stays exact
    while many identical ranks (--cpu-ranks 1000, one card listed many times) cost L each
    instead of a cube in their number."""
    S, _ = cm.stage_table()
    U = cm.load_table()
    L = cm.shape.n_layers
    keep: list[int] = []
    start, taken = 0, 0
    for d, dev in enumerate(cm.devices):
        if d > 0:
            head = cm.devices[start]
            same = (dev.host == head.host and dev.card == head.card
                    and np.array_equal(S[d], S[start]) and np.array_equal(U[d], U[start]))
            if not same:
                start, taken = d, 0
        if taken < L:
            keep.append(d)
            taken += 1
    return keep


def search_dp(cm: CostModel) -> Placement | None:
    """The best placement over any number of stages, by DP over (device, end layer); exact.
    The token's way back (cm.back) joins the last stage to the first, so the DP runs once per
    first device and adds it at the end. Runs of interchangeable devices are cut to L first
    (interchangeable_runs_cut)."""
    keep = interchangeable_runs_cut(cm)
    S, _ = cm.stage_table()
    U = cm.load_table()
    tables = (S[keep], U[keep], cm.links[np.ix_(keep, keep)], cm.back[np.ix_(keep, keep)])
    best = None                                   # (cost, load, devices, bounds)
    for first in range(len(keep)):
        found = _dp_from(tables, cm.shape.n_layers, first)
        if found is None:
            continue
        if best is None:
            best = found
            continue
        tie = abs(found[0] - best[0]) <= _tie(min(abs(found[0]), abs(best[0])))   # both finite
        if (found[0] < best[0] and not tie) or (tie and found[1] < best[1]):
            best = found
    if best is None:
        return None
    return Placement(tuple(keep[d] for d in best[2]), best[3], best[0] + cm.baseline_ms(), "dp")


def _dp_from(tables: tuple, L: int, first: int) -> tuple[float, float, tuple, tuple] | None:
    """(cost, load, devices, bounds) of the best placement whose first stage runs on `first`.
    `tables`: the stage, load, link and way-back tables of the devices searched (S, U, links,
    back as CostModel has them, cut to those devices)."""
    S, U, links, back = tables
    D = len(S)
    # (cost, load) compared lexicographically, cost to a tie: a smaller load never hurts an
    # extension (the load of a placement is the max over its stages), so the DP stays exact
    f = np.full((D, L + 1), INF)              # f[d, e]: best cost of [0, e) with device d's stage last
    m = np.full((D, L + 1), INF)              # m[d, e]: its load
    from_b = np.zeros((D, L + 1), dtype=np.int64)
    from_d = np.full((D, L + 1), -1, dtype=np.int64)
    cols = np.arange(L + 1)
    for d in range(first, D):
        g = np.full(L + 1, INF)                # g[b]: best cost of [0, b) handed to device d
        gm = np.full(L + 1, INF)
        gd = np.full(L + 1, -1, dtype=np.int64)
        if d == first:
            g[0], gm[0] = 0.0, 0.0             # device d runs the first stage
        for prev in range(first, d):
            cand, candm = f[prev] + links[prev, d], m[prev]
            cand[0] = INF
            with np.errstate(invalid="ignore"):       # inf - inf: not a tie
                tie = np.abs(cand - g) <= _tie(np.minimum(np.abs(cand), np.abs(g)))
            better = (cand < g) & ~tie | tie & (candm < gm) & (cand < INF)
            g[better], gm[better], gd[better] = cand[better], candm[better], prev
        total = g[:, None] + S[d]              # [b, e]
        load = np.maximum(gm[:, None], U[d])
        low = total.min(axis=0)
        near = total <= low + _tie(low)
        b = np.argmin(np.where(near, load, INF), axis=0)   # (a column with no fit stays inf)
        f[d], m[d] = total[b, cols], load[b, cols]
        from_b[d], from_d[d] = b, gd[b]
    last = f[:, L] + back[:, first]
    if last.min() >= INF:
        return None
    near = last <= last.min() + _tie(float(last.min()))
    d = int(np.argmin(np.where(near, m[:, L], INF)))
    cost, load = float(last[d]), float(m[d, L])
    devices, bounds, e = [], [L], L
    while d >= 0:
        devices.append(d)
        b = int(from_b[d, e])
        bounds.append(b)
        d, e = int(from_d[d, e]), b
    return cost, load, tuple(reversed(devices)), tuple(reversed(bounds))


def search_fixed(cm: CostModel, combo: Sequence[int]) -> Placement | None:
    """The best split of [0, L) over exactly the devices `combo` (indices of cm.devices, in stage
    order), one non-empty range each: --stage-gpus names the cards that run stages. A DP over the
    end layer of each stage, exact (the score is additive over stages and boundaries); ties go to
    the placement whose most-asked card is asked least, as in the other searches. None if no
    split fits."""
    S, _ = cm.stage_table()
    U = cm.load_table()
    L = cm.shape.n_layers
    combo = tuple(combo)
    f, m = S[combo[0], 0, :].copy(), U[combo[0], 0, :].copy()     # f[e]: best cost of [0, e)
    picks = []                                                       # per later stage: its start b
    for prev, d in zip(combo, combo[1:]):
        total = f[:, None] + cm.links[prev, d] + S[d]                # [b, e]
        load = np.maximum(m[:, None], U[d])
        low = total.min(axis=0)
        near = total <= low + _tie(low)
        b = np.argmin(np.where(near, load, INF), axis=0)
        cols = np.arange(L + 1)
        f, m = total[b, cols], load[b, cols]
        picks.append(b)
    cost = float(f[L] + cm.back[combo[-1], combo[0]])
    if cost >= INF:
        return None
    bounds, e = [L], L
    for b in reversed(picks):
        e = int(b[e])
        bounds.append(e)
    bounds.append(0)
    return Placement(combo, tuple(reversed(bounds)), cost + cm.baseline_ms(), "stage_gpus")


def search(cm: CostModel) -> Placement | None:
    """Exhaustive for up to 4 devices (all placements scored), the exact DP beyond."""
    if len(cm.devices) <= EXHAUSTIVE_MAX_DEVICES:
        return search_exhaustive(cm)
    return search_dp(cm)


def check_split_points(points: Sequence[int], n_layers: int, n_devices: int) -> tuple[int, ...]:
    """Validate explicit split points K1, K2, ... (first layers of stages 2, 3, ...)."""
    pts = tuple(int(k) for k in points)
    shown = ",".join(map(str, pts))
    if n_devices < 2:
        raise PlanError(f"--layer-split {shown} needs at least 2 devices, got {n_devices}")
    if not pts:
        raise PlanError("--layer-split: no split points given")
    if len(pts) + 1 > n_devices:
        raise PlanError(f"--layer-split {shown} makes {len(pts) + 1} stages but only {n_devices} devices are available")
    bounds = (0, *pts, n_layers)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if hi <= lo:
            raise PlanError(f"--layer-split {shown}: split points must rise strictly inside (0, {n_layers}); "
                            f"stage {i + 1} would run [{lo}, {hi}), which is empty")
    return pts


def shortfall_message(cm: CostModel, d: int, lb: int, le: int, stage: int) -> str:
    """'stage i [lb, le) on DEV needs X MiB (weights + session + reserves), Y MiB free'."""
    need = int(cm.fixed[d, lb, le])
    dev = cm.devices[d]
    tier = int(cm.withheld[d])
    after = (f" after its explicit helper tier's {tier / MIB:.1f} MiB (--expert-cache-device; "
             f"{dev.free_bytes / MIB:.1f} MiB free before it)") if tier else " free"
    draft = cm.params.draft_bytes if le == cm.shape.n_layers else 0   # the last stage carries it
    name, flag = cm.params.drafter
    with_draft = f" (the {name}'s {draft / MIB:.1f} MiB, {flag}, among them)" if draft else ""
    return (f"stage {stage} [{lb}, {le}) on {dev.label} needs {need / MIB:.1f} MiB for weights, session "
            f"and reserves at {cm.cells} cells{with_draft}; {cm.free[d] / MIB:.1f} MiB{after}")


def price_split(cm: CostModel, points: Sequence[int],
                stage_set: Sequence[int] | None = None) -> Placement:
    """Price explicit split points on the best order-preserving choice of devices (all of them
    when there are as many stages as devices). With `stage_set` (the indices of the devices the
    operator named to run stages, --stage-gpus) exactly those, one stage each. Raises PlanError
    when no choice fits."""
    L, D = cm.shape.n_layers, len(cm.devices)
    bounds = (0, *check_split_points(points, L, D), L)
    s = len(bounds) - 1
    if stage_set is not None and s != len(stage_set):
        shown = ",".join(map(str, bounds[1:-1]))
        raise PlanError(f"--layer-split {shown} makes {s} stages; --stage-gpus names "
                        f"{len(stage_set)} card(s) ({', '.join(cm.devices[d].label for d in stage_set)})")
    combos = [tuple(stage_set)] if stage_set is not None else itertools.combinations(range(D), s)
    best: Placement | None = None
    worst_miss: tuple[int, str] | None = None
    for combo in combos:
        short = [(i, d) for i, d in enumerate(combo) if cm.budget(d, bounds[i], bounds[i + 1]) < 0]
        if short:
            i, d = max(short, key=lambda x: cm.fixed[x[1], bounds[x[0]], bounds[x[0] + 1]]
                       - cm.free[x[1]])
            gap = int(cm.fixed[d, bounds[i], bounds[i + 1]] - cm.free[d])
            if worst_miss is None or gap < worst_miss[0]:
                worst_miss = (gap, shortfall_message(cm, d, bounds[i], bounds[i + 1], i + 1))
            continue
        value = cm.score(combo, bounds)
        if best is None or value < best.score:
            best = Placement(combo, bounds, value, "explicit")
    if best is None:
        assert worst_miss is not None
        raise PlanError(f"--layer-split {','.join(map(str, bounds[1:-1]))} does not fit: {worst_miss[1]}")
    return best
