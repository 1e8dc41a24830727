"""--kv-resident on the GPU path, checked without a GPU (tests/kv_resident_abi_check.py: the
backend's Python on numpy stand-ins for CuPy, every kernel launch against its C signature): a
qwen3moe f16 runner keeps S + R cells of each K/V on the card and every cell in a mapped host
copy; its decode graph launches the `_ring` builds, its pointer table holds the card's cells,
the RoPE tables, the host copies' device addresses and (S, R); the ring's end follows the graph
steps and a rollback. The same for a qwen3next runner (next_attention.cuh's ring builds, its
linear layers' slots beside), and both again with q8_0 K/V (values and scales on the card and in
the host copy, the `_q8_ring` builds). Nothing numeric: tests/test_gpu_kv_resident.py, on a GPU. Skips
without nvcc."""
import shutil

import pytest

from stand_ins import run_check

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def test_the_decode_graph_reads_the_ring_and_the_host_copy():
    report = run_check("kv_resident_abi_check.py", NVCC, timeout=540)
    assert report["errors"] == [] and report["graph"] == "DecodeGraph"
    counts = report["counts"]
    # the decode steps write and read through the ring builds, never the plain ones
    assert counts.get("qk_norm_rope_kv_ring", 0) > 0 and counts.get("attn_decode_128_g2_ring", 0) > 0
    assert "attn_decode_128_g2" not in counts and "qk_norm_rope_kv" not in counts
    assert report["table_matches"] and report["host_pinned"]
    assert report["card_cells"] == [164] * 6 and report["host_cells"] == [512] * 6
    assert report["ends"] == [300, 304, 201]      # prompt, two steps (1 + 3 rows), a rollback
    # qwen3next: its attention layers through next_attention.cuh's ring builds, a linear layer's
    # slots of the host copies left 0; moved back to a checkpoint, the next step refills the ring
    nxt = report["qwen3next"]
    assert nxt["graph"] == "NextDecodeGraph" and nxt["attention_layers"] == [3, 7]
    assert nxt["table_matches"] and nxt["ends"] == [300, 304, 257]
    assert counts.get("next_qk_norm_rope_kv_ring", 0) > 0 and counts.get("attn_decode_256_g2_ring", 0) > 0
    assert "attn_decode_256_g2" not in counts and "next_qk_norm_rope_kv" not in counts
    # a rank's Stage takes the same ring (its own check agrees with the launcher's)
    assert report["stage"] == {"graph": "DecodeGraph", "store": "RingKV", "card": "ndarray",
                               "end": 202}


def test_the_q8_0_decode_graph_reads_the_ring_and_the_host_copy():
    """The same with --kv-type q8_0: the card's sinks + ring and the mapped host copy each hold
    int8 values and f16 scales; the table holds the card's values, the RoPE tables, the card's
    scales, the host values' and then the host scales' addresses, then (S, R)
    (kernels/attention.cuh KV_HOST_BASE); the decode steps launch the `_q8_ring` builds only."""
    report = run_check("kv_resident_abi_check.py", NVCC, "q8_0", timeout=540)
    assert report["errors"] == [] and report["graph"] == "DecodeGraph"
    counts = report["counts"]
    assert counts.get("qk_norm_rope_kv_q8_ring", 0) > 0
    assert counts.get("attn_decode_128_g2_q8_ring", 0) > 0
    assert not {"attn_decode_128_g2_q8", "attn_decode_128_g2_ring", "qk_norm_rope_kv_q8",
                "qk_norm_rope_kv_ring", "qk_norm_rope_kv"} & set(counts)
    n_layers = 3
    assert report["table_matches"] and report["host_pinned"]
    assert report["table_words"] == 8 * n_layers + 3
    assert report["card_cells"] == [164] * 6 and report["host_cells"] == [512] * 6
    assert report["ends"] == [300, 304, 201]
    nxt = report["qwen3next"]
    assert nxt["graph"] == "NextDecodeGraph" and nxt["attention_layers"] == [3, 7]
    assert nxt["table_matches"] and nxt["ends"] == [300, 304, 257]
    assert counts.get("next_qk_norm_rope_kv_q8_ring", 0) > 0
    assert counts.get("attn_decode_256_g2_q8_ring", 0) > 0
    # a rank's Stage with q8_0 and a ring: refused there until 2026-12-06 though the launcher
    # passed it (every GPU rank failed to load)
    assert report["stage"] == {"graph": "DecodeGraph", "store": "RingKV", "card": "Q8Rows",
                               "end": 202}
    assert not {"attn_decode_256_g2_q8", "attn_decode_256_g2_ring", "next_qk_norm_rope_kv_q8",
                "next_qk_norm_rope_kv_ring", "next_qk_norm_rope_kv"} & set(counts)
