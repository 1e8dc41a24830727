"""A speculating request's last verify window settles on every stage however it ends
(protocol `Settle`, strata_dist/rank/stage_step.py), and the answer the last stage holds for the
Settle never outlives the request.

In process, one stage that is first and last (its steps handed back by hand), the real sampler,
grammar matcher and routing counts:
- a request that ends on a grammar error sends its Settle too: before it, the stage kept the
  window's routing records until the session's next step; its Error waits for the Settle as a
  final Token does;
- an answer held for a Settle that never comes back (a stage lost while it went round) goes at
  the request's Cancel, which the head sends when it fails the request, and is dropped when the
  session is reset (Release): before, it stayed in `StageStep.settling` for good."""
from __future__ import annotations

import pytest

from protocol import Cancel, Error, Release, Settle, Token, Tokens
from protocol.messages import Sampling
from server_helpers import tiny_model_fixture
from strata_dist.rank.stage import Stage, StageConfig
from strata_dist.rank.stage_step import StageStep, To
from strata_dist.gguf_file.tokenizer import GGUFTokenizer

model = tiny_model_fixture("spec-settle")
N_LAYERS = 4


def _prompt(path: str) -> list[int]:
    # a repeated cycle of words: the n-gram drafter finds continuations, the model echoes them
    return GGUFTokenizer.from_gguf(path).encode(" ".join(f"w{j % 3}" for j in range(30)))


def _step(path: str) -> tuple[Stage, StageStep]:
    stage = Stage(StageConfig(path, "cpu", 0, N_LAYERS, True, True, 256, count_routing=True))
    return stage, StageStep(stage, rank=0, last=True)


def _until_window(step: StageStep, sent: list) -> tuple[list, Tokens]:
    """Steps handed back until a verify window is on its way (not yet run): what went to the
    head so far, and that window."""
    to_head = []
    while True:
        to_head += [o.msg for o in sent if o.to is To.HEAD]
        [nxt] = [o.msg for o in sent if o.to is To.FIRST]
        if len(nxt.ids) > 1 and step.requests[1].spec.windows > 1:
            return to_head, nxt
        sent = step.step(nxt)


def test_a_grammar_error_inside_speculation_settles_the_window(model):
    stage, step = _step(model)
    prompt = _prompt(model)
    sent = step.step(Tokens(request_id=1, session_id=0, pos=0, ids=prompt, sampling=Sampling(
        max_new=40, spec_tokens=3, prompt_ids=prompt, grammar_kind="lark",
        grammar="start: /( ?w[0-9]){20}/")))
    to_head, window = _until_window(step, sent)
    assert stage.window_routes and not [m for m in to_head if isinstance(m, Error)]
    # the grammar fails mid-answer: its matcher takes a token it forbids ('!') and is in error
    matcher = step.requests[1].grammar._start()
    assert not matcher.consume_token(0) and matcher.is_error()
    answer = step.step(window)
    assert not [o for o in answer if o.to is To.HEAD]          # the Error waits for the Settle
    [settle] = [o.msg for o in answer if o.to is To.FIRST]
    assert isinstance(settle, Settle) and stage.window_routes
    [error] = [o.msg for o in step.step(settle)]
    assert isinstance(error, Error) and "structured output" in error.message
    assert not stage.window_routes and not step.settling and not step.requests


@pytest.mark.parametrize("reset", ["cancel", "release"])
def test_an_answer_held_for_a_lost_settle_goes_with_the_request(model, reset):
    stage, step = _step(model)
    prompt = _prompt(model)
    sent = step.step(Tokens(request_id=1, session_id=0, pos=0, ids=prompt,
                            sampling=Sampling(max_new=40, spec_tokens=3, prompt_ids=prompt)))
    _, window = _until_window(step, sent)
    answer = step.step(Cancel(request_id=1))       # the client leaves: the answer is held
    [settle] = [o.msg for o in answer if o.to is To.FIRST]
    assert isinstance(settle, Settle) and 1 in step.settling
    # the Settle is lost with a stage; the head fails the request and cancels it on the last
    # stage (or resets the session)
    if reset == "cancel":
        [final] = [o.msg for o in step.step(Cancel(request_id=1))]
        assert isinstance(final, Token) and final.done and final.reason == "cancelled"
    else:
        assert step.step(Release(session_id=0)) == []
    assert not step.settling
    assert step.step(settle) == []           # a Settle that comes after all finds nothing held
    # the window in flight, late, is dropped; the session serves a next request
    assert step.step(window) == []
    sent = step.step(Tokens(request_id=2, session_id=0, pos=0, ids=prompt,
                            sampling=Sampling(max_new=2, prompt_ids=prompt)))
    assert [o.msg.token_id for o in sent if isinstance(o.msg, Token)]
