"""The adaptive cache on a GPU stage whose graph had no miss when built (tests/fake_cupy stand-ins,
no GPU): its cache holds experts 8..15 of its layers, this card's own helper tier the rest, every
pair pinned (the adaptive cache pins them all). The stand-ins route every row to expert 0, a pair
of the helper tier: the adaptive cache takes it into the cache, evicting a cached pair that has
its pinned copy, so the graph's table built again must read the evicted pair from the stage's
pinned tier, which the table built with no miss did not read. Checked: the step that swaps runs,
the graph stays, and its table equals one built afresh. With `--repoint-fails` the graph's repoint
raises Unsupported once (a table it cannot follow; rare, so injected): the stage must build its
graph afresh rather than keep the stale table, and the step must still run.

Run as its own process with tests/fake_cupy first on the path (tests/test_adaptive_cache.py
does). Prints one JSON line."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adapt_gpu_check import Idle  # noqa: E402
from launch_abi_check import install_kernels  # noqa: E402


def main() -> int:
    install_kernels(lambda source, kernel, device=0, defines=(): Idle())
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from strata_dist.ops.expert_addresses import PINNED
    from strata_dist.experts.stores import BlobArena
    from strata_dist.rank.stage import Stage, StageConfig

    os.environ["STRATA_HOST_MAPPED"] = "1"
    with tempfile.TemporaryDirectory() as d:
        path = write_gguf(tiny_qwen3moe(9, hidden=256, head_dim=128, top_k=4, n_experts=16,
                                        n_layers=2), Path(d) / "stage.gguf", "q8_0")
        cached = [(l, e) for l in range(2) for e in range(8, 16)]
        helper = [(l, e) for l in range(2) for e in range(8)]
        st = Stage(StageConfig(model_path=str(path), device="cuda:0", lb=0, le=2, first=True,
                               last=True, max_context=512, cache_pairs=cached,
                               local_helper_pairs=helper, adapt_every=2, adapt_swaps=1))
        st.attach_local_helper(BlobArena(st.backend, st.gguf, helper, 2, 16))
        first = st.decode_graph
        built = first.addresses
        if "--repoint-fails" in sys.argv:
            from strata_dist.ops.expert_addresses import Unsupported

            def refuse(addresses):
                raise Unsupported("injected: a table this graph cannot follow")
            first.repoint = refuse
        st.session(0)
        error = ""
        try:
            for pos in range(4):
                st.run(0, pos, ids=[5])
        except Exception as e:    # the step whose round swapped: the table could not be rebuilt
            error = f"{type(e).__name__}: {e}"
        graph = st.decode_graph
        evicted = sorted(set(cached) - set(st.cache.pairs))
        table = cp.asnumpy(graph.blob_of).copy() if graph is not None else None
        st._rebuild_graph()
        fresh = st.decode_graph
        print(json.dumps({
            "built_with_no_pinned": built.host_blobs is None,
            "graph_rebuilt": graph is not None and graph is not first,
            "error": error,
            "adapt_swaps": st.tiers.counters["adapt_swaps"],
            "evicted": [list(p) for p in evicted],
            "evicted_pinned": bool(graph is not None and evicted and all(
                graph.addresses.tier[l, e] == PINNED for l, e in evicted)),
            "same_table": bool(table is not None
                               and (table == cp.asnumpy(fresh.blob_of)).all()),
            "same_hits": bool(graph is not None and (graph.in_cache == fresh.in_cache).all()),
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
