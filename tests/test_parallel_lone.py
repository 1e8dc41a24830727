"""A request alone under --parallel (strata_dist/head/batch_scheduler.py) decodes as the one-request
path does: the head sends its first decode step as a plain one and the last stage steps it on
itself; a second request admitted makes the head take the first back (HandBack, Token.handed_back)
into its batched steps. Its tokens, logprobs and drafts are the one-request path's either way; a
cancel, a silent or a dead rank end it with a message. Two real CPU stage ranks through the
launcher; the scheduler pumped on a thread of its own, as the server's worker pumps it."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from protocol.messages import Sampling
from pumped_scheduler import Pumped, cpu_launch, until
from strata_dist.head.coordinator import RankFailure
from strata_dist.synth import write_synthetic

A_PROMPT = [5, 6, 7, 8, 9, 10, 11]
B_PROMPT = [40, 41, 42]
A_TOKENS = 160
B_TOKENS = 12
JOIN_AT = 20          # A's tokens before B is submitted
# tokens a looping request may make from its HandBack to the Token handed back: the step in
# flight on each of the two stages, one more if the HandBack is read just after a draw, and
# slack for a loaded machine (it is a handful of steps, never the rest of the request)
HAND_BACK_BOUND = 8
STEP_TIMEOUT_S = 60.0

SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    # a seeded draw reads every bit of its row; logprobs show the row itself
    "sampled": dict(temperature=0.9, seed=1234, logprobs=True, top_logprobs=2),
    # drafts: a looping request's windows, then its window handed back with its drafts
    "spec": dict(temperature=0.0, spec_tokens=3, prompt_ids=A_PROMPT),
}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Two CPU stage ranks through the launcher (two sessions each)."""
    path = tmp_path_factory.mktemp("lone") / "tiny.gguf"
    write_synthetic(str(path), like="tiny", quant="f32")
    with cpu_launch(str(path), 2, [2], 512, sessions=2) as launched:
        yield launched


def _sampling(kind: str, max_new: int, prompt: list[int]) -> Sampling:
    kw = dict(SAMPLINGS[kind])
    if "prompt_ids" in kw:
        kw["prompt_ids"] = list(prompt)
    return Sampling(max_new=max_new, **kw)


def _row(token) -> tuple:
    return token.token_id, token.pos, token.logprob, list(token.top_ids), list(token.top_logprobs)


class _Tokens(list):
    """A request's Tokens as they come (on its own thread)."""

    def __call__(self, event) -> None:
        if event.kind == "token":
            self.append(event.msg)


def _one_request_path(launch, plan, session_id: int, prompt: list[int], sampling: Sampling):
    """The request through Coordinator.run_request (no scheduler pumping meanwhile)."""
    got = _Tokens()
    reason = launch.coordinator.run_request(session_id, 0, prompt, sampling, plan.prompt_chunk,
                                            got, step_timeout_s=STEP_TIMEOUT_S)
    return reason, got


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_a_lone_request_loops_and_is_taken_back_with_the_one_request_paths_tokens(pipeline,
                                                                                    kind):
    """A alone gets the one-request path's tokens (and logprobs, and drafts) with no batched
    step; A again with B submitted after JOIN_AT of its tokens: A is handed back within
    HAND_BACK_BOUND tokens, decodes batched beside B, loops again once B ends, and both get
    exactly their one-request tokens."""
    launch, plan = pipeline
    a_sampling = _sampling(kind, A_TOKENS, A_PROMPT)
    b_sampling = _sampling("greedy", B_TOKENS, B_PROMPT)
    want_reason, want_a = _one_request_path(launch, plan, 0, A_PROMPT, a_sampling)
    _, want_b = _one_request_path(launch, plan, 1, B_PROMPT, b_sampling)
    assert want_reason == "length" and len(want_a) == A_TOKENS
    if kind == "spec":
        assert want_a[-1].drafted > 0, "the drafter drafted nothing: no window was tested"

    pumped = Pumped(launch.coordinator, plan.prompt_chunk)
    s = pumped.scheduler
    out: dict = {}
    try:
        lone = _Tokens()
        pumped.request(0, A_PROMPT, STEP_TIMEOUT_S, out, "lone", on_event=lone,
                       sampling=a_sampling).join(120)
        assert out["lone"][:2] == ("ok", "length"), out
        assert [_row(t) for t in lone] == [_row(t) for t in want_a]
        assert (s.loops, s.steps, s.hand_backs) == (1, 0, 0)   # the last stage stepped it alone

        a_tokens, b_tokens = _Tokens(), _Tokens()
        a = pumped.request(0, A_PROMPT, STEP_TIMEOUT_S, out, "a", on_event=a_tokens,
                           sampling=a_sampling)
        until(lambda: len(a_tokens) >= JOIN_AT)
        b = pumped.request(1, B_PROMPT, STEP_TIMEOUT_S, out, "b", on_event=b_tokens,
                           sampling=b_sampling)
        b.join(120)
        a.join(120)
    finally:
        pumped.stop()
    assert out["a"][:2] == ("ok", "length") and out["b"][:2] == ("ok", "length"), out
    assert not pumped.failure
    assert [_row(t) for t in a_tokens] == [_row(t) for t in want_a]
    assert [_row(t) for t in b_tokens] == [_row(t) for t in want_b]
    handed = [i for i, t in enumerate(a_tokens) if t.handed_back]
    assert len(handed) == 1 and JOIN_AT <= handed[0] < A_TOKENS - B_TOKENS, handed
    assert s.hand_backs == 1 and 1 <= s.most_hand_back_tokens <= HAND_BACK_BOUND, \
        s.most_hand_back_tokens
    # A's first loop, then the batched steps beside B, then (B done) a loop of its own again
    assert s.loops == 3 and s.steps >= B_TOKENS - 1, (s.loops, s.steps)
    assert not any(t.handed_back for t in b_tokens)


@pytest.mark.timeout(180)
def test_a_looping_request_cancelled_mid_run_or_while_handed_back_ends_cleanly(pipeline):
    """A looping request cancelled mid-run ends "cancelled" at once, its step in flight dropped:
    the next request in its session gets its one-request tokens. One cancelled while its
    HandBack goes (B just admitted) ends "cancelled" too, and B gets its tokens."""
    launch, plan = pipeline
    greedy = _sampling("greedy", 4000, A_PROMPT)
    _, want_b = _one_request_path(launch, plan, 1, B_PROMPT, _sampling("greedy", B_TOKENS,
                                                                        B_PROMPT))
    pumped = Pumped(launch.coordinator, plan.prompt_chunk)
    out: dict = {}
    try:
        a_tokens, cancel = _Tokens(), threading.Event()
        a = pumped.request(0, A_PROMPT, STEP_TIMEOUT_S, out, "a", on_event=a_tokens,
                           cancel=cancel, sampling=greedy)
        until(lambda: len(a_tokens) >= JOIN_AT)
        cancelled_at = time.monotonic()
        cancel.set()
        a.join(30)
        assert out["a"][:2] == ("ok", "cancelled"), out
        assert time.monotonic() - cancelled_at < 10, "the cancel was not prompt"
        assert len(a_tokens) < 4000
        b_tokens = _Tokens()      # in A's session: whatever A left in flight is gone
        pumped.request(0, B_PROMPT, STEP_TIMEOUT_S, out, "b", on_event=b_tokens,
                       sampling=_sampling("greedy", B_TOKENS, B_PROMPT)).join(60)
        assert out["b"][:2] == ("ok", "length"), out
        assert [_row(t) for t in b_tokens] == [_row(t) for t in want_b]

        a_tokens, cancel, b_tokens = _Tokens(), threading.Event(), _Tokens()
        a = pumped.request(0, A_PROMPT, STEP_TIMEOUT_S, out, "a2", on_event=a_tokens,
                           cancel=cancel, sampling=greedy)
        until(lambda: len(a_tokens) >= JOIN_AT)
        b = pumped.request(1, B_PROMPT, STEP_TIMEOUT_S, out, "b2", on_event=b_tokens,
                           sampling=_sampling("greedy", B_TOKENS, B_PROMPT))
        until(lambda: pumped.scheduler.hand_backs >= 1)
        cancel.set()
        a.join(30)
        b.join(60)
    finally:
        pumped.stop()
    assert out["a2"][:2] == ("ok", "cancelled"), out
    assert out["b2"][:2] == ("ok", "length"), out
    assert [_row(t) for t in b_tokens] == [_row(t) for t in want_b]
    assert not pumped.failure


@pytest.mark.timeout(120)
def test_a_looping_request_on_a_silent_pipeline_fails_in_bounded_time(pipeline):
    """The last stage stopped (SIGSTOP) while it loops a lone request: the head, which sends no
    step of it, still fails it after its step timeout (RankFailure naming what never came)."""
    launch, plan = pipeline
    coord = launch.coordinator
    last = next(s for s in coord.ranks if s.assign is not None and s.assign.last)
    pumped = Pumped(coord, plan.prompt_chunk)
    out: dict = {}
    a_tokens = _Tokens()
    try:
        a = pumped.request(0, A_PROMPT, 1.0, out, "a", on_event=a_tokens,
                           sampling=_sampling("greedy", 4000, A_PROMPT))
        until(lambda: len(a_tokens) >= JOIN_AT)
        os.kill(last.register.pid, signal.SIGSTOP)
        try:
            a.join(30)
        finally:
            os.kill(last.register.pid, signal.SIGCONT)
    finally:
        pumped.stop()
    kind, error, took = out["a"]
    assert kind == "error" and isinstance(error, RankFailure), out
    assert "no a token for 1 s from the pipeline" in str(error), out
    assert pumped.failure and isinstance(pumped.failure[0], RankFailure)


@pytest.mark.timeout(120)
def test_a_looping_request_whose_rank_dies_fails_with_a_message(pipeline):
    """(Last: the pipeline does not survive it.) A stage rank killed while the last stage loops a
    lone request: the request fails at once with a RankFailure naming the rank."""
    launch, plan = pipeline
    coord = launch.coordinator
    first = next(s for s in coord.ranks if s.assign is not None and s.assign.first)
    pumped = Pumped(coord, plan.prompt_chunk)
    out: dict = {}
    a_tokens = _Tokens()
    try:
        a = pumped.request(0, A_PROMPT, STEP_TIMEOUT_S, out, "a", on_event=a_tokens,
                           sampling=_sampling("greedy", 4000, A_PROMPT))
        until(lambda: len(a_tokens) >= JOIN_AT)
        killed_at = time.monotonic()
        os.kill(first.register.pid, signal.SIGKILL)
        a.join(30)
    finally:
        pumped.stop()
    kind, error, took = out["a"]
    assert kind == "error" and isinstance(error, RankFailure), out
    assert f"rank {first.rank}" in str(error), out
    assert time.monotonic() - killed_at < 20, "the dead rank was not noticed in bounded time"


def test_the_last_stage_loops_a_plain_step_until_a_hand_back_and_spends_it_once(tmp_path):
    """StageStep on a stage that is first and last: a head_steps prompt answers its first Token
    only; a plain decode step of it loops (its next step to the first stage); after a HandBack
    the next plain step answers a Token `handed_back` and no next step, once: the one after
    loops again. A HandBack of a request that is not there, or on a stage that is not last,
    changes nothing."""
    from protocol import HandBack, Token, Tokens
    from strata_dist.rank.stage import Stage, StageConfig
    from strata_dist.rank.stage_step import StageStep, To

    path = tmp_path / "tiny.gguf"
    write_synthetic(str(path), like="tiny", quant="f32")
    stage = Stage(StageConfig(model_path=str(path), device="cpu", lb=0, le=4, first=True,
                              last=True, max_context=64))
    step = StageStep(stage, 0, last=True)
    out = step.step(Tokens(request_id=3, session_id=0, pos=0, ids=A_PROMPT,
                           sampling=Sampling(max_new=20, head_steps=True)))
    token = out[-1].msg
    assert [o.to for o in out if isinstance(o.msg, Token)] == [To.HEAD] and not token.handed_back

    def plain(tok: Token) -> list:
        return step.step(Tokens(request_id=3, session_id=0, pos=tok.pos, ids=[tok.token_id]))

    looped = plain(token)
    assert [o.to for o in looped] == [To.HEAD, To.FIRST]
    assert step._ahead(looped[-1].msg)        # greedy: a step ahead may be launched (a GPU's)
    assert step.step(HandBack(request_id=99)) == []          # no such request: nothing
    assert step.step(HandBack(request_id=3)) == []
    assert not step._ahead(looped[-1].msg)                    # no step ahead: the head sends it
    handed = plain(looped[0].msg)
    assert [o.to for o in handed] == [To.HEAD] and handed[0].msg.handed_back
    again = plain(handed[0].msg)                              # spent: a later plain step loops
    assert [o.to for o in again] == [To.HEAD, To.FIRST] and not again[0].msg.handed_back
    middle = StageStep(stage, 0, last=False)
    assert middle.step(HandBack(request_id=3)) == []


@pytest.mark.parametrize("like, ahead", [("tiny", True), ("tiny-next", False)])
def test_a_looping_parallel_request_launches_no_step_ahead_on_recurrent_layers(tmp_path, like,
                                                                               ahead):
    """Under --parallel another request's prompt can reach the stage between a looping request's
    steps: a step launched ahead is then dropped and run again (DecodeGraph.settle). That rewrites
    the same KV cells (qwen3moe: the step ahead stays allowed), but a recurrent layer's state is
    updated in place and would take the token twice, so a shared request on qwen3next launches
    none; the same request without --parallel still may."""
    from protocol import Tokens
    from strata_dist.rank.stage import Stage, StageConfig
    from strata_dist.rank.stage_step import StageStep

    path = tmp_path / f"{like}.gguf"
    write_synthetic(str(path), like=like, quant="f32")
    from strata_dist.gguf_file.reader import GGUFModel
    layers = GGUFModel(str(path)).arch_int("block_count", required=True, minimum=1)
    stage = Stage(StageConfig(model_path=str(path), device="cpu", lb=0, le=layers, first=True,
                              last=True, max_context=64))
    step = StageStep(stage, 0, last=True)
    for request_id, shared in ((3, True), (4, False)):
        out = step.step(Tokens(request_id=request_id, session_id=0, pos=0, ids=A_PROMPT,
                               sampling=Sampling(max_new=20, head_steps=shared)))
        if shared:        # the head sends the first decode step: it loops from there
            token = out[-1].msg
            out = step.step(Tokens(request_id=request_id, session_id=0, pos=token.pos,
                                   ids=[token.token_id]))
        [looped] = [o.msg for o in out if isinstance(o.msg, Tokens)]
        assert step._ahead(looped) is (ahead or not shared), (like, shared)
