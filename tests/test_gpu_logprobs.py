"""Logprobs, prompt logprobs and logit bias on a GPU stage (first and last, decoding through the
device graph, whose steps carry their greedy token and copy the row only when it is read),
driven message by message as the rank's shell would. Run on the GPU machine: pytest -m gpu."""
import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from protocol import PromptProgress, Token, Tokens
from protocol.messages import Sampling

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

PROMPT = [int(x) for x in np.random.default_rng(21).integers(0, 320, 40)]
CHUNK = 16
MAX_NEW = 8
# the GPU's logits differ from numpy's by up to 1e-2 on these random models (test_gpu_decode.py);
# a log-softmax moves by at most twice that
TOLERANCE = 2e-2


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tiny_qwen3moe(7, hidden=256, head_dim=128, top_k=4, n_experts=16, n_layers=3),
                      tmp_path_factory.mktemp("gpulp") / "m.gguf", "f32")


@pytest.fixture(scope="module")
def step(model):
    from strata_dist.rank.stage import Stage, StageConfig
    from strata_dist.rank.stage_step import StageStep
    stage = Stage(StageConfig(model, "cuda:0", 0, 3, True, True, 512,
                              cache_pairs=[(l, e) for l in range(3) for e in range(16)]))
    assert stage.decode_graph is not None
    return StageStep(stage, rank=0, last=True)


def _generate(step, request_id: int, sampling: Sampling):
    """(prompt progress messages, sampled Token messages) of one request on its own session."""
    from strata_dist.head.coordinator import chunk_sampling
    from strata_dist.rank.stage_step import To
    chunks = [PROMPT[i:i + CHUNK] for i in range(0, len(PROMPT), CHUNK)]
    progress, tokens, pending = [], [], []
    for i, c in enumerate(chunks):
        out = step.step(Tokens(request_id=request_id, session_id=request_id, pos=i * CHUNK, ids=c,
                               chunk_index=i, chunk_total=len(chunks),
                               sampling=chunk_sampling(sampling, i * CHUNK, len(c), i, len(chunks))))
        progress += [o.msg for o in out if isinstance(o.msg, PromptProgress)]
        pending = out
    while True:
        head = [o.msg for o in pending if o.to is To.HEAD and not isinstance(o.msg, PromptProgress)]
        assert len(head) == 1 and isinstance(head[0], Token), head
        tokens.append(head[0])
        if head[0].done:
            return progress, tokens
        nxt = [o.msg for o in pending if o.to is To.FIRST]
        pending = step.step(nxt[0])


def test_gpu_logprobs_and_bias(model, step, f16_kv_reference, float32_prompt_kernels):
    from strata_dist.tools.single_process import SingleProcessRunner
    _, plain = _generate(step, 1, Sampling(max_new=MAX_NEW))
    plain_ids = [t.token_id for t in plain]
    asked = Sampling(max_new=MAX_NEW, logprobs=True, top_logprobs=3, prompt_logprobs=True,
                     prompt_ids=PROMPT)
    progress, got = _generate(step, 2, asked)
    # reading each row turns off the step ahead; the tokens are the same greedy ones
    assert [t.token_id for t in got] == plain_ids
    full = PROMPT + plain_ids
    ref = log_softmax(SingleProcessRunner(model, "cpu").logits(full[:-1]).astype(np.float64))
    prompt_lp = [x for p in progress for x in p.logprobs]
    assert len(prompt_lp) == len(PROMPT) - 1
    assert np.abs(np.array(prompt_lp) - ref[np.arange(len(PROMPT) - 1), PROMPT[1:]]).max() <= TOLERANCE
    for i, t in enumerate(got):
        row = len(PROMPT) - 1 + i
        assert abs(t.logprob - ref[row, t.token_id]) <= TOLERANCE
        assert len(t.top_ids) == 3 and t.top_ids[0] == t.token_id    # greedy: the most likely
        assert t.top_logprobs[0] == pytest.approx(t.logprob, abs=1e-6)
        assert np.abs(np.array(t.top_logprobs) - ref[row, t.top_ids]).max() <= TOLERANCE
    # a bias reshapes the row: the device's own greedy token is not taken
    _, forced = _generate(step, 3, Sampling(max_new=MAX_NEW, logit_bias_ids=[77],
                                            logit_bias_values=[100.0]))
    assert [t.token_id for t in forced] == [77] * MAX_NEW
