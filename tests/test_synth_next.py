"""strata_dist.synth.next: synthetic qwen3next GGUFs (tiny-next written and run; the 80B geometry
checked against the architecture's own tensor table without writing 81 GiB)."""
import math

import numpy as np
import pytest

from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.models.shape import model_shape
from strata_dist.models import open_checked, qwen3next
from strata_dist.synth import parse_popularity, reserved_width, write_synthetic
from strata_dist.synth.next import NEXT_GEOMETRIES, plan_next


@pytest.mark.parametrize("quant", ["f32", "q8_0", "q3_k_m", "bf16"])
def test_tiny_next_opens_runs_and_keeps_the_routing_law(tmp_path, quant):
    s = write_synthetic(tmp_path / "tn.gguf", "tiny-next", quant=quant, popularity="zipf:1.0", seed=1)
    gguf = open_checked(str(s.path))
    assert gguf.arch == "qwen3next"
    shape = model_shape(gguf, "cpu")
    assert shape.layer_kind == ("linear", "linear", "linear", "attention") * 2
    eng = SingleProcessRunner(str(s.path), max_context=512)
    counts = np.zeros((8, 8))
    eng.model.on_route = lambda layer, idx: np.add.at(counts[layer], np.asarray(idx).ravel(), 1)
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 512, 400)]
    h = eng.model.embed(ids)
    out = eng.model.forward_layers(h, eng.session)
    r = reserved_width(NEXT_GEOMETRIES["tiny-next"], quant)
    assert np.array_equal(out[:, :r], h[:, :r])      # nothing writes the routers' slice
    target = 1 / np.arange(1, 9)
    target /= target.sum()
    share = np.sort(counts / counts.sum(1, keepdims=True), axis=1)[:, ::-1]
    assert np.abs(share - target).max() < 0.08       # every layer, GDN or attention
    assert len(eng.generate([1, 2, 3, 4], 4).tokens) == 4


def test_80b_geometry_matches_the_architecture_table():
    g = NEXT_GEOMETRIES["qwen3-next-80b-a3b"]
    tensors, _ = plan_next(g, "q8_0", parse_popularity("uniform"), 0)
    planned = {t.name: t.shape for t in tensors}
    geo = qwen3next.NextGeometry(
        arch="qwen3next", n_layers=48, n_embd=2048, n_vocab=151936, n_head=16, n_head_kv=2,
        head_dim=256, n_expert=512, n_expert_used=10, n_ff_exp=512, rms_eps=1e-6, rope_base=1e7,
        context_length=262144, tied_embeddings=False, n_rot=64, full_attention_interval=4,
        ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=32,
        ssm_inner_size=4096, n_ff_shexp=512, norm_topk_prob=True, fused_qkvz=False)
    expected = dict(qwen3next.model_level_shapes(geo))
    for layer in range(48):
        expected.update(qwen3next.expected_shapes(geo, layer))
    assert planned == expected
    assert 79e9 < sum(math.prod(s) for s in planned.values()) < 81e9
    assert sum(geo.is_linear(l) for l in range(48)) == 36
