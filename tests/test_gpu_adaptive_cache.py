"""The adaptive expert cache on GPU ranks: swaps between decode-graph steps (the blob copied into the
evicted slot, then the graph's address table pointed at it) keep the tokens of a static cache."""
import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

N_LAYERS, N_EXPERTS, TOP_K = 8, 64, 4
PROMPTS = [[int(x) for x in np.random.default_rng(seed).integers(0, 320, 40)] for seed in (3, 4)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tiny_qwen3moe(17, hidden=256, top_k=TOP_K, n_experts=N_EXPERTS,
                                    n_layers=N_LAYERS, head_dim=128),
                      tmp_path_factory.mktemp("gpuadapt") / "m.gguf", "q8_0")


def _run(model, *extra):
    # 100 of a stage's 256 pairs cached, the others pinned in host memory and read in place by
    # the decode graph; sampled (seeded): a draw moves with any change of the distribution
    s = ServeSession(model, "--gpus", "0,0", "--layer-split", "4", "--prefill", "32",
                     "--max-context", "512", "--gpu-order", "as_given", "--no-remote-auto",
                     "--expert-cache", "100", *extra, timeout=120)
    try:
        tokens = []
        for prompt in PROMPTS:
            out = s.gen(prompt, 64, "temperature=1.5 seed=5", timeout=120)
            assert out["err"] is None, out["err"]
            tokens.append(out["tokens"])
        return tokens, s.stats()
    finally:
        assert s.close() == 0


@pytest.mark.parametrize("every", ["1", "8"])
def test_swaps_between_graph_steps_keep_the_tokens(model, every):
    static, _ = _run(model)
    adapted, counters = _run(model, "--adapt-every", every, "--adapt-swaps", "8")
    assert adapted == static
    for c in counters.values():
        assert int(c["graph_steps"]) > 0, c
        assert int(c["adapt_swaps"]) > 0, c
