"""The stage step without sockets: two real stages of a tiny model, messages handed from one
step's outbound list to the next step by hand, as the ranks' shells would send them. The tokens
equal the single-process SingleProcessRunner's; cancel, stale rows and a failing request answer as the head
expects."""
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from protocol import Cancel, Error, Hidden, PromptProgress, Release, Token, Tokens
from protocol.messages import Sampling
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.rank.stage import Stage, StageConfig
from strata_dist.rank.stage_step import StageStep, To

CTX = 128
LAYERS = 6
PROMPT = [3, 17, 5, 42, 7, 11, 2, 9, 30, 4]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_gguf(tiny_qwen3moe(8, n_layers=LAYERS), tmp_path_factory.mktemp("step") / "m.gguf"))


def _steps(model, split=3, min_request_id=0):
    # the first stage caches some pairs and lends two slots to prompts
    first = Stage(StageConfig(model, "cpu", 0, split, True, False, CTX,
                              cache_pairs=[(0, e) for e in range(4)], loan_slots=2))
    last = Stage(StageConfig(model, "cpu", split, LAYERS, False, True, CTX))
    return (StageStep(first, rank=0, last=False),
            StageStep(last, rank=1, last=True, min_request_id=min_request_id))


def _through(steps, msg):
    """One message through the first stage's step and on through the last's; what the last sends."""
    a, b = steps
    out = a.step(msg)
    assert [o.to for o in out] == [To.NEXT] and isinstance(out[0].msg, Hidden)
    assert out[0].msg.shape == [int(d) for d in out[0].rows.shape]
    return b.step(out[0].msg, out[0].rows)


def _prompt(request_id, max_new, chunk=4, stop_ids=()):
    sampling = Sampling(max_new=max_new, stop_ids=list(stop_ids))
    chunks = [PROMPT[i:i + chunk] for i in range(0, len(PROMPT), chunk)]
    return [Tokens(request_id=request_id, session_id=0, pos=i * chunk, ids=c, chunk_index=i,
                   chunk_total=len(chunks), sampling=sampling) for i, c in enumerate(chunks)]


def _generate(steps, request_id, max_new):
    tokens = []
    pending = None
    for msg in _prompt(request_id, max_new):
        sent = _through(steps, msg)
        assert isinstance(sent[0].msg, PromptProgress) and sent[0].to is To.HEAD
        pending = sent[1:]
    while pending:
        head = [o.msg for o in pending if o.to is To.HEAD]
        assert len(head) == 1 and isinstance(head[0], Token)
        tokens.append(head[0].token_id)
        nxt = [o.msg for o in pending if o.to is To.FIRST]
        if head[0].done:
            assert head[0].reason == "length" and not nxt
            break
        assert nxt[0].ids == [head[0].token_id] and nxt[0].pos == len(PROMPT) + len(tokens) - 1
        pending = _through(steps, nxt[0])
    return tokens


def test_steps_make_the_engines_tokens(model):
    want = SingleProcessRunner(model, "cpu", max_context=CTX, prompt_chunk=4).generate(PROMPT, 6).tokens
    steps = _steps(model)
    assert _generate(steps, 1, 6) == list(want)
    assert steps[1].counters["tokens"] == 5 and steps[1].counters["chunks"] == 3
    assert steps[0].counters["rows"] == len(PROMPT) + 5
    # Release goes on from the first stage to the next and ends at the last
    assert [o.to for o in steps[0].step(Release(session_id=0))] == [To.NEXT]
    assert steps[1].step(Release(session_id=0)) == []


def test_cancel_answers_once_and_drops_the_step_in_flight(model):
    steps = _steps(model)
    sent = []
    for msg in _prompt(7, 10):
        sent = _through(steps, msg)
    in_flight = [o.msg for o in sent if o.to is To.FIRST][0]
    out = steps[1].step(Cancel(request_id=7))
    assert [(o.to, o.msg.reason, o.msg.done) for o in out] == [(To.HEAD, "cancelled", True)]
    assert steps[1].step(Cancel(request_id=7)) == []      # told once
    assert _through(steps, in_flight) == []               # the step in flight makes no token


def test_a_replacement_drops_rows_of_the_lost_request(model):
    steps = _steps(model, min_request_id=5)
    out = steps[0].step(_prompt(4, 2)[0])
    assert steps[1].step(out[0].msg, out[0].rows) == []
    assert steps[1].counters["stale_dropped"] == 1 and steps[1].counters["chunks"] == 0


def test_a_failing_request_is_an_error_to_the_head_and_the_stage_goes_on(model):
    steps = _steps(model)
    bad = Tokens(request_id=3, session_id=0, pos=CTX - 1, ids=[1, 2, 3],
                 sampling=Sampling(max_new=1))      # runs past the session's context
    out = steps[0].step(bad)
    assert len(out) == 1 and out[0].to is To.HEAD and isinstance(out[0].msg, Error)
    assert out[0].msg.request_id == 3 and out[0].msg.message.startswith("rank 0: ")
    assert steps[0].counters["errors"] == 1
    assert not steps[0].stage.cache.lent      # the failed prompt gave its loan back
    assert _generate(steps, 4, 3) == list(SingleProcessRunner(model, "cpu", max_context=CTX,
                                                 prompt_chunk=4).generate(PROMPT, 3).tokens)
