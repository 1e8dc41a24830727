"""Stage-cache fill and the coverage model.

The fill (DESIGN §4): a stage's cache takes ITS OWN layers' pairs in profile rank order until the
first one that does not fit its byte budget. Because the held set is then exactly "the range's
pairs ranked before position t" for one threshold t, every quantity of a fill — bytes, pair count,
routing mass held — is a difference of prefix tables indexed by (layer bound, t). RankTables builds
those tables once; a fill is then a binary search for t, and all ranges of all devices are filled
in one vectorised pass (each (range, device) computed exactly once: the memo the search relies on).
fill_stage is the plain walk the tables must agree with (tests check every range).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .profile import RoutingProfile
from .shape import ModelShape


def cover_h(f, b: float):
    """H(f) = 1 - (1 - f)^b: share of routing mass held by the hottest fraction f of the pairs."""
    return 1.0 - (1.0 - np.asarray(f, dtype=np.float64)) ** b


def coverage_mode(profile: RoutingProfile, mode: str) -> str:
    """Resolve "auto": a measured (non-uniform) profile's own mass is used directly — it IS the
    routing distribution we rank by; H(f) is the prior for when we know nothing but the ranking."""
    if mode == "auto":
        return "model" if profile.is_uniform else "measured"
    return mode


def pair_masses(profile: RoutingProfile, ranking: np.ndarray, mode: str, cover_b: float) -> np.ndarray:
    """Share of all routed expert activations each pair takes (indexed by flat pair id, sums to 1).

    "model": the pair at global rank r takes the increment H((r+1)/N) - H(r/N), N = all pairs —
    so a set of pairs holds the increment of H over the rank fractions it spans.
    "measured": the profile's normalised counts (RoutingProfile.mass).
    """
    mode = coverage_mode(profile, mode)
    if mode == "measured":
        return profile.mass().ravel()
    n = ranking.size
    h = cover_h(np.arange(n + 1) / n, cover_b)
    out = np.empty(n, dtype=np.float64)
    out[ranking] = np.diff(h)
    return out


@dataclass(frozen=True)
class Fill:
    """A stage cache: the pairs (flat ids, rank order) it holds for range [lb, le) under `budget`."""

    lb: int
    le: int
    budget: int
    pairs: tuple[int, ...]
    bytes: int


def fill_stage(shape: ModelShape, ranking: np.ndarray, lb: int, le: int, budget: int,
               cap: int | None = None) -> Fill:
    """Reference fill: walk the global ranking, take pairs of layers [lb, le) while they fit
    `budget` bytes (and, if pinned, while fewer than `cap` are held); stop at the first that does
    not fit — later, smaller blobs are NOT squeezed in, so the held set stays a rank prefix."""
    E = shape.n_experts
    held: list[int] = []
    used = 0
    if budget >= 0:
        for p in ranking.tolist():
            layer = p // E
            if not lb <= layer < le:
                continue
            size = shape.blob_bytes[layer]
            if (cap is not None and len(held) >= cap) or used + size > budget:
                break
            held.append(p)
            used += size
    return Fill(lb, le, int(budget), tuple(held), used)


class RankTables:
    """Prefix tables over the global ranking: X[k, t] = sum of a per-pair value over the pairs at
    rank positions < t whose layer is < k. A range [b, e) then reads X[e, t] - X[b, t]."""

    def __init__(self, shape: ModelShape, ranking: np.ndarray, mass: np.ndarray):
        L, E = shape.n_layers, shape.n_experts
        ranking = np.asarray(ranking, dtype=np.int64)
        if ranking.size != L * E:
            raise ValueError(f"ranking has {ranking.size} pairs, the model has {L * E}")
        self.shape = shape
        self.ranking = ranking
        self.n = ranking.size
        layer_at = ranking // E                      # layer of the pair at each rank position
        blob = np.asarray(shape.blob_bytes, dtype=np.int64)[layer_at]
        m = np.asarray(mass, dtype=np.float64)[ranking]
        self.layer_at = layer_at
        self.bytes = self._prefix(layer_at, blob, L)
        self.mass = self._prefix(layer_at, m, L)
        self.mass_blob = self._prefix(layer_at, m * blob, L)

    @cached_property
    def count(self) -> np.ndarray:
        """Pairs held; only a pinned cache (stage_cache_slots) needs it, so it is built on demand."""
        return self._prefix(self.layer_at, np.ones(self.n, dtype=np.int64), self.shape.n_layers)

    @staticmethod
    def _prefix(layer_at: np.ndarray, values: np.ndarray, L: int) -> np.ndarray:
        n = layer_at.size
        grid = np.zeros((L + 1, n + 1), dtype=values.dtype)
        grid[layer_at + 1, np.arange(1, n + 1)] = values
        np.cumsum(grid, axis=1, out=grid)
        np.cumsum(grid, axis=0, out=grid)
        return grid

    def span(self, table: np.ndarray, b, e, t):
        return table[e, t] - table[b, t]

    def threshold(self, b, e, budget, cap: int | None = None) -> np.ndarray:
        """Vectorised fill: the largest t with bytes(range, t) <= budget (and count <= cap). The held
        set is then the range's pairs at positions < t — exactly fill_stage's result, since t stops
        at the position of the first range pair that does not fit. Needs budget >= 0."""
        b, e, budget = np.broadcast_arrays(np.asarray(b), np.asarray(e), np.asarray(budget))
        lo = np.zeros(b.shape, dtype=np.int64)
        hi = np.full(b.shape, self.n, dtype=np.int64)
        while True:
            active = lo < hi
            if not active.any():
                return lo
            mid = (lo + hi + 1) // 2
            ok = self.span(self.bytes, b, e, mid) <= budget
            if cap is not None:
                ok &= self.span(self.count, b, e, mid) <= cap
            lo = np.where(active & ok, mid, lo)
            hi = np.where(active & ~ok, mid - 1, hi)

    def pairs_before(self, lb: int, le: int, t: int) -> tuple[int, ...]:
        head = self.layer_at[:t]
        return tuple(self.ranking[:t][(head >= lb) & (head < le)].tolist())

    def fill(self, lb: int, le: int, budget: int, cap: int | None = None) -> Fill:
        """One fill through the tables (same result as fill_stage)."""
        if budget < 0:
            return Fill(lb, le, int(budget), (), 0)
        t = int(self.threshold(lb, le, budget, cap))
        return Fill(lb, le, int(budget), self.pairs_before(lb, le, t), int(self.span(self.bytes, lb, le, t)))
