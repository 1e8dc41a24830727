"""GPU checks (run on the GPU machine: pytest -m gpu). CuPy against numpy on the tiny reference
models, and a synthetic Qwen3-30B-A3B-geometry Q8_0 file loading and generating."""
import os

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed,hidden,top_k,n_experts,dtype", [
    (0, 64, 2, 8, "f32"), (1, 64, 8, 16, "f16"), (2, 256, 2, 8, "q8_0"), (3, 256, 8, 16, "q8_0")])
def test_cupy_logits_match_numpy(tmp_path, seed, hidden, top_k, n_experts, dtype):
    from strata_dist.engine import Engine
    path = write_gguf(tiny_qwen3moe(seed, hidden=hidden, top_k=top_k, n_experts=n_experts),
                      tmp_path / "m.gguf", dtype)
    ids = [int(x) for x in np.random.default_rng(seed).integers(0, 320, 48)]
    ref = Engine(path, "cpu").logits(ids)
    got = Engine(path, "cuda:0").logits(ids)
    assert np.abs(got - ref).max() <= 1e-2


@pytest.mark.skipif(not os.environ.get("STRATA_BIG_MODEL_DIR"),
                    reason="set STRATA_BIG_MODEL_DIR to a folder with ~35 GB free")
def test_synth_qwen3_30b_q8_0_generates_on_gpu():
    from strata_dist.engine import Engine
    from strata_dist.synth import write_synthetic
    path = os.path.join(os.environ["STRATA_BIG_MODEL_DIR"], "qwen3-30b-a3b-q8_0.gguf")
    if not os.path.exists(path):
        write_synthetic(path, like="qwen3-30b-a3b", quant="q8_0", popularity="zipf:1.0", seed=0)
    eng = Engine(path, "cuda:0", max_context=1024)
    res = eng.generate(list(range(1, 33)), 16)
    assert len(res.tokens) == 16 and all(0 <= t < eng.model.g.n_vocab for t in res.tokens)
    print(f"30B q8_0: prompt {res.prompt_ms:.0f} ms, decode {res.decode_ms:.0f} ms for 16 tokens")
