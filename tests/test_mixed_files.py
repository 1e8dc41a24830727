"""Mixed files on the CPU: synthetic files of the common file types (a type per tensor: Q2_K..Q6_K
side by side in one layer, gate/up and down differing) run by the numpy forward against
transformers' Qwen3MoeForCausalLM on the file's own dequantized weights, and generate the same
tokens in one process and across two CPU ranks; the synth's shards generate the unsplit file's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_fixtures import hf_logits, load_gguf_weights_into
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.synth import SynthGeometry, write_synthetic

ROOT = Path(__file__).resolve().parents[1]
T = gguf.GGMLQuantizationType
# 256-wide rows: every K block fits, so each file type's own mix appears (16 experts: the
# eight-expert rules stay out).
MIXED = SynthGeometry("mixed", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=16,
                      n_expert_used=4, n_ff_exp=256, n_vocab=512, context_length=4096)
LAYER_2 = {  # the types of layer 2 (attn_q, attn_v, attn_output, gate/up, down) and of the output
    "q4_k_m": ((T.Q4_K, T.Q6_K, T.Q4_K, T.Q4_K, T.Q6_K), T.Q6_K),
    "q3_k_m": ((T.Q3_K, T.Q4_K, T.Q4_K, T.Q3_K, T.Q4_K), T.Q6_K),
    "q2_k": ((T.Q2_K, T.Q3_K, T.Q3_K, T.Q2_K, T.Q3_K), T.Q6_K),
}


def reference(g: SynthGeometry, path: str) -> Qwen3MoeForCausalLM:
    cfg = Qwen3MoeConfig(
        vocab_size=g.n_vocab, hidden_size=g.n_embd, intermediate_size=2 * g.n_embd,
        moe_intermediate_size=g.n_ff_exp, num_hidden_layers=g.n_layer, num_attention_heads=g.n_head,
        num_key_value_heads=g.n_head_kv, head_dim=g.head_dim, num_experts=g.n_expert,
        num_experts_per_tok=g.n_expert_used, norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=g.context_length, rms_norm_eps=g.rms_eps,
        rope_parameters={"rope_theta": g.rope_base, "rope_type": "default"}, attn_implementation="eager")
    return load_gguf_weights_into(Qwen3MoeForCausalLM(cfg).eval(), GGUFModel(path))


@pytest.fixture(scope="module", params=list(LAYER_2))
def mixed(request, tmp_path_factory):
    s = write_synthetic(tmp_path_factory.mktemp("mixed") / "m.gguf", MIXED, quant=request.param,
                        popularity="zipf:1.0", seed=11)
    return request.param, str(s.path)


def test_the_file_is_mixed_as_its_type_says(mixed):
    ftype, path = mixed
    ts = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    layer, out = LAYER_2[ftype]
    assert tuple(ts[f"blk.2.{k}.weight"] for k in ("attn_q", "attn_v", "attn_output", "ffn_up_exps",
                                                    "ffn_down_exps")) == layer
    assert ts["blk.2.ffn_gate_exps.weight"] == layer[3] and ts["output.weight"] == out


def test_prefill_logits_and_greedy_tokens_match_transformers(mixed):
    _, path = mixed
    hf = reference(MIXED, path)
    ids = [int(x) for x in np.random.default_rng(5).integers(0, MIXED.n_vocab, 24)]
    ours = SingleProcessRunner(path).logits(ids)
    ref = hf_logits(hf, ids)
    assert ref.std(axis=1).min() > 0.1                 # logits that say something
    assert np.abs(ours - ref).max() <= 1e-4
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids[:8]]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    assert SingleProcessRunner(path).generate(ids[:8], 12).tokens == out[0, 8:].tolist()


def _tokens(*cmd: str) -> list[int]:
    p = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, timeout=180,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    return [int(x) for x in p.stdout.strip().splitlines()[-1].split(",")]


def _single(path: str) -> list[int]:
    return _tokens("strata_dist.tools.cli", "generate", "--model", path, "--prompt-ids", "1,2,3", "--max-new", "4")


def _two_ranks(path: str) -> list[int]:
    return _tokens("launcher.cli", "--model", path, "--cpu-ranks", "2", "--layer-split", "1",
                   "--prompt-ids", "1,2,3", "--max-new", "4")


def test_one_process_and_two_cpu_ranks_generate_the_same_tokens(tmp_path):
    path = str(write_synthetic(tmp_path / "m.gguf", MIXED, quant="q3_k_m", seed=12).path)
    single = _single(path)
    assert len(single) == 4 and _two_ranks(path) == single


def test_the_synths_shards_generate_the_unsplit_files_tokens(tmp_path):
    whole = write_synthetic(tmp_path / "whole.gguf", MIXED, quant="q4_k_m", seed=13)
    split = write_synthetic(tmp_path / "m.gguf", MIXED, quant="q4_k_m", seed=13, split_max_size="3M")
    assert len(split.shards) >= 3
    ids = [int(x) for x in np.random.default_rng(6).integers(0, MIXED.n_vocab, 16)]
    assert np.array_equal(SingleProcessRunner(str(split.path)).logits(ids),
                          SingleProcessRunner(str(whole.path)).logits(ids))
    assert _two_ranks(str(split.path)) == _single(str(whole.path))
