"""A batched step's Tokens reach the head as one StepTokens (protocol v24): the last stage's shell
bundles what StageStep answers a batched step (rank/stage_step.py one_message_a_step) and the
head's scheduler reads each Token of it as it read them one at a time. Real CPU stage ranks
through the launcher, the scheduler pumped on a thread of its own as the server's worker pumps
it."""
from __future__ import annotations

import pytest

from protocol import Error, Settle, StepTokens, Token
from protocol.messages import Sampling
from pumped_scheduler import Pumped, cpu_launch
from strata_dist.rank.stage_step import Outbound, To, one_message_a_step
from strata_dist.synth import write_synthetic

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [7, 7, 1, 2], [100, 3]]
MAX_NEW = 24
STEP_TIMEOUT_S = 60.0
SAMPLINGS = [dict(temperature=0.0), dict(temperature=0.9, seed=77, logprobs=True, top_logprobs=2),
             dict(temperature=0.0, logprobs=True), dict(temperature=0.7, top_k=20, seed=5)]


def _token(rid: int, tok: int) -> Token:
    return Token(request_id=rid, session_id=rid, token_id=tok, pos=3)


def test_a_steps_tokens_go_as_one_message_where_the_first_was_and_the_rest_as_they_were():
    error = Error(rank=0, request_id=7, message="rank 0: request 7: the row is NaN")
    settle = Settle(request_id=8, session_id=2, pos=9)
    out = one_message_a_step(30, [Outbound(To.HEAD, _token(5, 11)), Outbound(To.HEAD, error),
                                  Outbound(To.HEAD, _token(6, 12)), Outbound(To.FIRST, settle)])
    assert [(o.to, type(o.msg)) for o in out] == [(To.HEAD, StepTokens), (To.HEAD, Error),
                                                  (To.FIRST, Settle)]
    assert out[0].msg.request_id == 30
    assert [(t.request_id, t.token_id) for t in out[0].msg.tokens] == [(5, 11), (6, 12)]
    alone = [Outbound(To.HEAD, error)]
    assert one_message_a_step(31, alone) == alone      # no Token: nothing to bundle


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """One CPU stage rank through the launcher, a session per prompt."""
    path = tmp_path_factory.mktemp("step_tokens") / "tiny.gguf"
    write_synthetic(str(path), like="tiny", quant="f32")
    with cpu_launch(str(path), 1, "auto", 256, sessions=len(PROMPTS)) as launched:
        yield launched


def _row(t: Token) -> tuple:
    return t.token_id, t.pos, t.logprob, list(t.top_ids), list(t.top_logprobs), t.done, t.reason


@pytest.mark.timeout(180)
def test_each_batched_step_answers_the_head_once_with_every_rows_token(pipeline):
    """Each request alone (Coordinator.run_request), then all at once through the scheduler: the
    same tokens, logprobs and ends; the head got one StepTokens per batched step, carrying a
    Token per row of it, and no batched row's Token on its own."""
    launch, plan = pipeline
    coord = launch.coordinator
    samplings = [Sampling(max_new=MAX_NEW, **kw) for kw in SAMPLINGS]
    want = []
    for sid, (prompt, sampling) in enumerate(zip(PROMPTS, samplings)):
        got: list[Token] = []
        reason = coord.run_request(sid, 0, prompt, sampling, plan.prompt_chunk,
                                   lambda e, got=got: got.append(e.msg) if e.kind == "token"
                                   else None, step_timeout_s=STEP_TIMEOUT_S)
        assert reason == "length" and len(got) == MAX_NEW
        want.append([_row(t) for t in got])

    heard: list = []
    turns: list[str] = []       # what each turn of the scheduler did, in order
    pump = coord._pump

    def spied(wait_s):
        events = pump(wait_s)
        heard.extend(events)
        turns.extend("tokens" for m in events if isinstance(m, StepTokens))
        return events
    coord._pump = spied
    pumped = Pumped(coord, plan.prompt_chunk, parallel=len(PROMPTS))
    s = pumped.scheduler
    send_step, flush = s._send_step, s._flush

    def sent(*a):
        turns.append("step")
        return send_step(*a)

    def flushed():
        if any(item[0] == "event" and item[1].kind == "token" for _, item in s._held):
            turns.append("told")
        return flush()
    s._send_step, s._flush = sent, flushed
    out: dict = {}
    tokens = [[] for _ in PROMPTS]
    try:
        threads = [pumped.request(sid, prompt, STEP_TIMEOUT_S, out, f"r{sid}",
                                  on_event=lambda e, mine=tokens[sid]: mine.append(e.msg)
                                  if e.kind == "token" else None, sampling=sampling)
                   for sid, (prompt, sampling) in enumerate(zip(PROMPTS, samplings))]
        for t in threads:
            t.join(120)
    finally:
        pumped.stop()
        coord._pump = pump
    assert all(out[f"r{sid}"][:2] == ("ok", "length") for sid in range(len(PROMPTS))), out
    assert [[_row(t) for t in mine] for mine in tokens] == want
    bundles = [m for m in heard if isinstance(m, StepTokens)]
    assert s.steps > 0 and len(bundles) == s.steps, (len(bundles), s.steps)
    assert sum(len(b.tokens) for b in bundles) == s.rows and s.rows > s.steps   # rows batched
    batched = {t.request_id for b in bundles for t in b.tokens}
    # a plain Token only of a request's lone steps (the last stage looping it) or its prompt
    plain = [m for m in heard if isinstance(m, Token)]
    assert len(plain) + s.rows == len(PROMPTS) * MAX_NEW
    assert not batched & {b.request_id for b in bundles}   # each Token names its request
    # the requests' threads hear a step's tokens after the next step went out, not before
    # (a woken thread competes with the one that sends it): "tokens", "step", "told"
    after = sum(turns[i:i + 3] == ["tokens", "step", "told"] for i in range(len(turns)))
    assert after >= len(bundles) - len(PROMPTS) and "tokens" not in turns[-1:], turns
