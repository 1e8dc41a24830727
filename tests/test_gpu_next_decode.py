"""qwen3next's decode graph (backends/next_decode.py) on the GPU: its logits against the numpy
path over 64 decode steps and steps of several rows, the recurrent state it leaves, greedy tokens
against the general path (a follow-up turn included), and GPU ranks of 1-3 stages, one of them
with no attention layer, every decode step of every stage a graph step. Run on the GPU machine:
pytest -m gpu."""
import numpy as np
import pytest

from hf_next_fixtures import tiny_qwen3next, write_gguf
from launch_helpers import gpu_split_session

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CHUNK = 16
PROMPT = [int(x) for x in np.random.default_rng(8).integers(0, 320, 40)]
# the kernels' attention geometry (next_attention.cuh): heads of 256, their first 64 dims rotated
# (partial_rotary_factor 0.25); 4 query heads over 2 kv heads. Linear heads of 32 x 32.
GEOMETRY = dict(hidden=128, head_dim=256, n_head=4, n_kv=2, n_k_heads=2, n_v_heads=4,
                head_k_dim=32, head_v_dim=32, top_k=4, n_experts=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tiny_qwen3next(21, **GEOMETRY), tmp_path_factory.mktemp("nextdec") / "m.gguf",
                      "q8_0")


def _runner(model, device, **kw):
    from strata_dist.tools.single_process import SingleProcessRunner
    return SingleProcessRunner(model, device, prompt_chunk=CHUNK, max_context=512, **kw)


def test_graph_decode_matches_numpy_over_64_steps(model, f16_kv_reference, float32_prompt_kernels):
    """Q8_0 matrices decode exactly on both sides and K/V are f16 on both (f16_kv_reference), so
    what is left is float32 summation order; the conv and recurrent state the graph wrote are the
    numpy run's too."""
    from strata_dist.backends.next_decode import NextDecodeGraph
    cpu, gpu = _runner(model, "cpu"), _runner(model, "cuda:0")
    assert isinstance(gpu.decode_graph, NextDecodeGraph)
    cpu.prefill(PROMPT)
    gpu.prefill(PROMPT)
    steps = [int(x) for x in np.random.default_rng(9).integers(0, 320, 64)]
    for t in steps:                                 # one row per step, as decode runs
        ref = cpu.feed([t])[-1]
        got = np.asarray(gpu.decode_step([t]))
        assert np.abs(got - ref).max() <= 2e-3 * max(1.0, np.abs(ref).max()), t
    for rows in ([5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]):   # several rows in one step
        ref = cpu.feed(rows)[-1]
        got = np.asarray(gpu.decode_step(rows))
        assert np.abs(got - ref).max() <= 2e-3 * max(1.0, np.abs(ref).max())
    assert gpu.decode_graph.steps == len(steps) + 2
    gpu.decode_graph.settle()
    for layer in gpu.session.linear_layers:
        for part in ("conv_state", "recurrent_state"):
            want = getattr(cpu.session, part)(layer)
            got = cp.asnumpy(getattr(gpu.session, part)(layer))
            np.testing.assert_allclose(got, want, rtol=1e-3,
                                       atol=1e-4 * max(1.0, float(np.abs(want).max())))


def test_greedy_tokens_equal_the_general_path_and_a_follow_up_turn(model):
    """The graph (steps launched ahead, the default) and the general path give the same greedy
    tokens; a second turn that extends the first resumes where the session is and equals a fresh
    runner reading the whole conversation as a prompt."""
    graph, general = _runner(model, "cuda:0"), _runner(model, "cuda:0")
    general.decode_graph = None
    first = graph.generate(PROMPT, 48).tokens
    assert first == general.generate(PROMPT, 48).tokens
    assert graph.decode_graph.ahead_taken > 0
    turn = PROMPT + first + [7, 250]
    again = graph.generate(turn, 24).tokens
    assert again == _runner(model, "cuda:0").generate(turn, 24).tokens


@pytest.fixture(scope="module")
def baseline(model):
    runner = _runner(model, "cuda:0")
    runner.decode_graph.ahead_enabled = False      # every step after its token is read
    return runner.generate(PROMPT, 64).tokens


@pytest.mark.parametrize("split", ["", "3", "1,4"])
def test_gpu_ranks_equal_single_process(model, baseline, split):
    """Layers 3 and 7 are the attention layers: split 3 gives a first stage of linear layers
    only, split 1,4 a stage of one linear layer and one whose attention layer is its last."""
    s = gpu_split_session(model, split, CHUNK)
    try:
        out = s.gen(PROMPT, 64, timeout=120)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        stats = list(s.stats().values())
        assert all(int(r.get("graph_steps", 0)) == 63 for r in stats), stats
    finally:
        assert s.close() == 0
