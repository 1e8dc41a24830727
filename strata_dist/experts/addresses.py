"""The one builder of a stage's expert-address table (ops/expert_addresses.py ExpertAddresses):
where each pair of its layers is read in place, by tier. The decode graph takes the whole table
(through LayerRangeModel.expert_addresses); a prompt chunk grouped on the device takes one layer's
device part (tiers.ExpertTiers._device_blobs), its misses streamed rather than read in place."""
from __future__ import annotations

import numpy as np

from ..ops.expert_addresses import (HIT, HOST, OWN_HELPER, PINNED, REMOTE, ExpertAddresses,
                                         Unsupported)
from .stores import BlobArena, ExpertStore, HostTier


def device_table(cache: BlobArena, local_helper: BlobArena | None, helpers, lb: int,
                 le: int) -> tuple[np.ndarray, np.ndarray]:
    """Per pair of layers [lb, le): the device address of its blob ([le - lb, n_expert] uint64, 0
    where no device tier holds it) and its tier: HIT in the stage's cache, else OWN_HELPER in this
    card's helper tier, else REMOTE in another card's tier opened here through CUDA IPC whose
    process still runs (the first of `helpers` to list it), else HOST."""
    n_expert = cache.slot_of.shape[1]
    table = np.zeros((le - lb, n_expert), dtype=np.uint64)
    tier = np.full((le - lb, n_expert), HOST, dtype=np.int8)
    for arena, code in ((cache, HIT), (local_helper, OWN_HELPER)):
        if arena is None:
            continue
        for i, layer in enumerate(range(lb, min(le, arena.slot_of.shape[0]))):
            take = (tier[i] == HOST) & (arena.slot_of[layer] >= 0)
            table[i][take] = arena.held_addresses(layer)[take]
            tier[i][take] = code
    for h in helpers:
        if not (h.alive and h.tier is not None and h.tier_alive()):
            continue
        for (layer, expert), address in h.tier_addresses.items():
            if lb <= layer < le and address and tier[layer - lb, expert] == HOST:
                table[layer - lb, expert], tier[layer - lb, expert] = address, REMOTE
    return table, tier


def stage_addresses(store: ExpertStore, gguf, lb: int, le: int, host_misses: bool | None = None,
                    like: ExpertAddresses | None = None) -> ExpertAddresses:
    """The table of layers [lb, le) of `store` (a stage's ExpertTiers, or a single process's
    resident BlobArena) as a decode graph reads it. A pair no device tier holds is read from a
    pinned host copy where `host_misses` (default: the store's misses_read_in_place): the stage's
    own pinned tier when it holds every such pair, else copies pinned here for them; without
    host_misses, or where pinning fails, `Unsupported` (the stage takes the general path).
    `like`: this stage's table taken before (the adaptive cache moved blobs since): the same rule,
    the same pinned copies (else the stage's pinned tier, where it holds every pair those lack:
    a pair the cache evicted), which must hold every pair that left the device tiers, and the
    same entries of other cards' tiers read in place; nothing is pinned anew."""
    if isinstance(store, HostTier):
        raise Unsupported("the experts are read from the model file: no blob has a device address")
    if isinstance(store, BlobArena):
        cache, local_helper, helpers, pinned = store, None, (), None
    else:
        cache, local_helper, helpers, pinned = (store.cache, store.local_helper, store.helpers,
                                                store.pinned)
    n_layer = max(le, cache.slot_of.shape[0])
    if like is not None:
        host_misses = like.host_misses
    elif host_misses is None:
        host_misses = store.misses_read_in_place
    device, device_tier = device_table(cache, local_helper, helpers, lb, le)
    if like is not None:
        # another card's tier read in place leaves a table only when the stage builds it afresh
        # (Stage.run, after tiers_changed), never in a repoint between: its entries stand where
        # no tier of this card holds the pair now
        keep = (device_tier == HOST) & (like.tier[lb:le] == REMOTE)
        device[keep], device_tier[keep] = like.blob_of[lb:le][keep], REMOTE
    table = np.zeros((n_layer, device.shape[1]), dtype=np.uint64)
    tier = np.full(table.shape, HOST, dtype=np.int8)
    table[lb:le], tier[lb:le] = device, device_tier
    missing = [(lb + int(j), int(e)) for j, e in zip(*np.nonzero(device_tier == HOST))]
    host_blobs = None if like is None else like.host_blobs
    if missing:
        if not host_misses:
            raise Unsupported(f"{len(missing)} experts of layers [{lb}, {le}) are not in this "
                              f"stage's cache")
        if like is None:
            host_blobs = _pinned_for(missing, pinned, gguf)
        elif not _holds(host_blobs, missing) and _holds(pinned, missing):
            # a pair the adaptive cache evicted has its copy in the stage's pinned tier
            # (Stage._adapt evicts only those), which a table built with no miss, or with
            # copies pinned for its misses alone, does not read yet
            host_blobs = pinned
        lost = [p for p in missing if not _holds(host_blobs, [p])]
        if lost:
            raise Unsupported(f"{len(lost)} pairs left the cache and are read nowhere else "
                              f"(the first: {lost[0]})")
        at = host_blobs.addresses()
        for layer, expert in missing:
            table[layer, expert], tier[layer, expert] = at[(layer, expert)], PINNED
    helper_held = any(h.alive and h.tier is not None and
                      any(lb <= l < le for l, _ in h.tier_addresses) for h in helpers)
    if local_helper is not None:
        helper_held |= bool((local_helper.slot_of[lb:le] >= 0).any())
    return ExpertAddresses(blob_of=table, tier=tier, lb=lb, le=le, host_blobs=host_blobs,
                           host_misses=bool(host_misses),
                           off_card=host_blobs is not None or helper_held,
                           cache_lent=lambda: bool(cache.lent))


def _holds(blobs, pairs) -> bool:
    """Whether pinned copies `blobs` (None: none) hold every pair of `pairs`."""
    return blobs is not None and all(blobs.holds(l, e) for l, e in pairs)


def _pinned_for(missing, pinned, gguf):
    """The pinned copies a table reads `missing` from: the stage's own pinned tier when it holds
    them all, else copies pinned now for them (backends/host_mapped.py)."""
    if _holds(pinned, missing):
        return pinned
    from ..backends.host_mapped import MappedHostBlobs
    try:
        return MappedHostBlobs(gguf, missing)
    except Exception as e:   # memlock limit, host memory, no mapped memory
        raise Unsupported(f"the {len(missing)} experts missing from the cache could not be "
                          f"pinned in host memory: {e}") from e
