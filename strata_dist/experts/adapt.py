"""An expert cache that follows the workload (--adapt-every T, --adapt-swaps S).

A stage's cache is filled at load from the plan's ranking (a routing profile, or none). Routing
drifts with the workload, so with adaptation on the stage counts its layers' routing per
(layer, expert) and, every T tokens it processed, swaps up to S of its coldest cached pairs for
the hottest pairs it missed: the new pair's blob is copied into the evicted pair's slot, between
steps, and the residency table (and a decode graph's address table) is pointed at it after the
copy. A swap only moves where an expert's blob is read from, so the tokens are the same as with a
static cache (the placement invariance of strata_dist/experts/tiers.py).

The counts decay by half after every round, so they weigh the recent workload; a missed pair
replaces a cached one only when it was routed clearly more (HYSTERESIS), so two pairs of nearly
the same heat do not swap back and forth every round."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DECAY = 0.5          # the counts' weight after a round (the half-life is one round)
HYSTERESIS = 0.25    # a missed pair must be routed > (1 + this) x a cached one's count ...
MIN_GAP = 1.0        # ... plus this many routings, to take its slot


def pick_swaps(counts: np.ndarray, cached: np.ndarray, max_swaps: int,
               size_class: np.ndarray | None = None, evictable: np.ndarray | None = None,
               margin: float = HYSTERESIS, min_gap: float = MIN_GAP) -> list:
    """The swaps of one round: [((evicted layer, expert), (taken layer, expert)), ...], at most
    `max_swaps`, hottest taken pair first. `counts` [L, E]: routing counts; `cached` [L, E] bool:
    the pairs in the cache. The k-th hottest missed pair replaces the k-th coldest cached one while
    its count exceeds the cached one's by the hysteresis (count > cold * (1 + margin) + min_gap).
    `size_class` [L]: a pair moves only into the slot of a pair of the same class (a slot holds one
    blob size); `evictable` [L, E] bool: the cached pairs that may leave (default all)."""
    counts = np.asarray(counts, dtype=np.float64)
    cached = np.asarray(cached, dtype=bool)
    if max_swaps <= 0:
        return []
    n_layers = counts.shape[0]
    classes = np.zeros(n_layers, dtype=np.int64) if size_class is None else np.asarray(size_class)
    may_leave = cached if evictable is None else cached & np.asarray(evictable, dtype=bool)
    candidates = []
    for c in np.unique(classes):
        rows = (classes == c)[:, None]
        hot = np.argwhere(rows & ~cached & (counts > 0))
        cold = np.argwhere(rows & may_leave)
        # hottest missed first, coldest cached first; ties by (layer, expert) for a stable order
        hot = hot[np.lexsort((hot[:, 1], hot[:, 0], -counts[hot[:, 0], hot[:, 1]]))]
        cold = cold[np.lexsort((cold[:, 1], cold[:, 0], counts[cold[:, 0], cold[:, 1]]))]
        for (hl, he), (cl, ce) in zip(hot[:max_swaps], cold[:max_swaps]):
            h, k = counts[hl, he], counts[cl, ce]
            if not h > k * (1 + margin) + min_gap:
                break
            candidates.append((h - k, (int(cl), int(ce)), (int(hl), int(he))))
    candidates.sort(key=lambda t: -t[0])
    return [(evict, take) for _, evict, take in candidates[:max_swaps]]


def layer_blob_sizes(blob_bytes, lb: int, le: int, n_layers: int) -> np.ndarray:
    """Each layer's expert blob size (`blob_bytes(layer)`), -1 outside the stage's [lb, le): a
    slot holds one blob size, so pairs move only between layers of the same size."""
    return np.array([blob_bytes(l) if lb <= l < le else -1 for l in range(n_layers)],
                    dtype=np.int64)


def pinned_pairs(pairs, pinned, shape: tuple[int, int]) -> np.ndarray:
    """[layer, expert] True where a cached pair (`pairs`) has a copy in the stage's pinned tier
    (None: none has): on a GPU stage only those may leave the cache, since its decode graph then
    reads them there (experts/addresses.py)."""
    held = np.zeros(shape, dtype=bool)
    for l, e in pairs:
        held[l, e] = pinned is not None and pinned.holds(l, e)
    return held


def coverage(counts: np.ndarray, cached: np.ndarray) -> float:
    """The share of the counted routing the cached pairs hold (1.0 when nothing was counted)."""
    total = float(counts.sum())
    return float(counts[cached].sum()) / total if total > 0 else 1.0


@dataclass
class Round:
    """One adaptation round: the swaps made and the coverage of the counted routing before/after."""
    swaps: list
    coverage_before: float
    coverage_after: float


class RoutingCounts:
    """A stage's decayed routing counts per (layer, expert) and its token clock: `due()` every
    `every` tokens (0: never)."""

    def __init__(self, shape: tuple[int, int], every: int, swaps: int):
        if every < 0 or swaps < 0:
            raise ValueError(f"adapt_every {every}, adapt_swaps {swaps}: expected >= 0")
        self.counts = np.zeros(shape, dtype=np.float64)
        self.every, self.swaps = int(every), int(swaps)
        self.tokens = 0
        # every routing counted since the start, never decayed: a profile learnt live
        # (--expert-profile-out, strata_dist/tools/profile_io.py)
        self.total = np.zeros(shape, dtype=np.int64)

    @property
    def on(self) -> bool:
        return self.every > 0 and self.swaps > 0

    def add(self, layer: int, idx) -> None:
        """Count the routed experts `idx` (host ints, any shape; -1 = none) of `layer`."""
        ids = np.asarray(idx).ravel()
        ids = ids[ids >= 0]
        if ids.size:
            self.add_counts(layer, np.bincount(ids, minlength=self.counts.shape[1]))

    def add_counts(self, layer: int, counts) -> None:
        """Count `counts[e]` more routings of each expert e of `layer`."""
        self.counts[layer] += counts
        self.total[layer] += np.asarray(counts, dtype=np.int64)

    def add_layers(self, lb: int, routes) -> None:
        """Count routes [layers from lb, rows, k] (a decode graph's step): one bincount over
        layer * n_experts + expert, not one per layer."""
        routes = np.asarray(routes)
        n_layers, n_experts = routes.shape[0], self.counts.shape[1]
        flat = (np.arange(n_layers)[:, None, None] * n_experts + routes)[routes >= 0]
        step = np.bincount(flat, minlength=n_layers * n_experts).reshape(n_layers, n_experts)
        self.counts[lb:lb + n_layers] += step
        self.total[lb:lb + n_layers] += step

    def remove(self, layer: int, idx) -> None:
        """Take back the routes `idx` of `layer` counted by `add` (rows of a verify window whose
        drafts were rejected: never a token of the traffic). Decayed counts stay >= 0."""
        ids = np.asarray(idx).ravel()
        ids = ids[ids >= 0]
        if ids.size:
            c = np.bincount(ids, minlength=self.counts.shape[1])
            self.counts[layer] = np.maximum(self.counts[layer] - c, 0.0)
            self.total[layer] -= c

    def tick(self, n_tokens: int) -> bool:
        """n_tokens more processed: whether a round is due now."""
        if not self.on:
            return False
        self.tokens += int(n_tokens)
        if self.tokens < self.every:
            return False
        self.tokens = 0
        return True

    def decay(self) -> None:
        self.counts *= DECAY


class WindowRoutes:
    """Counts a verify window's routes as `RoutingCounts` does and keeps each layer's, row by row
    ([rows, k]), until the next step says how many rows were accepted (`settle`)."""

    def __init__(self, counts: RoutingCounts, start: int, n: int):
        self.counts, self.start, self.n = counts, start, n
        self.rows: dict[int, np.ndarray] = {}

    def add(self, layer: int, idx) -> None:
        self.counts.add(layer, idx)
        self.rows[layer] = np.array(idx).reshape(self.n, -1)

    def settle(self, pos: int) -> int:
        """The session's next step is at `pos`: inside the window, rows [pos - start, n) held
        rejected drafts and their routes are taken back; elsewhere (the request ended, and a
        later one may start anywhere) every row stands. The rows that stand."""
        kept = pos - self.start if self.start < pos < self.start + self.n else self.n
        for layer, idx in self.rows.items():
            self.counts.remove(layer, idx[kept:])
        return kept
