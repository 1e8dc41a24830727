"""qwen35moe files against llama.cpp's own forward (skipped without STRATA_LLAMA_CPP; the tool and
the bounds are tests/test_llama_cpp_logits.py's): a transformers Qwen3.5-MoE twin (value heads
tiled as the converter stores them, head_v_dim = head_k_dim as llama.cpp's loader needs) and the
synth's tiny-qwen35 of three file types."""
from pathlib import Path

import numpy as np
import pytest

from hf_fixtures import tiny_qwen35moe, write_qwen35moe_gguf
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.synth import NEXT_GEOMETRIES, write_synthetic
from test_llama_cpp_logits import assert_agrees, compare, llama_cpp_logits, llama_tool  # noqa: F401


@pytest.mark.parametrize("heads", [(2, 4), (3, 6)], ids=lambda h: f"k{h[0]}-v{h[1]}")
def test_transformers_twin_matches_llama_cpp(llama_tool, tmp_path, heads):  # noqa: F811
    hf = tiny_qwen35moe(3, n_k_heads=heads[0], n_v_heads=heads[1], head_v_dim=16, vocab=512)
    path = Path(write_qwen35moe_gguf(hf, tmp_path / "twin.gguf", tokenizer=True))
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 512, 24)]
    ref = llama_cpp_logits(llama_tool, path, ids)
    a = assert_agrees(SingleProcessRunner(str(path)).logits(ids), ref, f"qwen35moe twin {heads}")
    assert a["rms"] < 0.005      # f32 weights: what is left is llama.cpp's f16 KV cache


@pytest.mark.parametrize("ftype", ["f32", "q8_0", "q4_k_m"])
def test_tiny_qwen35_matches_llama_cpp(llama_tool, tmp_path, ftype):  # noqa: F811
    s = write_synthetic(tmp_path / f"tq-{ftype}.gguf", "tiny-qwen35", quant=ftype,
                        popularity="zipf:1.0", seed=7)
    compare(llama_tool, s.path, NEXT_GEOMETRIES["tiny-qwen35"].n_vocab, f"tiny-qwen35 {ftype}")
