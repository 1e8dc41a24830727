"""The expert-address table a decode graph reads (backends/cuda_decode.py, next_decode.py): for each
layer of a stage, each expert's blob address and the tier it sits in. experts/addresses.py builds
it from the stage's tiers (its cache, helper tiers read in place, pinned host copies) and the model
hands it over (LayerRangeModel.expert_addresses), so a backend reads this value and never the tiers
themselves (tests/test_house_rules.py). After the adaptive cache's swaps the stage builds it again
and the graph writes the entries that changed (graph_tables.repoint_experts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

# where a pair's blob is read from, as experts/tiers.py numbers its tiers (HOST: nothing this
# stage reads in place holds it; a decode graph never has such an entry in its layers)
HOST, HIT, REMOTE, OWN_HELPER, PINNED = 0, 1, 2, 3, 4
HELPER_TIERS = (REMOTE, OWN_HELPER)     # another card's tier opened here, or this card's own


class Unsupported(Exception):
    """Why a stage cannot take the graph path (the general path runs instead). Here, with no CUDA
    import, so the table's builder raises it on a host without CuPy (graph_tables re-exports it)."""


@dataclass(frozen=True)
class ExpertAddresses:
    """The blob addresses of layers [lb, le) of a stage, as its kernels read them in place.

    `blob_of` [n_layer, n_expert] uint64: the device address of each pair's blob (0 outside
    [lb, le) and where nothing holds it); `tier` [n_layer, n_expert] int8: HIT (its cache),
    REMOTE / OWN_HELPER (a helper tier read in place), PINNED (a pinned host copy), HOST (none).
    `host_blobs`: the pinned copies the PINNED entries point into (held here so they live as long
    as a table that reads them), or None. `host_misses`: whether pairs missing from the device
    tiers were allowed to be read from pinned host memory (the same rule when the table is built
    again). `off_card`: some pair of the stage's layers is read outside the cache, or a helper
    tier holds some: a step's routes come back to count its tiers. `cache_lent`: whether the
    cache has lent its tail to a prompt now (its slots' contents are not the table's then)."""
    blob_of: np.ndarray
    tier: np.ndarray
    lb: int
    le: int
    host_blobs: object | None
    host_misses: bool
    off_card: bool
    cache_lent: Callable[[], bool]

    def __post_init__(self):
        if self.blob_of.shape != self.tier.shape or self.blob_of.dtype != np.uint64:
            raise ValueError(f"blob_of {self.blob_of.dtype}{list(self.blob_of.shape)} and tier "
                             f"{list(self.tier.shape)}: expected uint64 of the tier's shape")
        if not 0 <= self.lb < self.le <= self.blob_of.shape[0]:
            raise ValueError(f"layers [{self.lb}, {self.le}) outside a table of "
                             f"{self.blob_of.shape[0]} layers")

    def stage_tiers(self) -> np.ndarray:
        """The tiers of the stage's layers, [le - lb, n_expert]."""
        return self.tier[self.lb:self.le]

    def in_cache(self) -> np.ndarray:
        """[le - lb, n_expert] bool: the pairs read from the stage's own cache."""
        return self.stage_tiers() == HIT

    def in_helper(self) -> np.ndarray:
        """[le - lb, n_expert] bool: the pairs read in place from a helper tier."""
        return np.isin(self.stage_tiers(), HELPER_TIERS)

    def pairs(self, *tiers: int) -> set[tuple[int, int]]:
        """The (layer, expert) pairs of the stage's layers read from any of `tiers`."""
        layers, experts = np.nonzero(np.isin(self.stage_tiers(), tiers))
        return {(self.lb + int(l), int(e)) for l, e in zip(layers, experts)}

    def unreadable(self) -> list[tuple[int, int]]:
        """The pairs of the stage's layers nothing readable in place holds (HOST entries)."""
        return sorted(self.pairs(HOST))
