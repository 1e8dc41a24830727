"""The expert-address table (ops/expert_addresses.py, built by experts/addresses.py) on the
numpy stand-ins for CuPy (tests/fake_cupy), without a GPU: a stage on "cuda:0" whose experts are a
third cached, a third in this card's own helper tier and the rest pinned in host memory, as
tests/test_gpu_decode.py's GPU test has them. Kernels run nothing; what is checked is each pair's
tier and address, that the decode graph's device table is the value's, that the prompt path's
per-layer table (tiers._device_blobs) is the same builder's device part, and the builder's
refusals.

Run as its own process with tests/fake_cupy first on the path (tests/test_expert_addresses.py
does). Prints one JSON line."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adapt_gpu_check import Idle  # noqa: E402
from launch_abi_check import install_kernels  # noqa: E402


class InPlaceTier:
    """Another card's helper tier as the table's builder sees one opened through CUDA IPC (the
    real link needs a helper process and a GPU): alive, its buffer open, its pairs' addresses."""

    def __init__(self, addresses: dict, alive: bool = True):
        self.alive, self.tier, self.tier_addresses = alive, object(), addresses

    def tier_alive(self) -> bool:
        return self.alive


def _refusal(call) -> str:
    from strata_dist.backends.graph_tables import Unsupported
    try:
        call()
    except Unsupported as e:
        return str(e)
    return ""


def main() -> int:
    install_kernels(lambda source, kernel, device=0, defines=(): Idle())
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from strata_dist.ops.expert_addresses import HIT, HOST, OWN_HELPER, PINNED, REMOTE
    from strata_dist.experts.addresses import device_table, stage_addresses
    from strata_dist.experts.stores import BlobArena
    from strata_dist.rank.stage import Stage, StageConfig

    os.environ.pop("STRATA_HOST_MAPPED", None)
    with tempfile.TemporaryDirectory() as d:
        path = write_gguf(tiny_qwen3moe(9, hidden=256, head_dim=128, top_k=4, n_experts=16,
                                        n_layers=3), Path(d) / "stage.gguf", "q8_0")
        cached = [(l, e) for l in range(3) for e in range(0, 16, 3)]
        helper = [(l, e) for l in range(3) for e in range(1, 16, 3)]

        def stage():
            return Stage(StageConfig(str(path), "cuda:0", 0, 3, True, True, 512,
                                     cache_pairs=cached, local_helper_pairs=helper))
        st, lost = stage(), stage()
        waits = st.decode_graph is None               # until the card's helper tier opens
        own = BlobArena(st.backend, st.gguf, helper, 3, 16)
        st.attach_local_helper(own)
        lost.attach_local_helper(None)                # did not open: its pairs pinned instead
        graph, tiers = st.decode_graph, st.tiers
        a = graph.addresses
        rest = {(l, e) for l in range(3) for e in range(16)} - set(cached) - set(helper)
        pinned_at = tiers.pinned.addresses()
        want = {p: (HIT, int(st.cache.held_addresses(p[0])[p[1]])) for p in cached}
        want |= {p: (OWN_HELPER, int(own.held_addresses(p[0])[p[1]])) for p in helper}
        want |= {p: (PINNED, pinned_at[p]) for p in rest}
        got = {(l, e): (int(a.tier[l, e]), int(a.blob_of[l, e])) for l in range(3)
               for e in range(16)}
        # the prompt path's per-layer table: the device part of the same builder
        pinned = a.tier == PINNED
        device_part = all(
            np.array_equal(tiers._device_blobs(l)[0], np.where(pinned[l], 0, a.blob_of[l]))
            and np.array_equal(tiers._device_blobs(l)[1], np.where(pinned[l], HOST, a.tier[l]))
            for l in range(3))
        b = lost.decode_graph.addresses
        # another card's tier opened here: after this card's own tiers, the first to list a pair;
        # a tier whose process has gone is not read
        remote_at = {(0, 2): 0x10000, (0, 0): 0x20000, (1, 2): 0x30000}
        table, tier = device_table(st.cache, own, [InPlaceTier({(1, 2): 0x40000}, alive=False),
                                                   InPlaceTier(remote_at),
                                                   InPlaceTier({(0, 2): 0x50000})], 0, 3)
        # the builder's refusals: misses not to be read from host memory; a table built again
        # whose pinned copies do not hold a pair that left the device tiers
        no_host = _refusal(lambda: stage_addresses(tiers, st.gguf, 0, 3, host_misses=False))
        # (neither the table's own copies nor the stage's pinned tier)
        kept_pinned, tiers.pinned = tiers.pinned, None
        gone = _refusal(lambda: stage_addresses(tiers, st.gguf, 0, 3,
                                                like=dataclasses.replace(a, host_blobs=None)))
        tiers.pinned = kept_pinned
        # a table built again (`like`, the adaptive cache's repoint) keeps another card's tier
        # read in place even once it is gone: only a table built afresh drops it (Stage.run)
        tiers.helpers.append(InPlaceTier({(0, 2): 0x10000}))
        first = stage_addresses(tiers, st.gguf, 0, 3)
        tiers.helpers[-1].alive = False
        again = stage_addresses(tiers, st.gguf, 0, 3, like=first)
        fresh = stage_addresses(tiers, st.gguf, 0, 3)
        tiers.helpers.pop()
        print(json.dumps({
            "remote_kept": [[int(t.tier[0, 2]), hex(int(t.blob_of[0, 2]))]
                            for t in (first, again, fresh)],
            "waits": waits,
            "tiers_and_addresses": got == want,
            "graph_table_is_the_value": bool((cp.asnumpy(graph.blob_of) == a.blob_of).all()),
            "in_cache": graph.in_cache.tolist() == a.in_cache().tolist(),
            "counts_routes": graph.counts_routes,
            "device_part": device_part,
            "lost_helper_pinned": b.pairs(OWN_HELPER, REMOTE) == set() and
            b.pairs(PINNED) == set(helper) | rest and b.host_blobs is lost.tiers.pinned,
            "remote": [[int(tier[l, e]), hex(int(table[l, e]))] for l, e in
                       ((0, 2), (1, 2), (0, 0), (0, 1))],
            "no_host": no_host,
            "gone": gone,
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
