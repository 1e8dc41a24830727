"""A prompt chunk's Sampling is bounded by the chunk: of the prompt's ids each chunk carries only its
share (its rows' and the one after its last row; the first chunk's from position 0) and the grammar
rides only on the final chunk (PROTOCOL.md, `Sampling`). Checked on the head's real send path
(Coordinator._send_chunk over a real ZeroMQ socket, the real codec), and on two real stages of a
tiny model, whose last stage joins the shares: its repetition penalty counts the whole prompt and
its prompt logprobs equal a log-softmax written here in numpy, and it keeps no ids once the prompt
ends, is cancelled or fails."""
import numpy as np
import pytest
import zmq

from hf_fixtures import tiny_qwen3moe, write_gguf
from protocol import Cancel, Channel, Error, Hidden, PromptProgress, Token, Tokens
from protocol.codec import decode
from strata_dist.head.coordinator import Coordinator, chunk_sampling
from strata_dist.head.session import LogprobRequest, _sampling
from strata_dist.sampling.sampler import SamplingParams
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.rank.stage import Stage, StageConfig
from strata_dist.rank.stage_step import StageStep, To

CTX = 128
LAYERS = 4
CHUNK = 4
PENALTY = 1.8
# a Lark grammar of ~30 KB: the whole of it rode in every chunk before
GRAMMAR = "start: WORD\nWORD: " + " | ".join(f'"w{i:05d}"' for i in range(3500)) + "\n"


def test_every_chunk_on_the_wire_is_bounded_by_the_chunk(tmp_path):
    """20,000 prompt ids in chunks of 64 with a repetition penalty, prompt logprobs and a grammar:
    each chunk's header as the head sends it stays within a few KiB plus its rows (it carried
    the whole prompt, ~100 KB, and the grammar), and the shares join into the prompt."""
    ep = f"ipc://{tmp_path}/"
    coord = Coordinator(b"k" * 32, "fp", ep + "c", ep + "h")
    first = Channel("pull", peer="first stage")
    sender = Channel("push", peer="first stage").connect(first.bind(ep + "first"))
    ids = [(7919 * i) % 150_000 for i in range(20_000)]
    params = SamplingParams(repetition_penalty=PENALTY, grammar_kind="lark", grammar=GRAMMAR)
    sampling = _sampling(params, LogprobRequest(tokens=True, top=5, prompt=True), ids,
                         max_new=16, stop_ids=[2])
    chunk = 64
    parts = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    joined: list[int] = []
    grammar_bytes = len(GRAMMAR.encode())
    try:
        for i, part in enumerate(parts):
            coord._send_chunk(sender, 1, 0, i * chunk, part, i, len(parts), sampling, ())
            assert first.socket.poll(5000, zmq.POLLIN)
            frames = first.socket.recv_multipart()
            msg, _ = decode(frames)
            final = i == len(parts) - 1
            bound = 4096 + 2 * 9 * (len(part) + 1) + (grammar_bytes if final else 0)
            assert len(frames[0]) < bound, (i, len(frames[0]), bound)
            s = msg.sampling
            assert (s.grammar_kind, s.grammar) == (("lark", GRAMMAR) if final else ("", ""))
            assert s.prompt_ids[0] == ids[i * chunk] and s.prompt_ids[1:len(part)] == part[1:]
            joined[i * chunk:] = s.prompt_ids
        assert joined == ids
    finally:
        for ch in (first, sender):
            ch.close()
        coord.shutdown()


def test_a_chunk_asks_no_ids_unless_the_last_stage_needs_them():
    sampling = _sampling(SamplingParams(), LogprobRequest(tokens=True), list(range(50)),
                         max_new=1, stop_ids=[])
    assert all(chunk_sampling(sampling, p, 8, p // 8, 7).prompt_ids == [] for p in range(0, 50, 8))
    # a reused prefix (the first chunk read at pos 40) is counted by the penalty: from 0
    sampling = _sampling(SamplingParams(repetition_penalty=1.1), LogprobRequest(), list(range(50)),
                         max_new=1, stop_ids=[])
    assert chunk_sampling(sampling, 40, 8, 0, 2).prompt_ids == list(range(49))
    assert chunk_sampling(sampling, 48, 2, 1, 2).prompt_ids == [48, 49]   # clipped to the prompt


# ---- two real stages ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_gguf(tiny_qwen3moe(3, n_layers=LAYERS),
                          tmp_path_factory.mktemp("chunks") / "m.gguf"))


@pytest.fixture(scope="module")
def logits_of(model):
    runner = SingleProcessRunner(model, "cpu", max_context=CTX, prompt_chunk=CHUNK)
    return lambda ids: runner.logits(list(ids)).astype(np.float64)


def _steps(model):
    first = Stage(StageConfig(model, "cpu", 0, 2, True, False, CTX))
    last = Stage(StageConfig(model, "cpu", 2, LAYERS, False, True, CTX))
    return StageStep(first, rank=0, last=False), StageStep(last, rank=1, last=True)


def _chunks(request_id, ids, sampling, pos=0):
    """The request's prompt chunks from position pos, as the coordinator builds them."""
    parts = [ids[i:i + CHUNK] for i in range(pos, len(ids), CHUNK)]
    return [Tokens(request_id=request_id, session_id=0, pos=pos + i * CHUNK, ids=part,
                   chunk_index=i, chunk_total=len(parts),
                   sampling=chunk_sampling(sampling, pos + i * CHUNK, len(part), i, len(parts)))
            for i, part in enumerate(parts)]


def _through(steps, msg):
    out = steps[0].step(msg)
    assert [o.to for o in out] == [To.NEXT] and isinstance(out[0].msg, Hidden)
    # the stage forwards the chunk's share, no more
    assert out[0].msg.sampling.prompt_ids == msg.sampling.prompt_ids
    return steps[1].step(out[0].msg, out[0].rows)


def _penalized_prompt(logits_of):
    """A prompt whose greedy next token is one of its first chunk's ids and no later one's: only a
    penalty over the whole prompt moves the choice off it."""
    for t in range(320):
        q = [t, 17, 5, 42, 7, 11, 2, 9, 30, 4, 61, 93, 88]
        nxt = int(np.argmax(logits_of(q)[-1]))
        if nxt in q[:CHUNK] and nxt not in q[CHUNK:]:
            return q
    pytest.skip("no prompt of this form repeats a first-chunk token")


def _penalized_greedy(row, prompt):
    row = row.copy()
    for t in set(prompt):
        row[t] = row[t] / PENALTY if row[t] > 0 else row[t] * PENALTY
    return int(np.argmax(row))


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_the_last_stage_joins_the_shares(model, logits_of):
    """The penalty counts ids of the first chunk at the final one; each chunk's prompt logprobs
    are of the next prompt token; nothing is kept once the prompt ends."""
    prompt = _penalized_prompt(logits_of)
    rows = logits_of(prompt)
    sampling = _sampling(SamplingParams(repetition_penalty=PENALTY),
                         LogprobRequest(prompt=True, top=2), prompt, max_new=1, stop_ids=[])
    steps = _steps(model)
    got_lp, token = [], None
    for msg in _chunks(1, prompt, sampling):
        out = _through(steps, msg)
        progress = out[0].msg
        assert isinstance(progress, PromptProgress)
        got_lp += progress.logprobs
        if msg.chunk_index < msg.chunk_total - 1:
            assert len(steps[1].prompt_ids[1]) == msg.pos + CHUNK + 1
        else:
            token = out[1].msg
    want_lp = _log_softmax(rows)[np.arange(len(prompt) - 1), prompt[1:]]
    assert np.abs(np.array(got_lp) - want_lp).max() <= 1e-4
    assert isinstance(token, Token)
    assert token.token_id == _penalized_greedy(rows[-1], prompt) != int(np.argmax(rows[-1]))
    assert steps[1].prompt_ids == {}


def test_a_reused_prefix_counts_for_the_penalty(model, logits_of):
    """The first chunk read at pos > 0 (the stages hold what comes before) carries the prompt from
    position 0: the penalty still counts the prefix's ids."""
    prompt = _penalized_prompt(logits_of)
    rows = logits_of(prompt)
    steps = _steps(model)
    plain = _sampling(SamplingParams(), LogprobRequest(), prompt, max_new=0, stop_ids=[])
    for msg in _chunks(1, prompt[:8], plain):
        _through(steps, msg)
    penalized = _sampling(SamplingParams(repetition_penalty=PENALTY), LogprobRequest(), prompt,
                          max_new=1, stop_ids=[])
    chunks = _chunks(2, prompt, penalized, pos=8)
    assert chunks[0].sampling.prompt_ids[:8] == prompt[:8]
    out = []
    for msg in chunks:
        out = _through(steps, msg)
    assert out[1].msg.token_id == _penalized_greedy(rows[-1], prompt)
    assert steps[1].prompt_ids == {}


def test_a_cancelled_or_failed_prompt_leaves_no_ids(model):
    steps = _steps(model)
    prompt = list(range(3, 23))
    sampling = _sampling(SamplingParams(repetition_penalty=PENALTY), LogprobRequest(prompt=True),
                         prompt, max_new=4, stop_ids=[])
    chunks = _chunks(5, prompt, sampling)
    for msg in chunks[:2]:
        _through(steps, msg)
    assert steps[1].prompt_ids == {5: prompt[:2 * CHUNK + 1]}
    out = steps[1].step(Cancel(request_id=5))
    assert [o.msg.reason for o in out] == ["cancelled"]
    assert steps[1].prompt_ids == {}
    steps[0].step(Cancel(request_id=5))
    # a chunk whose share does not follow the ids read: the request fails, its ids go with it
    chunks = _chunks(6, prompt, sampling)
    _through(steps, chunks[0])
    out = _through(steps, chunks[2])
    assert len(out) == 1 and isinstance(out[0].msg, Error) and "prompt ids" in out[0].msg.message
    assert steps[1].prompt_ids == {}
