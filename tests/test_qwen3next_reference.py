"""The qwen3next forward against transformers' Qwen3NextForCausalLM (the reference nobody here
wrote): prefill, chunked prefill, incremental decode, greedy generation; quantized files against
the same weights; stage splits (with stages that own no attention layer) byte-identical to the
whole model; session carve == priced, per part."""
import numpy as np
import pytest
import torch

from hf_next_fixtures import hf_logits, load_gguf_weights_into, tiny_qwen3next, write_gguf
from strata_dist.backends import get_backend
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.gguf_file.reader import GGUFModel, TensorKind
from strata_dist.models.shape import model_shape
from strata_dist.models import load_model
from strata_dist.models.qwen3next import RecurrentRewindError
from strata_dist.plan.pricing import session_bytes, session_parts, weights_bytes
from strata_dist.rank.stage import Stage, StageConfig

TOL = 1e-4
VOCAB = 320
CONFIGS = [  # (seed, hidden, top_k, n_experts, linear heads (k, v))
    (0, 64, 2, 8, (2, 4)),
    (1, 128, 8, 16, (2, 4)),
    (2, 64, 2, 8, (2, 2)),
]
KINDS_8 = ("linear", "linear", "linear", "attention") * 2


def _ids(seed, n):
    return [int(x) for x in np.random.default_rng(seed).integers(0, VOCAB, n)]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"s{c[0]}-h{c[1]}-k{c[2]}-v{c[4][1]}")
def f32_model(request, tmp_path_factory):
    seed, hidden, top_k, n_experts, (nk, nv) = request.param
    hf = tiny_qwen3next(seed, hidden=hidden, top_k=top_k, n_experts=n_experts,
                        n_k_heads=nk, n_v_heads=nv)
    path = write_gguf(hf, tmp_path_factory.mktemp("next") / "f32.gguf", "f32")
    return hf, path, seed


def test_prefill_logits_match_f32(f32_model):
    hf, path, seed = f32_model
    ids = _ids(seed, 32)
    ours = SingleProcessRunner(path).logits(ids)
    ref = hf_logits(hf, ids)
    assert ours.shape == ref.shape == (32, VOCAB)
    assert ref.std() > 0.5                      # far from uniform: a wrong forward shows
    assert np.abs(ours - ref).max() <= TOL


def test_chunked_prefill_carries_the_recurrence(f32_model):
    hf, path, seed = f32_model
    ids = _ids(seed + 50, 32)
    ours = SingleProcessRunner(path, prompt_chunk=7).logits(ids)   # 7+7+7+7+4: conv and delta state cross chunks
    assert np.abs(ours - hf_logits(hf, ids)).max() <= TOL


def test_incremental_decode_logits_match_f32(f32_model):
    hf, path, seed = f32_model
    ids = _ids(seed + 100, 32 + 64)
    ref = hf_logits(hf, ids)
    eng = SingleProcessRunner(path, prompt_chunk=16)
    eng.session.reset()
    got = [eng.feed(ids[:32])]
    for t in ids[32:]:
        got.append(eng.feed([t]))
    assert np.abs(np.concatenate(got) - ref).max() <= TOL


def test_greedy_tokens_equal_transformers_generate(f32_model):
    hf, path, seed = f32_model
    prompt = _ids(seed + 200, 12)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = out[0, len(prompt):].tolist()
    assert SingleProcessRunner(path, prompt_chunk=5).generate(prompt, 16).tokens == ref


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_quantized_files_match_reference_on_same_weights(tmp_path, dtype):
    """The numpy backend dequantizes every stored type to float32 exactly, so against the file's
    own weights (copied back into the reference) the only difference left is float32 rounding:
    the same tolerance as F32 holds."""
    hf = tiny_qwen3next(7, hidden=64, top_k=2)
    path = write_gguf(hf, tmp_path / f"{dtype}.gguf", dtype)
    ids = _ids(7, 32)
    before = hf_logits(hf, ids)
    load_gguf_weights_into(hf, GGUFModel(path))
    ref = hf_logits(hf, ids)
    assert np.abs(ref - before).max() > 10 * TOL      # the weights really were rounded
    assert np.abs(SingleProcessRunner(path).logits(ids) - ref).max() <= TOL


def test_legacy_fused_ssm_in_file(tmp_path):
    """Older GGUFs hold HF's in_proj_qkvz unsplit as blk.N.ssm_in; it loads and gives the same
    logits."""
    hf = tiny_qwen3next(3, hidden=64, top_k=2)
    path = write_gguf(hf, tmp_path / "legacy.gguf", legacy=True)
    gguf = GGUFModel(path)
    assert "blk.0.ssm_in.weight" in gguf.tensors and "blk.0.attn_qkv.weight" not in gguf.tensors
    ids = _ids(3, 24)
    assert np.abs(SingleProcessRunner(path, prompt_chunk=5).logits(ids) - hf_logits(hf, ids)).max() <= TOL


def test_tied_embeddings(tmp_path):
    hf = tiny_qwen3next(9, hidden=64, top_k=2, tied=True)
    path = write_gguf(hf, tmp_path / "tied.gguf")
    assert "output.weight" not in GGUFModel(path).tensors
    ids = _ids(9, 20)
    assert np.abs(SingleProcessRunner(path).logits(ids) - hf_logits(hf, ids)).max() <= TOL


# ---- the carve -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def carve_model(tmp_path_factory):
    return write_gguf(tiny_qwen3next(4, hidden=64, top_k=2), tmp_path_factory.mktemp("carve") / "m.gguf")


def _run_split(path, bounds, prompt, chunk, n_decode):
    """Greedy run over a pipeline of stage objects [lb, le), each with its own model and session:
    logits of every prompt chunk's rows and of every decode step, and the tokens."""
    be = get_backend("cpu")
    gguf = GGUFModel(path)
    stages = [(m := load_model(gguf, be, lb, le), m.new_session(128)) for lb, le in bounds]
    logits, tokens = [], []

    def step(ids):
        h = stages[0][0].embed(ids)
        for m, s in stages:
            h = m.forward_layers(h, s)
        for _, s in stages:
            s.n_past += len(ids)
        return stages[-1][0].output_logits(h)

    for start in range(0, len(prompt), chunk):
        logits.append(step(prompt[start:start + chunk]))
    for _ in range(n_decode):
        tokens.append(int(np.argmax(logits[-1][-1])))
        logits.append(step([tokens[-1]]))
    return np.concatenate(logits), tokens


@pytest.mark.parametrize("bounds", [
    [(0, 3), (3, 8)],                    # a first stage with no attention layer
    [(0, 4), (4, 8)],
    [(0, 2), (2, 5), (5, 8)],
    [(0, 3), (3, 4), (4, 7), (7, 8)],    # linear-only and attention-only stages
], ids=lambda b: "|".join(f"{lb}-{le}" for lb, le in b))
def test_stage_split_is_byte_identical(carve_model, bounds):
    prompt = _ids(11, 23)
    whole, whole_tokens = _run_split(carve_model, [(0, 8)], prompt, 7, 8)
    split, split_tokens = _run_split(carve_model, bounds, prompt, 7, 8)
    assert split_tokens == whole_tokens
    assert np.array_equal(split, whole)


@pytest.mark.parametrize("lb,le", [(0, 8), (0, 3), (4, 7), (3, 4), (2, 5), (5, 8), (7, 8), (1, 2)])
def test_session_and_weights_equal_priced(carve_model, lb, le):
    cells = 96
    shape = model_shape(GGUFModel(carve_model), "cpu")
    first, last = lb == 0, le == 8
    stage = Stage(StageConfig(carve_model, "cpu", lb, le, first, last, cells))
    s = stage.session(0)
    assert stage.weights_bytes == weights_bytes(shape, lb, le, first, last)
    assert stage.session_bytes() == session_bytes(shape, cells, lb, le)
    assert s.parts_nbytes() == session_parts(shape, cells, lb, le)
    if lb > 0:
        assert stage.weights_bytes < weights_bytes(shape, 0, le, True, last)
    # the primary state is carved even where the range has no attention layer
    n_rot = stage.model.g.n_rot
    assert s.rope_cos.shape == s.rope_sin.shape == (cells, n_rot // 2)
    has_attn = any(KINDS_8[l] == "attention" for l in range(lb, le))
    assert (s.scores is not None) == has_attn
    for layer in range(lb, le):   # global ordinals; each layer holds only its own kind of state
        if KINDS_8[layer] == "attention":
            assert s.k(layer).shape[0] == cells
            with pytest.raises(IndexError):
                s.recurrent_state(layer)
        else:
            assert s.conv_state(layer).shape[0] == 3 and s.recurrent_state(layer).ndim == 3
            with pytest.raises(IndexError):
                s.k(layer)
    with pytest.raises(IndexError):
        s.conv_state(le) if le < 8 and KINDS_8[le] == "linear" else s.k(le)
    if lb > 0:
        with pytest.raises(IndexError):
            s.v(lb - 1) if KINDS_8[lb - 1] == "attention" else s.recurrent_state(lb - 1)


def test_model_shape_is_hybrid(carve_model):
    gguf = GGUFModel(carve_model)
    shape = model_shape(gguf, "cpu")
    g = load_model(gguf, get_backend("cpu"), 0, 1).g
    assert shape.layer_kind == KINDS_8
    assert all((kv > 0) == (k == "attention") for kv, k in zip(shape.kv_bytes_per_cell, KINDS_8))
    assert all((r > 0) == (k == "linear") for r, k in zip(shape.recurrent_bytes, KINDS_8))
    conv = (g.ssm_conv_kernel - 1) * (2 * g.n_k_heads * g.head_k_dim + g.n_v_heads * g.head_v_dim)
    assert shape.recurrent_bytes[0] == 4 * (conv + g.n_v_heads * g.head_k_dim * g.head_v_dim)
    assert shape.rope_bytes_per_cell == 4 * g.n_rot
    # the shared expert and its gate are dense (priced with the layer), never experts or routers
    for part in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"):
        assert gguf.tensor(f"blk.0.{part}.weight").kind is TensorKind.DENSE
    assert gguf.tensor("blk.0.ssm_a").layer == 0 and gguf.tensor("blk.0.ssm_dt.bias").layer == 0
    shexp = sum(4 * int(np.prod(gguf.tensor(f"blk.0.{p}.weight").shape))
                for p in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"))
    router = 4 * g.n_expert * g.n_embd
    assert shape.router_bytes[0] == router
    assert shape.layer_dense_bytes[0] > shexp + router


def test_recurrent_session_refuses_to_rewind(carve_model):
    eng = SingleProcessRunner(carve_model, max_context=64)
    eng.logits(_ids(5, 10))
    s = eng.session
    assert s.n_past == 10 and float(np.abs(s.recurrent_state(0)).sum()) > 0
    s.reset(10)                                   # the current position: nothing moves
    with pytest.raises(RecurrentRewindError):
        s.reset(4)                                # the recurrence cannot go back without a checkpoint
    s.reset(0)                                    # a fresh conversation clears every state
    assert float(np.abs(s.recurrent_state(0)).sum()) == 0 and float(np.abs(s.conv_state(0)).sum()) == 0
    a = SingleProcessRunner(carve_model, max_context=64)
    assert np.array_equal(eng.logits(_ids(6, 9)), a.logits(_ids(6, 9)))
