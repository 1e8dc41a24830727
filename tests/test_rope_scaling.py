"""RoPE scaling from the file (`<arch>.rope.scaling.*`) against transformers, the reference nobody
here wrote: the yarn frequencies and cos/sin scale of `ROPE_INIT_FUNCTIONS["yarn"]` for the Qwen3
128K recipe (factor 4 over 32,768), the session's tables at positions 0, 1,000 and 100,000, a whole
tiny qwen3moe forward with yarn against Qwen3MoeForCausalLM with the same rope_parameters, and the
file keys written by the synth and refused when this code does not compute them."""
import numpy as np
import pytest
from gguf import GGUFValueType
from transformers import Qwen3MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hf_fixtures import hf_logits, rope_scaled_twin, tiny_qwen3moe, write_gguf
from strata_dist.gguf_file.reader import GGUFError, GGUFModel, RopeScaling
from strata_dist.models import qwen3moe
from strata_dist.models.common import rope_inv_freq, rope_tables
from strata_dist.tools.single_process import SingleProcessRunner

S, F32 = GGUFValueType.STRING, GGUFValueType.FLOAT32
U32 = GGUFValueType.UINT32


def hf_yarn(head_dim: int, base: float, factor: float, original: int, **extra):
    """transformers' yarn (inv_freq as float64, attention factor) for a Qwen3MoeConfig."""
    cfg = Qwen3MoeConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=int(factor * original),
                         rope_parameters={"rope_type": "yarn", "rope_theta": base,
                                          "factor": factor,
                                          "original_max_position_embeddings": original, **extra})
    inv, attention = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    return inv.double().numpy(), float(attention)


QWEN3_128K = dict(head_dim=128, base=1e6, factor=4.0, original=32768)


def test_yarn_frequencies_and_scale_match_transformers():
    ref_inv, ref_scale = hf_yarn(**QWEN3_128K)
    inv, scale = rope_inv_freq(128, 1e6, RopeScaling("yarn", 4.0, 32768))
    plain, _ = rope_inv_freq(128, 1e6)
    # the reference computes in float32: agreement to its precision
    np.testing.assert_allclose(inv, ref_inv, rtol=5e-7, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12) and scale == pytest.approx(1 + 0.1 * np.log(4))
    # not the plain table: the slow pairs are divided by 4, the fast ones kept
    assert inv[0] == plain[0] and inv[-1] == pytest.approx(plain[-1] / 4, rel=1e-12)


@pytest.mark.parametrize("beta_fast,beta_slow", [(32, 1), (16, 2)])
def test_yarn_betas_from_the_file_match_transformers(beta_fast, beta_slow):
    ref_inv, ref_scale = hf_yarn(64, 1e4, 8.0, 4096, beta_fast=beta_fast, beta_slow=beta_slow)
    inv, scale = rope_inv_freq(64, 1e4, RopeScaling("yarn", 8.0, 4096, beta_fast=beta_fast,
                                                    beta_slow=beta_slow))
    np.testing.assert_allclose(inv, ref_inv, rtol=5e-7, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_session_tables_at_depth_match_transformers(tmp_path):
    """The tables every backend rotates by (the GPU kernels read them from the session), built
    from a file with the yarn keys, at positions 0, 1,000 and 100,000: cos/sin of the reference's
    frequencies times its scale, within what its float32 frequencies leave of an angle."""
    from strata_dist.synth import SynthGeometry, write_synthetic
    geo = SynthGeometry("wide-rope", n_layer=1, n_embd=256, n_head=2, n_head_kv=1, head_dim=128,
                        n_expert=4, n_expert_used=2, n_ff_exp=32, n_vocab=512, rope_base=1e6)
    path = tmp_path / "yarn.gguf"
    write_synthetic(path, like=geo, quant="f32", rope_scaling="yarn:4:32768")
    g = qwen3moe.read_geometry(GGUFModel(path))
    assert g.rope_scaling == RopeScaling("yarn", 4.0, 32768, stretched_context=131072)
    assert g.context_length == g.trained_context == 131072
    positions = np.array([0, 1000, 100000])
    cos, sin = rope_tables(positions, g.head_dim, g.rope_base, g.rope_scaling)
    ref_inv, ref_scale = hf_yarn(**QWEN3_128K)
    angle = positions[:, None].astype(np.float64) * ref_inv[None, :]
    tol = angle * 2.0 ** -23 * 4 + 1e-6    # a few float32 ulps of each reference frequency
    assert (np.abs(cos - ref_scale * np.cos(angle)) <= tol).all()
    assert (np.abs(sin - ref_scale * np.sin(angle)) <= tol).all()
    assert np.abs(cos[0] - ref_scale).max() <= 1e-6   # position 0: the scale alone


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_tiny_forward_with_scaling_matches_transformers(tmp_path, kind):
    """A 300-token prefill and decode past it on a file whose original context is 256 (so yarn's
    ramp spans the head: pair 0 kept, 1..3 mixed, 4..7 divided), logits against transformers."""
    base = tiny_qwen3moe(11, hidden=64, top_k=2)
    params = {"rope_type": kind, "rope_theta": 10000.0, "factor": 4.0}
    keys = {"rope.scaling.type": (kind, S), "rope.scaling.factor": (4.0, F32)}
    if kind == "yarn":
        params["original_max_position_embeddings"] = 256
        keys["rope.scaling.original_context_length"] = (256, U32)
    hf = rope_scaled_twin(base, params)
    path = write_gguf(hf, tmp_path / f"{kind}.gguf", "f32", metadata=keys)
    ids = [int(x) for x in np.random.default_rng(11).integers(0, 320, 300)]
    ref = hf_logits(hf, ids)
    eng = SingleProcessRunner(path, prompt_chunk=128)
    eng.session.reset()
    ours = np.concatenate([eng.feed(ids[:290])] + [eng.feed([t]) for t in ids[290:]])
    assert np.abs(ours - ref).max() <= 1e-4
    # the scaling matters here: the plain-RoPE model gives other logits
    assert np.abs(hf_logits(base, ids) - ref).max() > 1e-2


@pytest.mark.parametrize("key,value,vtype,needle", [
    ("rope.scaling.type", "longrope", S, "'longrope'"),
    ("rope.scaling.factor", float("nan"), F32, "rope.scaling.factor"),
    ("rope.scaling.factor", -2.0, F32, "rope.scaling.factor"),
    ("rope.scaling.original_context_length", 0, U32, "original_context_length"),
    ("rope.scaling.yarn_beta_slow", 64.0, F32, "yarn_beta_slow"),
    ("rope.scaling.yarn_ext_factor", 2.0, F32, "yarn_ext_factor"),
])
def test_scaling_keys_that_cannot_be_computed_are_refused_naming_the_key(tmp_path, key, value,
                                                                         vtype, needle):
    hf = tiny_qwen3moe(12, hidden=64, top_k=2, n_layers=1)
    keys = {"rope.scaling.type": ("yarn", S), key: (value, vtype)}
    path = write_gguf(hf, tmp_path / "bad.gguf", "f32", metadata=keys)
    with pytest.raises(GGUFError) as e:
        qwen3moe.read_geometry(GGUFModel(path))
    assert needle in str(e.value) and str(path) in str(e.value)


def test_a_plain_file_keeps_plain_rope(tmp_path):
    hf = tiny_qwen3moe(13, hidden=64, top_k=2, n_layers=1)
    g = qwen3moe.read_geometry(GGUFModel(write_gguf(hf, tmp_path / "p.gguf", "f32")))
    assert g.rope_scaling.kind == "none" and g.trained_context == g.context_length == 4096
    inv, scale = rope_inv_freq(16, 10000.0, g.rope_scaling)
    np.testing.assert_allclose(inv, 10000.0 ** (-np.arange(0, 16, 2) / 16), rtol=1e-15)
    assert scale == 1.0


@pytest.mark.parametrize("spec", ["yarn:4", "yarn:x:32768", "linear:0.5", "yarn:4:0", "ntk:2"])
def test_synth_refuses_a_rope_scaling_it_cannot_write_in_one_line(tmp_path, spec):
    import subprocess
    import sys
    out = tmp_path / "x.gguf"
    proc = subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", "synth", str(out), "--quiet",
                           "--rope-scaling", spec], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(
        f"error: --rope-scaling '{spec}': "), proc.stderr
