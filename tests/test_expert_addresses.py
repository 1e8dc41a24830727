"""The expert-address table a decode graph reads (ops/expert_addresses.py ExpertAddresses),
built by experts/addresses.py: the value's own checks and views here; the builder over a real
stage's tiers on the CuPy stand-ins in tests/addresses_check.py (the GPU kernels reading it are
tests/test_gpu_decode.py's; the adaptive cache's repoint is tests/test_adaptive_cache.py's)."""
import numpy as np
import pytest

from stand_ins import run_check
from strata_dist.ops.expert_addresses import (HIT, HOST, OWN_HELPER, PINNED, REMOTE,
                                                   ExpertAddresses)


def _value(tier: np.ndarray, lb: int = 1, le: int = 3) -> ExpertAddresses:
    blob_of = np.where(tier == HOST, 0, 0x1000 * (1 + np.arange(tier.size)).reshape(tier.shape))
    return ExpertAddresses(blob_of=blob_of.astype(np.uint64), tier=tier, lb=lb, le=le,
                           host_blobs=None, host_misses=True, off_card=True,
                           cache_lent=lambda: False)


def test_the_views_read_the_stage_layers_only():
    tier = np.array([[HIT, HIT, HIT],                       # layer 0: not the stage's
                     [HIT, REMOTE, PINNED],
                     [OWN_HELPER, HOST, HIT]], dtype=np.int8)
    a = _value(tier)
    assert a.in_cache().tolist() == [[True, False, False], [False, False, True]]
    assert a.in_helper().tolist() == [[False, True, False], [True, False, False]]
    assert a.pairs(HIT) == {(1, 0), (2, 2)}
    assert a.pairs(REMOTE, OWN_HELPER) == {(1, 1), (2, 0)}
    assert a.unreadable() == [(2, 1)]


def test_a_malformed_table_is_refused_naming_its_shape():
    tier = np.full((3, 4), HIT, dtype=np.int8)
    with pytest.raises(ValueError, match=r"blob_of int64\[3, 4\]"):
        ExpertAddresses(np.zeros((3, 4), np.int64), tier, 0, 3, None, True, False, lambda: False)
    with pytest.raises(ValueError, match=r"layers \[2, 5\) outside a table of 3 layers"):
        _value(tier, lb=2, le=5)


def test_the_builder_over_a_stages_tiers_on_the_stand_ins():
    """Cached, own-helper and pinned pairs each at their tier's address; the graph's device table
    is the value; the prompt path's per-layer table is the builder's device part; the refusals."""
    r = run_check("addresses_check.py", timeout=240)
    assert r["waits"] and r["tiers_and_addresses"] and r["graph_table_is_the_value"], r
    assert r["in_cache"] and r["counts_routes"] and r["device_part"], r
    assert r["lost_helper_pinned"], r
    # another card's tier read in place: the first live tier to list a pair; never over the cache
    # or this card's own tier; a tier whose process has gone is skipped
    assert r["remote"] == [[REMOTE, "0x10000"], [REMOTE, "0x30000"], [HIT, r["remote"][2][1]],
                           [OWN_HELPER, r["remote"][3][1]]]
    pinned = r["remote_kept"][2][1]
    assert r["remote_kept"] == [[REMOTE, "0x10000"], [REMOTE, "0x10000"], [PINNED, pinned]], r
    assert r["no_host"] == "15 experts of layers [0, 3) are not in this stage's cache"
    assert r["gone"] == "15 pairs left the cache and are read nowhere else (the first: (0, 2))"
