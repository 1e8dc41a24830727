"""A runner's q8_0 K/V stores made to keep another runner's cells (issue 47's diagnostic,
tests/test_gpu_kv_q8_mirror.py; checked on the host by tests/test_kv_q8_routing_tie.py).

Two runners that quantize K and V each from their own floats can land a value on different int8
codes wherever their floats straddle a rounding step; on a tiny random model one such code can
flip a routing near-tie and move the logits by far more than any kernel error would. With
`mirror_kv`, runner B's attention layers read runner A's cells instead: every write of B keeps
A's int8 values and scales for the cells written (A must have written them first), and records
what B itself would have written, so the two quantizations can be compared cell by cell."""
from __future__ import annotations

import numpy as np

from strata_dist.backends.kv_cache import Q8Rows


class MirroredQ8Rows(Q8Rows):
    """q8_0 rows in `store`'s arrays whose writes take `source`'s cells (a Q8Rows on the same or
    another array module; `take` brings its arrays to this one's), keeping this side's own
    quantization of each write in `own`."""

    def __init__(self, store: Q8Rows, source: Q8Rows, take):
        if not isinstance(store, Q8Rows) or not isinstance(source, Q8Rows):
            raise TypeError(f"mirroring q8_0 rows needs two Q8Rows stores, given "
                            f"{type(store).__name__} and {type(source).__name__}")
        if tuple(store.shape) != tuple(source.shape):
            raise ValueError(f"rows of {tuple(store.shape)} cannot mirror rows of "
                             f"{tuple(source.shape)}")
        super().__init__(store.xp, store.shape, arrays=(store.q, store.scale))
        self.source, self.take = source, take
        self.own = Q8Rows(store.xp, store.shape)
        self.written: list[slice] = []

    def __setitem__(self, cells: slice, rows) -> None:
        self.own[cells] = rows
        self.q[cells] = self.take(self.source.q[cells])
        self.scale[cells] = self.take(self.source.scale[cells])
        self.written.append(cells)


def mirror_kv(session, source_session, layers, take) -> dict:
    """Replace `session`'s K and V stores of `layers` (a qwen3next HybridSession's attention
    layers) by MirroredQ8Rows of `source_session`'s; returns {(layer, "k" | "v"): store}."""
    stores = {}
    for layer in layers:
        for kind, table in (("k", session._k), ("v", session._v)):
            source = getattr(source_session, kind)(layer)
            table[layer] = stores[layer, kind] = MirroredQ8Rows(table[layer], source, take)
    return stores


# a write whose own quantization differs from the source's by more than these is not the same
# arithmetic on the same floats: a wrong block, scale, head or cell moves most codes, and floats
# apart by more than float32 rounding (an f16 product's) move a few percent of them by one step
# and their scales by two f16 ulps or more (tests/test_kv_q8_general_host.py)
WRITE_BOUND = {"scale_ulps": 1, "code_max": 1, "code_share": 1e-2}


def beyond_write_bound(d: dict) -> bool:
    """Whether `code_differences`' d exceeds WRITE_BOUND in any of its fields."""
    return any(d[field] > bound for field, bound in WRITE_BOUND.items())


def code_differences(store: MirroredQ8Rows, to_host, cells: slice) -> dict:
    """How this side's own quantization of `cells` differs from the source's: the most f16 ulps
    between two scales, the largest int8 code difference, and the share of codes that differ."""
    own_q = to_host(store.own.q[cells]).astype(np.int32)
    src_q = to_host(store.source.q[cells]).astype(np.int32)
    own_s = to_host(store.own.scale[cells]).view(np.int16).astype(np.int32)
    src_s = to_host(store.source.scale[cells]).view(np.int16).astype(np.int32)
    diff = np.abs(own_q - src_q)
    return {"scale_ulps": int(np.abs(own_s - src_s).max()), "code_max": int(diff.max()),
            "code_share": float((diff != 0).mean())}
