"""The adaptive cache's GPU-rank Python on the numpy stand-ins for CuPy (tests/fake_cupy), without a
GPU: a stage on "cuda:0" with a decode graph, its misses pinned, adapting every 2 tokens. Kernels
run nothing (the stand-ins route every row to expert 0), so what is checked is the bookkeeping:
the swaps copy each taken pair's pinned blob into its slot, and the running graph's address
table and hit mask, updated in place, equal those of a graph built afresh from the cache after.

Run as its own process with tests/fake_cupy first on the path (tests/test_adaptive_cache.py
does). Prints one JSON line."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_abi_check import install_kernels  # noqa: E402


class Idle:
    """A kernel that runs nothing (this check is about tables, not numbers)."""
    kernel = type("Function", (), {"ptr": 0})()
    max_dynamic_shared_size_bytes = 48 << 10

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        pass


def main() -> int:
    install_kernels(lambda source, kernel, device=0, defines=(): Idle())
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from strata_dist.rank.stage import Stage, StageConfig

    os.environ["STRATA_HOST_MAPPED"] = "1"
    with tempfile.TemporaryDirectory() as d:
        path = write_gguf(tiny_qwen3moe(9, hidden=256, head_dim=128, top_k=4, n_experts=16,
                                        n_layers=4), Path(d) / "stage.gguf", "q8_0")
        st = Stage(StageConfig(model_path=str(path), device="cuda:0", lb=0, le=2, first=True,
                               last=False, max_context=512,
                               cache_pairs=[(l, e) for l in range(2) for e in range(8, 16)],
                               loan_slots=4, adapt_every=2, adapt_swaps=4))
        st.session(0)
        st.begin_prompt()
        st.run(0, 0, ids=list(range(1, 65)), prompt=True)
        st.end_prompt()
        for pos in range(64, 72):
            st.run(0, pos, ids=[5])
        graph = st.decode_graph
        table, hits = cp.asnumpy(graph.blob_of).copy(), graph.in_cache.copy()
        st._rebuild_graph()
        fresh = st.decode_graph
        cache = st.cache
        own = all(bytes(cp.asnumpy(cache.blob(l, e))) == bytes(np.asarray(st.gguf.expert_blob(l, e)))
                  for l, e in cache.pairs)
        # a stage counting for a profile, every pair of its layers cached (no miss: its graph
        # would not bring the routes back otherwise): the graph steps' routes are counted
        counted = Stage(StageConfig(model_path=str(path), device="cuda:0", lb=2, le=4, first=False,
                                    last=False, max_context=512,
                                    cache_pairs=[(l, e) for l in range(2, 4) for e in range(16)],
                                    count_routing=True))
        counted.session(0)
        for pos in range(4):
            counted.run(0, pos, hidden=cp.ones((1, 256), dtype=cp.float32))
        print(json.dumps({
            "profile_graph_steps": counted.tiers.counters["graph_steps"],
            "profile_total": counted.routing.total.tolist(),
            "graph": type(graph).__name__,
            "graph_steps": st.tiers.counters["graph_steps"],
            "adapt_swaps": st.tiers.counters["adapt_swaps"],
            "cached": sorted(list(p) for p in cache.pairs),
            "same_table": bool((table == cp.asnumpy(fresh.blob_of)).all()),
            "same_hits": bool((hits == fresh.in_cache).all()),
            "slots_hold_their_pairs": own,
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
