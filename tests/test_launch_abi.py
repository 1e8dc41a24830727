"""The GPU path's kernel launches against the kernels' C signatures, on a machine without a GPU
(tests/launch_abi_check.py: the backend's Python on numpy stand-ins for CuPy, every launch's
arguments, scalar types and limits checked; nothing numeric, which the GPU tests own). A
qwen3moe file of each dense type with f16 and q8_0 K/V and with the array prompt steps (and the
Q8_0 one routed on the host and on the general path), a q5_k_m file with (the default) and
without the integer path of its Q5_K / Q6_K experts, iq4_xs / iq3_s / iq2_xxs files with their
integer path (the default; and iq4_xs without), and a qwen3next file with the kernels'
head geometry (and with the blocked delta rule, and with q8_0 K/V); q8_0 K/V with --kv-resident
below the context on both architectures (the ring builds): prompt, one-row and three-row decode steps, a
generation with steps launched ahead; and a stage caching half its pairs, its prompt on a loan
streaming the rest from pinned host memory, its decode graph reading them there. Skips where
nvcc is not installed."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stand_ins import run_check

NVCC = shutil.which("nvcc")
HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.skipif(NVCC is None, reason="nvcc is not installed"),
              pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def report():
    return run_check("launch_abi_check.py", NVCC, timeout=540)


def test_every_launch_matches_its_kernel(report):
    assert report["errors"] == []


def test_each_architecture_takes_its_decode_graph_and_prompt_kernels(report):
    graphs, runs = report["graphs"], report["scenarios"]
    assert graphs["qwen3moe q8_0"] == graphs["qwen3moe f16"] == "DecodeGraph"
    assert graphs["qwen3next q8_0"] == "NextDecodeGraph"
    moe, nxt = runs["qwen3moe f16"], runs["qwen3next q8_0"]
    # a Q8_0 file's dense matrices: decoded to f16 for the prompt's tensor-core GEMMs
    assert runs["qwen3moe q8_0"].get("dequant_rows_f16", 0) > 0 and "dequant_rows_f16" not in moe
    for kernel in ("rms_norm_rows", "qk_norm_rope_kv", "prefill_attention_128", "combine_ranked",
                   "route_rows", "moe_gate_up_rows_mma_f16", "attn_decode_128_g2", "argmax_row"):
        assert moe.get(kernel, 0) > 0, kernel
    for kernel in ("gdn_conv_step", "gdn_delta_step", "next_qk_norm_rope_kv",
                   "prefill_attention_256", "attn_decode_256_g2", "next_attn_gate",
                   "next_shexp_act", "combine_ranked", "embed_tokens"):
        assert nxt.get(kernel, 0) > 0, kernel
    # q8_0 K/V: the decode graph's q8 builds; the prompt's attention and q/k steps take the array
    # path (their kernels read f16); with the array prompt steps, none of the prompt's kernels
    # (the decode graph keeps its own qk_norm_rope_kv)
    assert runs["qwen3moe f16, q8_0 K/V"].get("attn_decode_128_g2_q8", 0) > 0
    assert "prefill_attention_128" not in runs["qwen3moe f16, q8_0 K/V"]
    # qwen3next with q8_0 K/V: its decode graph (not the general path) through the 256-wide q8
    # builds; with --kv-resident, both architectures' `_q8_ring` builds and no other
    next_q8 = runs["qwen3next q8_0, q8_0 K/V"]
    assert graphs["qwen3next q8_0, q8_0 K/V"] == "NextDecodeGraph"
    assert next_q8.get("next_qk_norm_rope_kv_q8", 0) > 0
    assert next_q8.get("attn_decode_256_g2_q8", 0) > 0
    assert not {"next_qk_norm_rope_kv", "attn_decode_256_g2", "prefill_attention_256"} & set(next_q8)
    for name, arch_kernels in (("qwen3next q8_0, q8_0 K/V, kv-resident",
                                ("next_qk_norm_rope_kv_q8_ring", "attn_decode_256_g2_q8_ring")),
                               ("qwen3moe f16, q8_0 K/V, kv-resident",
                                ("qk_norm_rope_kv_q8_ring", "attn_decode_128_g2_q8_ring"))):
        assert graphs[name] in ("DecodeGraph", "NextDecodeGraph"), (name, graphs[name])
        ring = runs[name]
        assert all(ring.get(k, 0) > 0 for k in arch_kernels), (name, ring)
        plain = {k[:-len("_ring")] for k in arch_kernels} | {k[:-len("_q8_ring")] + "_ring"
                                                             for k in arch_kernels}
        assert not plain & set(ring), (name, plain & set(ring))
    off = runs["qwen3moe f16, array prompt steps"]
    assert not {"rms_norm_rows", "combine_ranked"} & set(off)
    assert off["qk_norm_rope_kv"] < moe["qk_norm_rope_kv"]
    # the switches' other paths: routed on the host (the row kernels still), the general path
    # (no row kernel, no flash attention)
    assert "route_rows" not in runs["qwen3moe q8_0, routed on the host"]
    assert runs["qwen3moe q8_0, routed on the host"].get("moe_gate_up_rows_mma_q8_0", 0) > 0
    general = runs["qwen3moe q8_0, the general path"]
    assert not any(k.startswith(("moe_gate_up_rows", "prefill_attention")) for k in general)
    # qwen3next's prompt chunks: gdn_prompt.cu's row kernels by default; the token loop of the
    # decode graph's kernels (STRATA_GDN_KERNELS=steps); the blocked delta rule (=0: no GDN
    # kernel in the prompt; its decode graph keeps its own)
    from strata_dist.kernels.abi import GDN_ROWS_KERNELS as prompt_gdn
    assert {k for k in prompt_gdn if nxt.get(k, 0) > 0} == set(prompt_gdn)
    blocked = runs["qwen3next q8_0, blocked delta rule"]
    steps = runs["qwen3next q8_0, GDN token loop"]
    assert not set(prompt_gdn) & (set(blocked) | set(steps))
    assert 0 < blocked["gdn_delta_step"] == nxt["gdn_delta_step"] < steps["gdn_delta_step"]
    # a stage streaming its misses: the decode graph reads them in place (host-mapped)
    name = "qwen3moe stage, half cached, loan, host-mapped misses"
    assert graphs[name] == "DecodeGraph" and runs[name].get("moe_down_q8_0", 0) > 0
    # a batched step through two stages' graphs: every row's logits, no greedy token
    batch = runs["qwen3moe stages, a batched step of ten sessions"]
    assert batch.get("attn_decode_128_g2", 0) > 0 and "argmax_row" not in batch


class _Recording:
    """Ops that record which op a `layer_step` calls, in order."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def op(layer, *args):
            self.calls.append(name)
            return (None, None, None) if name in ("norm_qkv", "norm_mix_in") else None
        return op


def _op_groups(launches: list[str]) -> list[tuple[str, list[str]]]:
    """A recorded step's launches from its first op marker on, each under the op that made it."""
    groups = []
    for x in launches[next(i for i, x in enumerate(launches) if x.startswith("op:")):]:
        if x.startswith("op:"):
            groups.append((x[3:], []))
        else:
            groups[-1][1].append(x)
    return groups


def test_the_decode_graph_captures_the_models_layer_step(report):
    """A one-row decode step's capture on each qwen3moe file (tests/launch_abi_check.py marks the
    graph ops before their launches): between the embedding and the output head, layer after
    layer, the ops of models/qwen3moe.py `layer_step` in the order it calls them (the layer
    sequence is the model module's, written once), each op its own kernels
    (backends/graph_ops.py): 7 launches a layer where q, k and v share a type."""
    from strata_dist.models import qwen3moe
    rec = _Recording()
    qwen3moe.layer_step(rec, None, 0, None)
    kernels = {"norm_qkv": None, "attention": ("qk_norm_rope_kv", "attn_decode_128_g"),
               "add_out_projection": None, "route": ("matvec_f32_1",),
               "add_experts": ("moe_gate_up_", "moe_down_")}        # None: matvec launches
    checked = 0
    for name, graph in report["graphs"].items():
        launches = report["step_launches"].get(name)
        if graph != "DecodeGraph" or launches is None:
            continue
        checked += 1
        experts = len(kernels["add_experts"])
        assert launches[:2] == ["embed_tokens", "op:norm_qkv"], (name, launches[:2])
        ops = [x[3:] for x in launches if x.startswith("op:")]
        # every layer of the graph's range, each the model's sequence (none dropped)
        assert ops == rec.calls * len(report["step_layers"][name]), (name, ops)
        groups = _op_groups(launches)
        last_op, tail = groups[-1]
        groups[-1] = (last_op, tail[:experts])
        head = tail[experts:]              # the output head's matvec and the greedy argmax
        assert len(head) >= 2 and head[-1] == "argmax_row" and all(
            k.startswith("matvec_") and k.endswith("_1") for k in head[:-1]), (name, head)
        for op, got in groups:
            want = kernels[op]
            if want is None:
                assert got and all(k.startswith("matvec_") and k.endswith("_1") for k in got), \
                    (name, op, got)
            else:
                assert len(got) == len(want) and all(
                    k.startswith(w) for k, w in zip(got, want)), (name, op, got)
    assert checked >= 10, checked


def test_the_next_decode_graph_captures_the_models_layer_step(report):
    """The same for qwen3next's graph (backends/graph_ops.py NextGraphOps): each layer is the ops
    of models/qwen3next.py `layer_step` for a linear layer or for an attention layer, both kinds
    present; each op launches its own kernels besides its matvecs (the output head's argmax
    after the last layer's MoE)."""
    from strata_dist.models import qwen3next
    kinds = []
    for linear in (True, False):
        rec = _Recording()
        qwen3next.layer_step(rec, type("G", (), {"is_linear": lambda self, l: linear})(), 0, None)
        kinds.append(rec.calls)
    # each op's launches other than matvecs (prefixes); None: matvecs only, at least one
    kernels = {"norm_mix_in": None, "gated_delta": ("gdn_conv_step", "gdn_delta_step"),
               "add_mix_out": None, "norm_qkv": None,
               "attention": ("next_qk_norm_rope_kv", "attn_decode_256_g", "next_attn_gate"),
               "add_out_projection": None, "route": None,
               "add_moe": ("moe_gate_up_", "moe_down_", "next_shexp_act")}
    checked = 0
    for name, graph in report["graphs"].items():
        launches = report["step_launches"].get(name)
        if graph != "NextDecodeGraph" or launches is None:
            continue
        checked += 1
        ops = [x[3:] for x in launches if x.startswith("op:")]
        # layer after layer of the graph's range, each the sequence of its own kind
        layers = report["step_layers"][name]
        assert ops == [op for linear in layers for op in kinds[0 if linear else 1]], (name, ops)
        assert set(layers) == {True, False}, (name, layers)
        assert launches[0] == "embed_tokens" and launches[1].startswith("op:"), name
        groups = _op_groups(launches)
        for i, (op, got) in enumerate(groups):
            other = [k for k in got if not k.startswith("matvec_")]
            want = list(kernels[op] or ()) + (["argmax_row"] if i == len(groups) - 1 else [])
            assert len(other) == len(want) and all(k.startswith(w) for k, w in zip(other, want)), \
                (name, op, got)
            assert kernels[op] is not None or len(got) > len(other), (name, op, got)
    # the qwen3next scenarios: the GDN kernels' three paths, q8_0 K/V, q8_0 K/V with a ring
    assert checked == 5, checked


def test_the_integer_switches_size_the_k_quant_expert_grids(report):
    """A q5_k_m file (Q5_K gate/up, Q5_K and Q6_K down; 256 columns each way) in the default
    build: its expert launches take the integer path's grids (16 gate/up rows and 8 outputs a
    block: kernels/abi.py KernelShape); with STRATA_KERNEL_SHAPE=int_q5_k=0,int_q6_k=0 the float
    path's (4 and 4), both through the decode graph."""
    from strata_dist.kernels.abi import Q5_K, Q6_K, KernelShape
    name = "qwen3moe q5_k_m, int_q5_k=0,int_q6_k=0"
    assert report["graphs"][name] == report["graphs"]["qwen3moe q5_k_m"] == "DecodeGraph"
    on, off = KernelShape(), KernelShape.parse("int_q5_k=0,int_q6_k=0")
    for grids, shape in ((report["grids"]["qwen3moe q5_k_m"], on), (report["grids"][name], off)):
        assert grids["moe_gate_up_q5_k"] == [256 // shape.gate_up_block(Q5_K)]
        assert grids["moe_down_q5_k"] == [256 // shape.down_block(Q5_K)]
        assert grids["moe_down_q6_k"] == [256 // shape.down_block(Q6_K)]
    assert report["grids"]["qwen3moe q5_k_m"]["moe_gate_up_q5_k"] == [16]
    assert report["grids"][name]["moe_gate_up_q5_k"] == [64]


def test_the_integer_switches_size_the_i_quant_expert_grids(report):
    """Files whose experts are all IQ4_XS, IQ3_S or IQ2_XXS (256 rows of 512 columns gate/up, 512
    of 256 down) in the default build: their expert launches take the integer path's grids (16
    gate/up rows and 8 outputs a block); the IQ4_XS file's with
    STRATA_KERNEL_SHAPE=int_iq4_xs=0,int_iq3_s=0,int_iq2_xxs=0 the float path's (4 and 4), all
    through the decode graph."""
    from strata_dist.kernels.abi import IQ2_XXS, IQ3_S, IQ4_XS, KernelShape
    shape = KernelShape()
    for quant, t in (("iq4_xs", IQ4_XS), ("iq3_s", IQ3_S), ("iq2_xxs", IQ2_XXS)):
        name = f"qwen3moe {quant}"
        assert report["graphs"][name] == "DecodeGraph", name
        grids = report["grids"][name]
        assert grids[f"moe_gate_up_{quant}"] == [256 // shape.gate_up_block(t)] == [16], name
        assert grids[f"moe_down_{quant}"] == [512 // shape.down_block(t)] == [64], name
    off = "qwen3moe iq4_xs, int_iq4_xs=0,int_iq3_s=0,int_iq2_xxs=0"
    assert report["graphs"][off] == "DecodeGraph"
    assert report["grids"][off]["moe_gate_up_iq4_xs"] == [64]
    assert report["grids"][off]["moe_down_iq4_xs"] == [128]


def test_the_check_catches_a_wrong_launch(tmp_path):
    """A launch one argument short and one with a Python int for an `int` are reported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE / "fake_cupy"), str(HERE.parent), str(HERE)]))
    code = (
        "import collections, sys, numpy as np, cupy as cp\n"
        "import launch_abi_check as c\n"
        "counts, errors = collections.Counter(), []\n"
        "c.install(sys.argv[1], counts, errors)\n"
        "import strata_dist.kernels as k\n"
        "f = k.function('prompt_ops.cu', 'rms_norm_rows')\n"
        "x = cp.zeros((2, 64), cp.float32)\n"
        "f((2,), (256,), (x, x, np.int32(64), np.float32(1e-6)))\n"
        "f((2,), (256,), (x, x, 64, np.float32(1e-6), x))\n"
        "print(len(errors)); print(errors)\n")
    done = subprocess.run([sys.executable, "-c", code, NVCC], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    n, said = done.stdout.splitlines()[:2]
    assert n == "2" and "4 arguments for 5 parameters" in said and "got int, not int32" in said
