"""GPU ranks (several sharing the one GPU of the test machine): greedy tokens of 1-3 stages equal
the single-process GPU run, and hidden rows cross between them through CUDA IPC. Stages whose
cache holds their whole range decode through the device graph (backends/cuda_decode.py); stages
with partial caches and helper tiers take the general path, and the tokens are the same."""
import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession, gpu_split_session

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CHUNK = 16
PROMPT = [int(x) for x in np.random.default_rng(5).integers(0, 320, 40)]
SECOND = [int(x) for x in np.random.default_rng(6).integers(0, 320, 48)]   # shares no prefix


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tiny_qwen3moe(11, hidden=256, head_dim=128, top_k=8, n_experts=16,
                                    n_layers=6),
                      tmp_path_factory.mktemp("gpupipe") / "m.gguf", "q8_0")


@pytest.fixture(scope="module")
def baseline(model):
    from strata_dist.tools.single_process import SingleProcessRunner
    runner = SingleProcessRunner(model, "cuda:0", prompt_chunk=CHUNK, max_context=512)
    runner.decode_graph.ahead_enabled = False      # every step after its token is read
    return runner.generate(PROMPT, 64).tokens


@pytest.fixture(scope="module")
def second_baseline(model):
    from strata_dist.tools.single_process import SingleProcessRunner
    runner = SingleProcessRunner(model, "cuda:0", prompt_chunk=CHUNK, max_context=512)
    return runner.generate(SECOND, 4).tokens


@pytest.mark.parametrize("split", ["", "3", "1,4"])
def test_gpu_ranks_equal_single_process(model, baseline, split):
    n = len(split.split(",")) + 1 if split else 1
    s = gpu_split_session(model, split, CHUNK)
    try:
        out = s.gen(PROMPT, 64, timeout=120)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        stats = list(s.stats().values())   # by rank: the last stage last
        # every decode step of every stage ran as a device graph (63 steps after the prompt)
        assert all(int(r.get("graph_steps", 0)) == 63 for r in stats), stats
        if n > 1:
            assert all(int(r.get("handoff_ipc", 0)) > 0 for r in stats[:-1]), stats
            # rows go in frames only until the next stage has opened the buffer (prompt chunks)
            assert all(int(r.get("handoff_ipc", 0)) >= 63 for r in stats[:-1]), stats
    finally:
        assert s.close() == 0


@pytest.mark.parametrize("ahead", ["", "0"])
def test_a_single_stage_rank_launching_steps_ahead_keeps_the_tokens(model, baseline, ahead):
    """A rank that is the whole pipeline launches each next greedy step before it has read the
    token (the default; STRATA_DECODE_AHEAD=0: after): the tokens equal the single-process run's
    without steps ahead, for a second request on the same rank too (its prompt waits for the step
    left in flight)."""
    s = ServeSession(model, "--gpus", "0", "--prefill", str(CHUNK), "--max-context", "512",
                     env={"STRATA_DECODE_AHEAD": ahead} if ahead else None, timeout=120)
    try:
        out = s.gen(PROMPT, 64, timeout=120)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        again = s.gen(PROMPT, 64, timeout=120)
        assert again["err"] is None and again["tokens"] == baseline
    finally:
        assert s.close() == 0


@pytest.mark.parametrize("ipc", ["1", "0"])
def test_gpu_tiers_keep_the_tokens(model, baseline, second_baseline, ipc):
    """Stage caches of a few pairs, a helper tier on a third rank, host misses streamed from
    pinned memory: the tokens equal the single-process GPU run. With CUDA IPC the first decode
    step asks the helper (through the stage's buffer once the helper opened it) while the helper's
    tier opens here; from then on each stage's decode graph reads the tier in place, with the same
    kernels and bits, and so do the chunks of the next prompt (grouped on the device: the tier's
    pairs are not streamed from host memory). With STRATA_IPC=0 every step asks, in frames."""
    s = ServeSession(model, "--gpus", "0,0,0", "--layer-split", "3", "--prefill", str(CHUNK),
                     "--max-context", "512", "--gpu-order", "as_given",
                     env={"STRATA_STAGE_CACHE_SLOTS": "20", "STRATA_IPC": ipc}, timeout=120)
    try:
        out = s.gen(PROMPT, 64, "stats=1", timeout=120)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        assert sum(int(r["remote"]) for r in out["stats"]) > 0
        assert sum(int(r["host"]) for r in out["stats"]) > 0
        assert sum(int(r["hits"]) for r in out["stats"]) > 0
        assert sum(int(r.get("remote_lost", 0)) for r in out["stats"]) == 0
        graph_steps = sum(int(r["graph_steps"]) for r in out["stats"])
        stages = [r for r in s.stats().values() if "remote_frames" in r]
        assert stages, "no stage asked a helper tier"
        via_ipc = sum(int(r["remote_ipc"]) for r in stages)
        in_frames = sum(int(r["remote_frames"]) for r in stages)
        if ipc == "1":
            # requests only until the tier opened (the first decode step or two), then graphs
            assert graph_steps >= len(stages) * 60 and in_frames <= len(stages) * 4, stages
            assert via_ipc + in_frames <= len(stages) * 2 * 3, stages
        else:
            assert graph_steps == 0 and via_ipc == 0 and in_frames > 0, stages
        # a prompt after the tiers opened: one new token, so every count is the prompt's. Both
        # prompts are three chunks, and a chunk grouped on the device streams every expert of a
        # layer that is not in device memory (whatever its rows route to): the second streams
        # fewer blobs exactly when the other ranks' tiers, opened since, are read in place
        nxt = s.gen(SECOND, 1, "stats=1", timeout=120)
        assert nxt["err"] is None and nxt["tokens"] == second_baseline[:1]
        if ipc == "1":   # (in frames nothing is pinned: chunks take the host path)
            assert sum(int(r.get("prompt_layers_on_device", 0)) for r in nxt["stats"]) > 0
            streamed = [sum(int(r.get("streamed", 0)) for r in o["stats"]) for o in (out, nxt)]
            assert streamed[1] < streamed[0], streamed
            assert sum(int(r["remote"]) for r in nxt["stats"]) > 0, nxt["stats"]
        again = s.gen(SECOND, 4, timeout=120)
        assert again["err"] is None and again["tokens"] == second_baseline
    finally:
        assert s.close() == 0


def test_killing_a_gpu_helper_mid_generation_recovers_with_the_same_tokens(model, baseline):
    """A helper tier's rank killed after the fifth token, while the stages' decode graphs read its
    tier in place: the stages see its process gone and read its pairs from host memory, the
    request finishes with the single-process tokens, the launcher says the helper is gone, and
    the next request runs without the tier."""
    from launch_helpers import generate_killing, rank_pids
    s = ServeSession(model, "--gpus", "0,0,0", "--layer-split", "3", "--prefill", str(CHUNK),
                     "--max-context", "512", "--gpu-order", "as_given",
                     env={"STRATA_STAGE_CACHE_SLOTS": "20"}, timeout=120)
    try:
        helper = rank_pids(s)[2]
        assert any(f.get("role") == "helper" for f in s.info_fields())
        assert generate_killing(s, PROMPT, 64, helper, after=5, timeout=60) == baseline
        assert s.err_has("helper rank 2 is gone", timeout=20)
        again = s.gen(PROMPT, 8, timeout=120)
        assert again["err"] is None and again["tokens"] == baseline[:8]
    finally:
        s.close()
