"""Routing counts with speculative decoding when a request ends inside a verify window.

A window's rows past the token that ends a request (an end-of-text drawn at its first row, say)
held drafts nobody verified: the last stage sends `Settle` (protocol/messages.py) so that every
stage takes them back when the request ends, not at a next step of the session that may never
come. Real CPU ranks through the launcher, 2 stages: the profile learnt with --spec 4 equals
--spec 0's and the single-process forward's routing of the tokens fed, for a request that stops
on its end-of-text; and in process, a request cancelled with a window's next step in flight."""
import json

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession
from strata_dist.tools.profile_io import load_profile, record_profile
from strata_dist.tools.single_process import SingleProcessRunner

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 8]
# this model's greedy continuation of PROMPT first draws 123 as its 12th token, at the first row of
# a 5-row window whose 4 drafts are all rejected: made the end-of-text, the request stops there
EOS = 123
N_LAYERS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_gguf(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=N_LAYERS),
                          tmp_path_factory.mktemp("spec-routing") / "moe.gguf", "f32",
                          eos_id=EOS))


def _served(model: str, k: int, path) -> dict:
    s = ServeSession(model, "--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G",
                     "--prefill", "8", "--max-context", "256", "--expert-profile-out", str(path),
                     "--spec", str(k))
    try:
        out = s.gen(PROMPT, 40)
    finally:
        assert s.close() == 0
    assert out["err"] is None and out["done"][-1] == "stop", out
    return out


def test_a_window_cut_by_end_of_text_counts_as_the_tokens_fed(model, tmp_path):
    want = list(SingleProcessRunner(model, prompt_chunk=8, max_context=256)
                .generate(PROMPT, 40).tokens)
    assert want[-1] == EOS and len(want) < 40     # the model stops on it, early
    plain = _served(model, 0, tmp_path / "k0.json")
    spec = _served(model, 4, tmp_path / "k4.json")
    assert plain["tokens"] == spec["tokens"] == want
    drafted, accepted = int(spec["stats"][-1]["drafted"]), int(spec["stats"][-1]["accepted"])
    assert drafted - accepted >= 4     # the last window's drafts among the rejected
    n_experts = json.loads((tmp_path / "k0.json").read_text())["n_experts"]
    counts = [load_profile(tmp_path / f, N_LAYERS, n_experts).counts
              for f in ("k0.json", "k4.json")]
    np.testing.assert_array_equal(counts[1], counts[0])
    # the prompt and every token but the last (no stage runs it), through the forward
    np.testing.assert_array_equal(counts[0],
                                  record_profile(model, [PROMPT + want[:-1]]).counts)


def test_a_cancelled_window_counts_the_rows_that_stood(model):
    """A Cancel while a window's next step is in flight (in process: one stage, first and last,
    its steps handed back by hand, the in-flight one never): the last stage's answer waits for its
    Settle, which takes back the window's rows past the tokens accepted, so the stage's routing
    totals are the forward's over the prompt and the tokens before the last one drawn."""
    from protocol import Cancel, Settle, Token, Tokens
    from protocol.messages import Sampling
    from strata_dist.rank.stage import Stage, StageConfig
    from strata_dist.rank.stage_step import StageStep, To

    stage = Stage(StageConfig(model, "cpu", 0, N_LAYERS, True, True, 256, count_routing=True))
    step = StageStep(stage, rank=0, last=True)
    sent = step.step(Tokens(request_id=1, session_id=0, pos=0, ids=PROMPT,
                            sampling=Sampling(max_new=40, spec_tokens=4, prompt_ids=PROMPT)))
    tokens: list[int] = []
    windows = 0
    while True:
        tokens += [o.msg.token_id for o in sent if isinstance(o.msg, Token)]
        [nxt] = [o.msg for o in sent if o.to is To.FIRST]
        windows += len(nxt.ids) > 1
        if windows == 3:     # the third window in flight: cancelled before any stage runs it
            break
        sent = step.step(nxt)
    assert stage.window_routes          # the second window's routes still wait to be settled
    answer = step.step(Cancel(request_id=1))
    [settle] = [o.msg for o in answer if o.to is To.FIRST]
    assert isinstance(settle, Settle) and settle.pos == nxt.pos == len(PROMPT) + len(tokens) - 1
    assert not [o for o in answer if o.to is To.HEAD]       # held until the Settle is back
    [done] = [o.msg for o in step.step(settle)]
    assert done.done and done.reason == "cancelled" and not stage.window_routes
    fed = PROMPT + tokens[:-1]
    np.testing.assert_array_equal(stage.routing.total,
                                  record_profile(model, [fed]).counts.astype(np.int64))
