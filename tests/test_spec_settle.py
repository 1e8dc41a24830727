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
  session is reset (Release): before, it stayed in `StageStep.settling` for good;
- in two stages in process (a batched step, --parallel), a window that is not the one drafted,
  or whose rows are NaN, fails its request with an Error naming it, after its Settle."""
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


# ---- a batched step's window that cannot be verified ------------------------------------------

def _pipeline(path: str) -> tuple[list[Stage], list[StageStep]]:
    """Two stages in process ([0, 2) and [2, 4)), each behind its StageStep, routing counted."""
    stages = [Stage(StageConfig(path, "cpu", lb, le, lb == 0, le == N_LAYERS, 256,
                                count_routing=True)) for lb, le in ((0, 2), (2, N_LAYERS))]
    return stages, [StageStep(st, rank=i, last=i == 1) for i, st in enumerate(stages)]


def _round(steps: list[StageStep], msg, hidden_fault=None) -> list:
    """`msg` through the first stage, its rows (changed by `hidden_fault`, if given) through the
    last; what the last stage sends on (Settles go round again, as the ranks send them): the
    messages to the head."""
    to_head = []
    todo = [msg]
    while todo:
        [out] = steps[0].step(todo.pop(0))
        rows = out.rows if hidden_fault is None else hidden_fault(out.rows)
        hidden_fault = None
        for o in steps[1].step(out.msg, rows):
            (todo if o.to is To.FIRST else to_head).append(o.msg)
    return to_head


def _batched_until_window(path: str):
    """A speculating request (its steps sent by the head, --parallel) stepped in batched steps of
    its own until the last stage drafts a window and has verified one before: the stages, the
    steps, and the Token that carries the next window's drafts."""
    from protocol.batch import BatchRows
    stages, steps = _pipeline(path)
    prompt = _prompt(path)
    [token] = _round(steps, Tokens(request_id=1, session_id=0, pos=0, ids=prompt,
                                   sampling=Sampling(max_new=40, spec_tokens=3, head_steps=True,
                                                     prompt_ids=prompt)))[-1:]
    step_id = 10
    while not (token.drafts and steps[1].requests[1].spec.windows > 1):
        ids = [token.token_id] + list(token.drafts)
        step_id += 1
        batch = BatchRows(request_ids=[1], session_ids=[0], positions=[token.pos],
                          window_rows=[len(ids)] if len(ids) > 1 else [])
        token = _round(steps, Tokens(request_id=step_id, session_id=0, pos=0, ids=ids,
                                     batch=batch))[-1]
        assert isinstance(token, Token) and not token.done, token
    return stages, steps, token


@pytest.mark.parametrize("fault", ["short window", "NaN rows"])
def test_a_batched_window_that_cannot_be_verified_fails_its_request_and_settles(model, fault):
    """In a batched step (--parallel --spec), a request's window that is not the one the last
    stage drafted, or whose rows come to the last stage as NaN (an upstream stage's numbers gone
    bad), ends the request at once with an Error naming it and why, after its Settle has come
    round every stage (the window's routing records go, as at any end of a speculating request).
    Before, the short window's Error went without a Settle (the stages kept the records until
    the session's next step), and a greedy draw from NaN logits took token 0 as the answer."""
    import numpy as np

    from protocol.batch import BatchRows
    stages, steps, token = _batched_until_window(model)
    ids = [token.token_id] + list(token.drafts)
    if fault == "short window":
        ids, fault_rows = ids[:-1], None
    else:
        def fault_rows(rows):
            rows = rows.copy()
            rows[0] = np.nan
            return rows
    batch = BatchRows(request_ids=[1], session_ids=[0], positions=[token.pos],
                      window_rows=[len(ids)])
    to_head = _round(steps, Tokens(request_id=99, session_id=0, pos=0, ids=ids, batch=batch),
                     fault_rows)
    assert [type(m) for m in to_head] == [Error], to_head   # no token drawn from a bad window
    [error] = to_head
    assert error.request_id == 1 and "request 1" in error.message, error.message
    said = ("a verify window of 3 rows for 3 drafts" if fault == "short window"
            else "NaN")
    assert said in error.message, error.message
    # the Settle came round before the Error: no stage keeps the window, nothing is held
    assert not any(st.window_routes for st in stages)
    assert not steps[1].settling and 1 not in steps[1].requests
    assert steps[1].counters["errors"] == 1
