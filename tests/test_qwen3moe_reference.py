"""The qwen3moe forward against transformers' Qwen3MoeForCausalLM (the reference nobody here
wrote): logits of a prefill, of incremental decode, and greedy generation."""
import numpy as np
import pytest
import torch

from hf_fixtures import hf_logits, load_gguf_weights_into, tiny_qwen3moe, write_gguf
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.gguf_file.reader import GGUFModel

CONFIGS = [  # (seed, hidden, top_k, n_experts)
    (0, 64, 2, 8),
    (1, 64, 8, 16),
    (2, 256, 2, 8),
    (3, 256, 8, 16),
]


def _ids(seed, n, vocab=320):
    return [int(x) for x in np.random.default_rng(seed).integers(0, vocab, n)]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"s{c[0]}-h{c[1]}-k{c[2]}")
def f32_model(request, tmp_path_factory):
    seed, hidden, top_k, n_experts = request.param
    hf = tiny_qwen3moe(seed, hidden=hidden, top_k=top_k, n_experts=n_experts)
    path = write_gguf(hf, tmp_path_factory.mktemp("m") / "f32.gguf", "f32")
    return hf, path, seed


def test_prefill_logits_match_f32(f32_model):
    hf, path, seed = f32_model
    ids = _ids(seed, 32)
    ours = SingleProcessRunner(path).logits(ids)
    ref = hf_logits(hf, ids)
    assert ours.shape == ref.shape == (32, 320)
    assert np.abs(ours - ref).max() <= 1e-4


def test_incremental_decode_logits_match_f32(f32_model):
    hf, path, seed = f32_model
    ids = _ids(seed + 100, 32 + 64)
    ref = hf_logits(hf, ids)
    eng = SingleProcessRunner(path, prompt_chunk=16)   # the 32-token prefill itself crosses a chunk boundary
    eng.session.reset()
    got = [eng.feed(ids[:32])]
    for t in ids[32:]:
        got.append(eng.feed([t]))
    ours = np.concatenate(got)
    assert np.abs(ours - ref).max() <= 1e-4


def test_greedy_tokens_equal_transformers_generate(f32_model):
    hf, path, seed = f32_model
    prompt = _ids(seed + 200, 12)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = out[0, len(prompt):].tolist()
    assert SingleProcessRunner(path).generate(prompt, 32).tokens == ref


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_quantized_files_match_reference_on_same_weights(tmp_path, dtype):
    hf = tiny_qwen3moe(7, hidden=64, top_k=2)
    path = write_gguf(hf, tmp_path / f"{dtype}.gguf", dtype)
    load_gguf_weights_into(hf, GGUFModel(path))   # the reference runs the file's own weights
    ids = _ids(7, 32)
    ours = SingleProcessRunner(path).logits(ids)
    assert np.abs(ours - hf_logits(hf, ids)).max() <= 1e-3


def test_tied_embeddings(tmp_path):
    hf = tiny_qwen3moe(9, hidden=64, top_k=2, tied=True)
    path = write_gguf(hf, tmp_path / "tied.gguf", "f32")
    assert "output.weight" not in GGUFModel(path).tensors
    ids = _ids(9, 20)
    assert np.abs(SingleProcessRunner(path).logits(ids) - hf_logits(hf, ids)).max() <= 1e-4


def test_prompt_chunk_size_does_not_change_greedy_tokens(f32_model):
    _, path, seed = f32_model
    prompt = _ids(seed + 300, 40)
    a = SingleProcessRunner(path, prompt_chunk=7).generate(prompt, 16).tokens
    b = SingleProcessRunner(path, prompt_chunk=512).generate(prompt, 16).tokens
    assert a == b
