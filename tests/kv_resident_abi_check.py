"""--kv-resident on the GPU path without a GPU: a qwen3moe runner on cuda:0 with fewer cells
resident than its context (K/V kept as argv[2]: f16, the default, or q8_0), on the numpy stand-ins for CuPy (tests/fake_cupy) with every kernel
launch checked against its C signature (tests/launch_abi_check.py). Nothing numeric runs (the
kernels are not run); what runs is the Python around them: the sessions' RingKV stores with mapped
host copies, the prompt's general path through them, the decode graph's `_ring` builds and its
pointer table, and the ring's bookkeeping around graph steps and a rewind.

Run as its own process with tests/fake_cupy first on the path (tests/test_kv_resident_gpu.py
does): `kv_resident_abi_check.py NVCC [f16|q8_0]`. Prints one JSON line."""
from __future__ import annotations

import collections
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_abi_check import install  # noqa: E402

SINKS, RING = 4, 160


def ring_words(stores, q8: bool) -> list[int]:
    """What kernels/attention.cuh says follows the RoPE tables for these stores (two a layer slot;
    None: a qwen3next linear layer's slot): q8_0's card scales, the host copies' device addresses
    (q8_0: values, then scales), then S | R << 32."""
    card_scales = [int(a.scale.data.ptr) if a is not None else 0 for a in stores] if q8 else []
    host = [a.host_device_ptr if a is not None else 0 for a in stores]
    host_scales = [a.host_scale_device_ptr if a is not None else 0 for a in stores] if q8 else []
    return card_scales + host + host_scales + [SINKS | RING << 32]


def card_ptr(a, q8: bool) -> int:
    """A ring store's pointer-table entry: the card's rows, or q8_0's int8 values."""
    return int((a.card.q if q8 else a.card).data.ptr)


def host_pinned(a, q8: bool) -> bool:
    """The store's host copy is the mapped memory whose device addresses the table holds."""
    if not q8:
        return a.host_device_ptr == a.host.ctypes.data and a.host_scale_device_ptr == 0
    return (a.host_device_ptr == a.host.q.ctypes.data
            and a.host_scale_device_ptr == a.host.scale.ctypes.data)


def main() -> int:
    counts, errors = collections.Counter(), []
    install(sys.argv[1], counts, errors)
    kv_type = sys.argv[2] if len(sys.argv) > 2 else "f16"
    q8 = kv_type == "q8_0"
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from strata_dist.tools.single_process import SingleProcessRunner

    prompt = [int(x) for x in np.random.default_rng(11).integers(0, 320, 300)]
    with tempfile.TemporaryDirectory() as d:
        path = write_gguf(tiny_qwen3moe(7, hidden=256, head_dim=128, top_k=4, n_experts=16,
                                        n_layers=3), Path(d) / "m.gguf", "f16")
        r = SingleProcessRunner(str(path), "cuda:0", prompt_chunk=128, max_context=512,
                                kv_resident=SINKS + RING, kv_type=kv_type)
        r.prefill(prompt)                       # 300 cells through a ring of 160
        ends = [r.session.k(0).end]
        r.decode_step([5])
        r.decode_step([5, 6, 7])
        ends.append(r.session.k(0).end)
        r.session.n_past = 200                  # rolled back: the next step refills the ring
        r.decode_step([9])
        ends.append(r.session.k(0).end)
        g = r.decode_graph
        stores = [a for layer in range(3) for a in (r.session.k(layer), r.session.v(layer))]
        table = [int(x) for x in np.asarray(g.sess_table)[0]]   # slot 0: the one session
        want = ([card_ptr(a, q8) for a in stores]
                + [int(r.session.rope_cos.data.ptr), int(r.session.rope_sin.data.ptr)]
                + ring_words(stores, q8))
        nxt = next_runner(d, kv_type)           # its launches counted too
        stage = stage_run(path, kv_type)
        print(json.dumps({
            "graph": type(g).__name__ if g is not None else None,
            "errors": errors, "counts": dict(counts), "ends": ends,
            "table_matches": table == want, "table_words": len(table),
            "host_pinned": all(host_pinned(a, q8) for a in stores),
            "card_cells": [int(a.card.shape[0]) for a in stores],
            "host_cells": [int(a.host.shape[0]) for a in stores],
            "qwen3next": nxt, "stage": stage,
        }))
    return 0


def stage_run(path, kv_type: str) -> dict:
    """The same file and ring through a rank's Stage (rank/stage.py: what strata-launch runs, with
    its own check of what the GPU ring kernels take): a prompt of 200 cells, two decode steps."""
    from strata_dist.rank.stage import Stage, StageConfig
    st = Stage(StageConfig(model_path=str(path), device="cuda:0", lb=0, le=3, first=True,
                           last=False, max_context=512, kv_type=kv_type,
                           kv_resident=SINKS + RING,
                           cache_pairs=[(l, e) for l in range(3) for e in range(16)]))
    session = st.session(0)
    st.begin_prompt()
    st.run(0, 0, ids=list(range(1, 201)), prompt=True)
    st.end_prompt()
    for pos in (200, 201):
        st.run(0, pos, ids=[5])
    k = session.k(0)
    return {"graph": type(st.decode_graph).__name__ if st.decode_graph is not None else None,
            "store": type(k).__name__, "card": type(k.card).__name__, "end": k.end}


def next_runner(folder: str, kv_type: str) -> dict:
    """A qwen3next runner of 8 layers (attention in 3 and 7) with the same ring and K/V type: its
    table holds each slot's pair (K and V, or a linear layer's conv and recurrent state), the
    RoPE tables, with q8_0 the attention slots' scales, the attention slots' host copies (0 for a
    linear slot) and (S, R)."""
    q8 = kv_type == "q8_0"
    from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next_gguf
    from strata_dist.tools.single_process import SingleProcessRunner
    path = write_next_gguf(tiny_qwen3next(22, hidden=128, head_dim=256, n_head=4, n_kv=2,
                                          n_k_heads=2, n_v_heads=4, head_k_dim=32, head_v_dim=32,
                                          top_k=4, n_experts=16), Path(folder) / "n.gguf", "f16")
    r = SingleProcessRunner(str(path), "cuda:0", prompt_chunk=128, max_context=512,
                            kv_resident=SINKS + RING, checkpoint_every=128, kv_type=kv_type)
    prompt = [int(x) for x in np.random.default_rng(12).integers(0, 320, 300)]
    r.prefill(prompt[:256], checkpoint_at=(256,))
    r.prefill(prompt[256:])
    ends = [r.session.k(3).end]
    r.decode_step([5])
    r.decode_step([5, 6, 7])
    ends.append(r.session.k(7).end)
    r.checkpoints.enter(r.session, 256)     # back to the checkpoint: the next step refills
    r.decode_step([9])
    ends.append(r.session.v(3).end)
    g, s = r.decode_graph, r.session
    linear = [s.g.is_linear(l) for l in range(8)]
    pairs = [a for l in range(8) for a in ((s.conv_state(l), s.recurrent_state(l)) if linear[l]
                                           else (s.k(l), s.v(l)))]
    slot_layer = [l for l in range(8) for _ in range(2)]
    stores = [None if linear[l] else a for l, a in zip(slot_layer, pairs)]
    want = ([int(a.data.ptr) if linear[l] else card_ptr(a, q8) for l, a in zip(slot_layer, pairs)]
            + [int(s.rope_cos.data.ptr), int(s.rope_sin.data.ptr)]
            + ring_words(stores, q8))
    return {"graph": type(g).__name__ if g is not None else None, "ends": ends,
            "attention_layers": [l for l in range(8) if not linear[l]],
            "table_matches": [int(x) for x in np.asarray(g.sess_table)[0]] == want}


if __name__ == "__main__":
    sys.exit(main())
