"""GPU ranks with speculative decoding (`--spec 4`): greedy tokens of one stage and of two stages
sharing the one GPU equal the single-process GPU run without speculation, for the n-gram drafter
and for a draft model (strata_dist/rank/draft_model.py): the target file itself (every draft accepted)
and the same weights at f16 drafting for the q8_0 target (drafts accepted and rejected)."""
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CHUNK = 16
# a prompt that repeats itself: the n-gram drafter finds continuations in it
PROMPT = [17, 250, 31, 99, 140, 7, 61, 202] * 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpudraft")
    model = tiny_qwen3moe(11, hidden=256, head_dim=128, top_k=8, n_experts=16, n_layers=6)
    return {"target": str(write_gguf(model, d / "m.gguf", "q8_0")),
            "f16": str(write_gguf(model, d / "m16.gguf", "f16"))}


@pytest.fixture(scope="module")
def baseline(files):
    from strata_dist.tools.single_process import SingleProcessRunner
    runner = SingleProcessRunner(files["target"], "cuda:0", prompt_chunk=CHUNK, max_context=512)
    return runner.generate(PROMPT, 64).tokens


@pytest.mark.parametrize("split", ["", "3"])
@pytest.mark.parametrize("drafter", ["ngram", "self", "f16"])
def test_gpu_speculation_keeps_the_greedy_tokens(files, baseline, drafter, split):
    args = ["--spec", "4"] + ([] if drafter == "ngram" else
                              ["--draft-model", files["target" if drafter == "self" else drafter]])
    n = 2 if split else 1
    s = ServeSession(files["target"], "--gpus", ",".join(["0"] * n), "--prefill", str(CHUNK),
                     "--max-context", "512", "--gpu-order", "as_given", *args,
                     *(["--layer-split", split] if split else []), timeout=180)
    try:
        out = s.gen(PROMPT, 64, timeout=180)
        assert out["err"] is None, out["err"]
        drafted, accepted = int(out["stats"][-1]["drafted"]), int(out["stats"][-1]["accepted"])
        assert out["tokens"] == baseline, (drafted, accepted)
        assert drafted > 0
        if drafter == "self":
            assert accepted == drafted
        again = s.gen(PROMPT[:20], 16, timeout=180)     # a second request on the same ranks
        assert again["err"] is None
    finally:
        assert s.close() == 0
