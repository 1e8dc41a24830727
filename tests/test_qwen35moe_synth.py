"""strata_dist.synth: synthetic qwen35moe GGUFs (tiny-qwen35 written and run through the CLI; the
Qwen3.5-35B-A3B geometry checked against transformers' own config defaults and the architecture's
tensor table without writing 60 GiB)."""
import math

import numpy as np
import pytest
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

from launcher.tools import main as tools_main
from strata_dist.models.shape import model_shape
from strata_dist.models import open_checked, qwen35moe
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.synth import parse_popularity, reserved_width, write_synthetic
from strata_dist.synth.next import NEXT_GEOMETRIES, plan_next


@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_k_m"])
def test_tiny_qwen35_from_the_cli_opens_runs_and_keeps_the_routing_law(tmp_path, quant):
    path = tmp_path / "t.gguf"
    assert tools_main(["synth", str(path), "--like", "tiny-qwen35", "--quant", quant,
                       "--popularity", "zipf:1.0", "--seed", "1", "--quiet"]) == 0
    gguf = open_checked(str(path))
    assert gguf.arch == "qwen35moe"
    assert gguf.metadata("qwen35moe.rope.dimension_sections") == [2, 1, 1, 0]
    assert gguf.metadata("qwen35moe.attention.recurrent_layers") == [True, True, True, False] * 2
    assert "blk.0.ssm_beta.weight" in gguf.tensors and "blk.0.ssm_ba.weight" not in gguf.tensors
    assert model_shape(gguf, "cpu").layer_kind == ("linear", "linear", "linear", "attention") * 2
    eng = SingleProcessRunner(str(path), max_context=512)
    counts = np.zeros((8, 8))
    eng.model.on_route = lambda layer, idx: np.add.at(counts[layer], np.asarray(idx).ravel(), 1)
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 512, 400)]
    h = eng.model.embed(ids)
    out = eng.model.forward_layers(h, eng.session)
    r = reserved_width(NEXT_GEOMETRIES["tiny-qwen35"], quant)
    assert np.array_equal(out[:, :r], h[:, :r])      # nothing writes the routers' slice
    target = 1 / np.arange(1, 9)
    target /= target.sum()
    share = np.sort(counts / counts.sum(1, keepdims=True), axis=1)[:, ::-1]
    assert np.abs(share - target).max() < 0.08
    assert len(eng.generate([1, 2, 3, 4], 4).tokens) == 4


def test_35b_geometry_is_transformers_and_matches_the_architecture_table(tmp_path):
    hf = Qwen3_5MoeTextConfig()            # its defaults are Qwen3.5-35B-A3B's
    g = NEXT_GEOMETRIES["qwen3.5-35b-a3b"]
    assert (g.n_layer, g.n_embd, g.n_head, g.n_head_kv, g.head_dim) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
        hf.head_dim)
    assert (g.n_expert, g.n_expert_used, g.n_ff_exp, g.n_ff_shexp, g.n_vocab) == (
        hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
        hf.shared_expert_intermediate_size, hf.vocab_size)
    assert (g.n_k_heads, g.n_v_heads, g.head_k_dim, g.head_v_dim, g.conv_kernel) == (
        hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
        hf.linear_value_head_dim, hf.linear_conv_kernel_dim)
    assert [g.is_linear(l) for l in range(g.n_layer)] == [
        t == "linear_attention" for t in hf.layer_types]
    n_rot = int(g.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert all(qwen35moe.text_pairs(list(g.rope_sections), n_rot // 2))
    tensors, _ = plan_next(g, "q8_0", parse_popularity("uniform"), 0)
    planned = {t.name: t.shape for t in tensors}
    # the reader's table, from the metadata of a file of this geometry with its tensors' infos
    geo = qwen35moe.NextGeometry(
        arch="qwen35moe", n_layers=40, n_embd=2048, n_vocab=248320, n_head=16, n_head_kv=2,
        head_dim=256, n_expert=256, n_expert_used=8, n_ff_exp=512, rms_eps=1e-6, rope_base=1e4,
        context_length=32768, tied_embeddings=False, n_rot=n_rot, full_attention_interval=4,
        ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=32,
        ssm_inner_size=4096, n_ff_shexp=512, norm_topk_prob=True, fused_qkvz=False)
    expected = dict(qwen35moe.model_level_shapes(geo))
    for layer in range(40):
        expected.update(qwen35moe.expected_shapes(geo, layer))
    assert planned == expected
    assert 34e9 < sum(math.prod(s) for s in planned.values()) < 36e9


def test_a_file_with_an_mtp_block_runs_its_stack(tmp_path):
    # the converter writes Qwen3.5's MTP block after the stack: flagged non-recurrent, unused here
    plain = write_synthetic(tmp_path / "p.gguf", "tiny-qwen35", quant="q8_0", seed=2)
    mtp = write_synthetic(tmp_path / "m.gguf", "tiny-qwen35", quant="q8_0", seed=2, mtp=True)
    gguf = open_checked(str(mtp.path))
    assert gguf.metadata("qwen35moe.attention.recurrent_layers") == [True, True, True, False] * 2 \
        + [False]
    prompt = [1, 2, 3, 4, 5]
    assert SingleProcessRunner(str(mtp.path)).generate(prompt, 6).tokens == \
        SingleProcessRunner(str(plain.path)).generate(prompt, 6).tokens
