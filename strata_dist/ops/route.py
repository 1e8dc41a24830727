"""The route op: a MoE layer's top-k experts and their weights from the router's logits, on the
device (kernels/routing.cuh's top-k code in both paths, so a prompt and a decode step pick alike).

A prompt chunk (`prompt_route`, ComputeOptions.device_routing): the router's product by CuPy,
then route_rows over the rows (`route_rows`); None where a layer has more experts than the
kernel takes (the backend routes on the host then). The decode graph (`graph_route`): the
router's matvec with the RMSNorm fused, its last block picking the top-k into the graph's ids,
weights and each chosen expert's blob address (its RouteSpec table: `route_spec`)."""
from __future__ import annotations

import math

import numpy as np

try:
    import cupy as cp
except ImportError:   # the decode graph's launchers need none: backends/graph_ops.py imports
    cp = None         # them where CuPy is not (tests/test_model_interface.py reads its ops)

from ..compute_options import fall_back
from ..kernels.abi import MAX_GROUP_EXPERTS, ROUTE_SPEC
from .tables import spec_array

KERNELS = "experts_rows.cu"


def prompt_route(backend, rows, x, router, k: int, normalize: bool):
    """(ids, wts) [n, k] on the device for rows x through `router` [n_expert, n_embd] (the
    logits in the backend's buffer of that name), `rows` the backend's ops/moe.py RowsKernels;
    None where the kernel does not take the layer."""
    logits = cp.matmul(x, router.T, out=backend.buffer(
        "logits", (int(x.shape[0]), int(router.shape[0])), cp.float32))
    return rows.route(logits, k, normalize)


def route_rows(device: int, buf, logits, k: int, normalize: bool):
    """(ids, wts) [n, k] on the device from router logits [n, n_expert] (the decode graph's
    top-k code, routing.cuh): int32 experts in rank order, -1 where a row picks nothing;
    float32 weights, NaN there. None (the reason logged once) when a layer has more experts
    than the kernels take.
    `buf(name, shape, dtype)`: where the outputs go."""
    from ..kernels import function
    n, n_expert = (int(v) for v in logits.shape)
    if n_expert > MAX_GROUP_EXPERTS or k > 32:
        fall_back("the device routing of a prompt chunk (device_routing)",
                  f"{n_expert} experts, top-{k} (route_rows takes at most {MAX_GROUP_EXPERTS}, "
                  f"top-32)")
        return None
    with cp.cuda.Device(device):
        logits = cp.ascontiguousarray(logits, dtype=cp.float32)
        ids = buf("ids", (n, k), cp.int32)
        wts = buf("wts", (n, k), cp.float32)
        if n:
            function(KERNELS, "route_rows", device)(
                (math.ceil(n / 8),), (256,),
                (logits, np.int32(n), np.int32(n_expert), np.int32(k), np.int32(normalize),
                 ids, wts))
    return ids, wts


# ---- the decode graph's -------------------------------------------------------------------------
def route_spec(graph, layer: int, expert_table, normalize: bool):
    """A layer's RouteSpec table (kernels/abi.py ROUTE_SPEC): where the router's last block reads
    the logits and the layer's ExpertSpec, and writes the chosen ids, weights and blob addresses
    (the graph's buffers; the ids a layer's own rows)."""
    g = graph.g
    return spec_array(ROUTE_SPEC, [dict(
        experts=int(expert_table.data.ptr), logits=int(graph.router_logits.data.ptr),
        ids=int(graph.ids[layer - graph.lb].data.ptr), wts=int(graph.wts.data.ptr),
        blobs=int(graph.blobs.data.ptr), done=int(graph.done.data.ptr),
        n_expert=g.n_expert, k=g.n_expert_used, normalize=int(normalize))])


def graph_route(graph, spec: dict, h, n: int, eps) -> None:
    """The router's matvec over rms_norm(h) (the normed rows left in the graph's xn for the
    experts and a shared expert), its last block picking the top-k (ids, weights, blob
    addresses); `spec` the layer's launch tables."""
    graph._matvec(spec["router"], h, graph.g.n_embd, n, spec["ffn_norm"], eps,
                  normed=graph.xn, route=spec["route"])
