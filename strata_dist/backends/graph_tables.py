"""The decode graphs' expert tables as a stage's cache changes (backends/cuda_decode.py,
next_decode.py): an address table built again written where it changed, and a step's expert
computations counted by tier. (The matvecs' argument tables are the linear op's, ops/linear.py;
the other ops' are in their modules.)"""
from __future__ import annotations

import numpy as np
import cupy as cp

from ..ops.expert_addresses import Unsupported  # noqa: F401 (the graphs import it from here)


def repoint_experts(graph, addresses) -> None:
    """The stage's expert-address table built again after blobs moved (the adaptive cache swapped
    them, strata_dist/experts/adapt.py; ops/expert_addresses.py): the entries of a settled
    decode graph's address table that changed are written, and its hit masks and table taken
    from the new one (whose builder refused a pair read nowhere: Unsupported). The entries are
    written on the null stream, which every step waits for (cuda_decode.DecodeGraph._launch_step),
    so no step reads an entry before the blob copies queued there before it."""
    old = graph.addresses
    if (addresses.lb, addresses.le) != (old.lb, old.le) or addresses.blob_of.shape != \
            old.blob_of.shape:
        raise ValueError(f"a table of layers [{addresses.lb}, {addresses.le}) "
                         f"{list(addresses.blob_of.shape)} cannot repoint a graph of layers "
                         f"[{old.lb}, {old.le}) {list(old.blob_of.shape)}")
    changed = zip(*np.nonzero((addresses.blob_of != old.blob_of) | (addresses.tier != old.tier)))
    with cp.cuda.Stream.null:
        for layer, expert in changed:
            at = addresses.blob_of[layer, expert]
            align = graph.blob_align[int(layer)]
            if int(at) % align:
                raise Unsupported(f"pair ({layer}, {expert}) moved to {int(at):#x}, not aligned "
                                  f"on {align} bytes for the expert kernels")
            graph.blob_of[layer, expert] = np.uint64(at)
    graph.addresses = addresses
    graph.in_cache, graph.in_helper = addresses.in_cache(), addresses.in_helper()


def count_tiers(graph, n: int, routes) -> dict[str, int]:
    """A decode graph's step of n rows: its expert computations by where the blob was, from its
    routes [stage layers, >= n, k]: the cache, this card's helper tier ("remote", as the general
    path counts a helper's) or host memory."""
    total = n * graph.g.n_expert_used * (graph.le - graph.lb)
    if not graph.counts_routes:
        return {"hits": total, "remote": 0, "host": 0}
    ids = routes[:, :n]                               # [stage layers, n, k]
    layer = np.arange(graph.le - graph.lb)[:, None, None]
    chosen, asked = np.clip(ids, 0, None), ids >= 0
    hits = int(graph.in_cache[layer, chosen][asked].sum())
    helper = int(graph.in_helper[layer, chosen][asked].sum())
    return {"hits": hits, "remote": helper, "host": int(asked.sum()) - hits - helper}
