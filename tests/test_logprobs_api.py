"""Logprobs, echo, n choices, penalties and logit_bias on a real `strata-launch --port` (two CPU
stages, prompt chunks of 8 tokens), driven by the official `openai` client. The numbers are checked
against a log-softmax and penalties written plainly in numpy here, over the logits of the
single-process forward (which tests/test_qwen3moe_reference.py holds to transformers)."""
from __future__ import annotations


import httpx
import numpy as np
import openai
import pytest

from server_helpers import client_fixture, server_fixture, tiny_model_fixture, tokenizer_fixture
from strata_dist.tools.single_process import SingleProcessRunner

RANK_ARGS = ("--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G", "--max-context", "4096",
             "--gpu-order", "as_given", "--prefill", "8")
LONG = {"ignore_eos": True}
PROMPT = [11, 300, 42, 7, 199, 23, 400, 5, 77, 310, 2, 64, 128, 9, 251, 33, 18, 444, 90]  # 3 chunks
TOL = 1e-4

pytestmark = pytest.mark.timeout(120)


model = tiny_model_fixture("logprobs", popularity="zipf:1.0")
server = server_fixture(*RANK_ARGS, clean_exit=True)
client = client_fixture()
tok = tokenizer_fixture()


@pytest.fixture(scope="module")
def reference(model):
    runner = SingleProcessRunner(model)
    return lambda ids: runner.logits(list(ids)).astype(np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def text_of(tok, t: int) -> str:
    return tok.decode([t], skip_special=False)


def top_dict(tok, row: np.ndarray, n: int) -> dict[str, float]:
    """The n most likely tokens of one log-softmax row as the completions format lists them (by
    text: tokens of the same text collapse, the less likely one listed last)."""
    order = sorted(range(row.size), key=lambda t: (-row[t], t))[:n]
    return {text_of(tok, t): float(row[t]) for t in order}


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def assert_close_dicts(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert abs(got[k] - want[k]) <= TOL, (k, got[k], want[k])


# ---- logprobs against the reference ---------------------------------------------------------------------

def test_echo_and_logprobs_equal_numpy_log_softmax(client, tok, reference):
    """Completions with echo: the prompt's tokens first (the first one's logprob null), then the
    generated ones; every logprob and top-5 is the reference's log-softmax within 1e-4."""
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=5, echo=True, extra_body=LONG)
    c = r.choices[0]
    gen = ids_of(c)
    assert len(gen) == 5
    full = PROMPT + gen
    lsm = log_softmax(reference(full[:-1]))
    lp = c.logprobs
    assert lp.tokens == [text_of(tok, t) for t in full]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(full)):
        assert abs(lp.token_logprobs[i] - lsm[i - 1, full[i]]) <= TOL, i
        assert_close_dicts(lp.top_logprobs[i], top_dict(tok, lsm[i - 1], 5))
    for i in range(len(PROMPT), len(full)):   # greedy: each generated token is the most likely
        assert full[i] == int(np.argmax(lsm[i - 1]))
    assert c.text == tok.decode(PROMPT, skip_special=False) + tok.decode(gen)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 5
    # echo without logprobs: the text only; echo with max_tokens 0: the prompt's logprobs alone
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, echo=True,
                                  extra_body=LONG)
    assert r.choices[0].logprobs is None
    assert r.choices[0].text.startswith(tok.decode(PROMPT, skip_special=False))
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    got = r.choices[0].logprobs.token_logprobs
    assert len(got) == len(PROMPT) and got[0] is None
    assert np.abs(np.array(got[1:]) - lsm[np.arange(len(PROMPT) - 1), PROMPT[1:]]).max() <= TOL


def test_chat_logprobs_streamed_and_not(client, tok, reference):
    """Chat: `logprobs` + `top_logprobs`, the same numbers streamed chunk by chunk as whole."""
    ask = dict(model="tiny", messages=[{"role": "user", "content": "count: one two three"}],
               max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body=LONG)
    whole = client.chat.completions.create(**ask).choices[0]
    gen = ids_of(whole)
    prompt = tok.encode_chat([{"role": "user", "content": "count: one two three"}])
    lsm = log_softmax(reference(prompt + gen[:-1]))[len(prompt) - 1:]
    content = whole.logprobs.content
    assert [e.token for e in content] == [text_of(tok, t) for t in gen]
    for i, e in enumerate(content):
        assert abs(e.logprob - lsm[i, gen[i]]) <= TOL
        assert e.bytes == list(e.token.encode("utf-8"))
        want = sorted(range(lsm.shape[1]), key=lambda t: (-lsm[i, t], t))[:3]
        assert [a.token for a in e.top_logprobs] == [text_of(tok, t) for t in want]
        assert np.abs(np.array([a.logprob for a in e.top_logprobs]) - lsm[i, want]).max() <= TOL
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **ask):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                streamed += ch.logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) <= TOL
    # completions streamed: the logprobs of each delta, in order
    parts = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                           logprobs=2, stream=True, extra_body=LONG))
    got = [x for p in parts for c in p.choices if c.logprobs for x in c.logprobs.token_logprobs]
    ids = [t for p in parts for c in p.choices for t in c.model_extra["token_ids"]]
    lsm = log_softmax(reference(PROMPT + ids[:-1]))[len(PROMPT) - 1:]
    assert len(got) == 4 and np.abs(np.array(got) - lsm[np.arange(4), ids]).max() <= TOL


def test_streamed_text_offsets_are_the_unstreamed_ones(client):
    """A streamed completion's text_offset follows the rule the whole reply's does (each token's
    text after the ones before it), whatever text the stream held back meanwhile (a token that
    ends inside a UTF-8 character is sent with the next)."""
    # sampled (seeded, so both replies are one answer): the tiny model's byte tokens come up
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=64, temperature=1.0, seed=7, logprobs=1,
               extra_body=LONG)
    whole = client.completions.create(**ask).choices[0].logprobs
    parts = list(client.completions.create(stream=True, **ask))
    streamed = [x for p in parts for c in p.choices if c.logprobs for x in c.logprobs.text_offset]
    assert streamed == whole.text_offset


def streamed_choices(client, **ask) -> dict[int, list]:
    """Each choice's stream chunks (index: its chunks, in order)."""
    by_index: dict[int, list] = {}
    for chunk in client.completions.create(stream=True, **ask):
        for c in chunk.choices:
            by_index.setdefault(c.index, []).append(c)
    return by_index


def test_streamed_echo_comes_first_with_its_logprobs(client, tok, reference):
    """A streamed completion with echo: each choice's first chunk is its prompt's text alone (no
    generated ids), with logprobs the prompt's tokens' (the first null, the rest numpy's
    log-softmax within 1e-4); then the generated chunks. Joined, each choice is the whole reply's
    choice: text, tokens, logprobs, text offsets. Without logprobs the echo is the text alone; with
    max_tokens 0 the echo is the whole answer."""
    second = PROMPT[:7]
    ask = dict(model="tiny", prompt=[PROMPT, second], max_tokens=4, temperature=1.0, seed=5,
               n=2, echo=True, logprobs=2, extra_body=LONG)
    whole = client.completions.create(**ask).choices
    streamed = streamed_choices(client, **ask)
    assert sorted(streamed) == [0, 1, 2, 3]
    for c in whole:
        ids = (PROMPT, second)[c.index // 2]
        first, rest = streamed[c.index][0], streamed[c.index][1:]
        assert first.text == tok.decode(ids, skip_special=False) and not ids_of(first)
        assert first.finish_reason is None
        got = first.logprobs.token_logprobs
        assert first.logprobs.tokens == [text_of(tok, t) for t in ids] and got[0] is None
        lsm = log_softmax(reference(ids[:-1]))
        assert np.abs(np.array(got[1:]) - lsm[np.arange(len(ids) - 1), ids[1:]]).max() <= TOL
        assert all(ids_of(x) for x in rest[:-1]) and rest[-1].finish_reason == "length"
        joined = [first] + rest
        assert "".join(x.text for x in joined) == c.text
        assert [t for x in joined for t in ids_of(x)] == ids_of(c)
        for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
            assert [v for x in joined if x.logprobs for v in getattr(x.logprobs, key)] == \
                getattr(c.logprobs, key), (c.index, key)
    # echo alone: the prompt's text first, no logprobs
    plain = streamed_choices(client, model="tiny", prompt="one two three", max_tokens=3,
                             temperature=0, echo=True, extra_body=LONG)[0]
    assert plain[0].text == "one two three" and plain[0].logprobs is None
    assert not ids_of(plain[0]) and len([t for x in plain for t in ids_of(x)]) == 3
    # max_tokens 0: the echo and the end
    only = streamed_choices(client, model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                            logprobs=0)[0]
    assert [x.text for x in only] == [tok.decode(PROMPT, skip_special=False), ""]
    assert len(only[0].logprobs.token_logprobs) == len(PROMPT)
    assert only[-1].finish_reason == "length"


# ---- n choices --------------------------------------------------------------------------------------------

def test_n_choices(client):
    """n = 3 with a seed: choice i is what n = 1 with seed + i gives; greedy: three equal choices.
    Usage counts every choice's tokens; a stream carries each choice's index."""
    ask = dict(model="tiny", prompt="the quick brown fox", max_tokens=5, temperature=1.0,
               extra_body=LONG)
    r = client.completions.create(n=3, seed=41, **ask)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [ids_of(client.completions.create(seed=41 + i, **ask).choices[0]) for i in range(3)]
    assert [ids_of(c) for c in r.choices] == singles
    assert len({tuple(s) for s in singles}) > 1        # the seeds differ, so do the choices
    assert r.usage.completion_tokens == 15
    g = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       n=3, max_tokens=4, temperature=0, extra_body=LONG)
    texts = [c.message.content for c in g.choices]
    assert len(g.choices) == 3 and texts[0] == texts[1] == texts[2]
    assert [c.index for c in g.choices] == [0, 1, 2]
    by_index: dict[int, list[int]] = {}
    finishes = {}
    for chunk in client.completions.create(n=2, seed=41, stream=True, **ask):
        for c in chunk.choices:
            by_index.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert by_index == {0: singles[0], 1: singles[1]} and finishes == {0: "length", 1: "length"}


def test_n_choices_read_the_prompt_once(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "n": 3, "temperature": 0,
            "cache_prompt": False, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    # the first choice reads the prompt; each later one reads only its last token again
    assert r["timings"]["prompt_read"] == len(PROMPT) + 2
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_n_choices_ended_by_a_stop_string_read_the_prompt_once(server):
    """A stop string ends a choice by cancelling its decode: the prompt the stages hold is still
    theirs, so the next choice reads only its last token again (not the whole prompt)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "cache_prompt": False, "ignore_eos": True}
    text = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()[
        "choices"][0]["text"]
    stop = text[len(text) // 2:][:2]      # met inside the answer, before max_tokens
    assert stop
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 3, "stop": [stop]},
                   timeout=30).json()
    assert [c["finish_reason"] for c in r["choices"]] == ["stop"] * 3, r
    assert r["timings"]["prompt_read"] == len(PROMPT) + 2
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_batch_of_prompts_is_choices_in_order(client, tok, reference):
    """Completions given a list of prompts (text or ids): each prompt's n choices in order, each
    what the prompt alone gives; echo and logprobs per prompt, as an evaluation harness asks."""
    second = PROMPT[:7]
    r = client.completions.create(model="tiny", prompt=[PROMPT, second], max_tokens=1, echo=True,
                                  logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, ids in zip(r.choices, (PROMPT, second)):
        lsm = log_softmax(reference(ids))
        got = c.logprobs.token_logprobs
        assert got[0] is None and len(got) == len(ids) + 1
        assert np.abs(np.array(got[1:len(ids)]) - lsm[np.arange(len(ids) - 1), ids[1:]]).max() <= TOL
        assert ids_of(c) == [int(np.argmax(lsm[-1]))]
        assert c.text.startswith(tok.decode(ids, skip_special=False))
    assert r.usage.prompt_tokens == len(PROMPT) + len(second)
    ask = dict(model="tiny", max_tokens=4, temperature=1.0, seed=9, extra_body=LONG)
    r = client.completions.create(prompt=["one two", "three four five"], n=2, **ask)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        p, j = divmod(c.index, 2)
        alone = client.completions.create(prompt=["one two", "three four five"][p],
                                          **dict(ask, seed=9 + j)).choices[0]
        assert ids_of(c) == ids_of(alone)
    assert r.usage.completion_tokens == 16


# ---- penalties and logit_bias ----------------------------------------------------------------------------

def penalized_greedy(reference, prompt, n, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """Greedy tokens with the penalties applied in plain numpy: repetition over prompt and output,
    then frequency and presence over the output, then the bias."""
    out: list[int] = []
    for _ in range(n):
        row = reference(prompt + out)[-1].copy()
        for t in set(prompt + out) if repetition != 1.0 else ():
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        for t in set(out):
            row[t] -= frequency * out.count(t) + presence
        for t, b in (bias or {}).items():
            row[t] += b
        out.append(int(np.argmax(row)))
    return out


def test_logit_bias_forces_a_token_and_frequency_penalty_stops_it(client, reference):
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=LONG)
    forced = ids_of(client.completions.create(logit_bias={"77": 100}, **ask).choices[0])
    assert forced == [77] * 8
    # a bias that makes 77 the greedy choice every time; a frequency penalty of 2 per use then
    # overtakes it after a use or two, and it comes back once others were used as often
    bias = {77: 3.0}
    repeated = ids_of(client.completions.create(logit_bias={"77": 3.0}, **ask).choices[0])
    assert repeated == [77] * 8 == penalized_greedy(reference, PROMPT, 8, bias=bias)
    got = ids_of(client.completions.create(logit_bias={"77": 3.0}, frequency_penalty=2.0,
                                           **ask).choices[0])
    want = penalized_greedy(reference, PROMPT, 8, frequency=2.0, bias=bias)
    assert got == want and got.count(77) < 4
    # presence: once per token, whatever its count; a smaller bias than it lets 77 go after one use
    got = ids_of(client.completions.create(logit_bias={"77": 1.5}, presence_penalty=2.0,
                                           **ask).choices[0])
    assert got == penalized_greedy(reference, PROMPT, 8, presence=2.0, bias={77: 1.5})
    assert got[0] == 77 and got.count(77) < 8


def test_repetition_penalty_counts_the_prompt(client, reference):
    """A prompt whose greedy next token is one of its own (found with the reference): the penalty
    moves the choice off it."""
    prompt = next(q for q in (PROMPT + [t] for t in range(512))
                  if int(np.argmax(reference(q)[-1])) in q)
    ask = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    plain = ids_of(client.completions.create(extra_body=LONG, **ask).choices[0])
    assert plain[0] in prompt
    extra = dict(LONG, repetition_penalty=1.8)
    got = ids_of(client.completions.create(extra_body=extra, **ask).choices[0])
    assert got == penalized_greedy(reference, prompt, 6, repetition=1.8)
    assert got[0] != plain[0]
    # logprobs stay the model's own: the penalty changes the choice, not the reported numbers
    r = client.completions.create(logprobs=0, extra_body=extra, **ask)
    lsm = log_softmax(reference(prompt + got[:-1]))[len(prompt) - 1:]
    assert np.abs(np.array(r.choices[0].logprobs.token_logprobs) - lsm[np.arange(6), got]).max() <= TOL


# ---- refusals ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,bad,good,field", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21},
     {"logprobs": True, "top_logprobs": 20}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"n": 0}, {"n": 2}, "n"),
    ("/v1/completions", {"n": 17}, {"n": 16}, "n"),
    ("/v1/completions", {"logprobs": 6}, {"logprobs": 5}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, {"logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"512": 1}}, {"logit_bias": {"511": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, {"logit_bias": {"5": -100}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": [1, 2]}, {"logit_bias": {"1": 2}}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 3}, {"presence_penalty": 2}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -2.5}, {"frequency_penalty": -2}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, {"repetition_penalty": 0.5}, "repetition_penalty"),
    ("/v1/completions", {"n": 2, "best_of": 3}, {"n": 2, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": ["x"] * 65}, {"prompt": ["x"] * 2}, "prompt"),
    ("/v1/completions", {"prompt": ["x", []]}, {"prompt": ["x", [5]]}, "prompt[1]"),
])
def test_bad_values_are_400_naming_the_field(client, path, bad, good, field):
    """Each bad value, sent by the official client, is a 400 naming its field; its good neighbour
    is served."""
    def post(extra):
        if "chat" in path:
            return client.chat.completions.create(model="tiny", max_tokens=1, extra_body=extra,
                                                  messages=[{"role": "user", "content": "x"}])
        return client.completions.create(model="tiny", max_tokens=1, prompt="x", extra_body=extra)

    with pytest.raises(openai.BadRequestError) as e:
        post(bad)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == field and field in err["message"], err
    assert post(good).choices


def test_the_client_sees_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       logprobs=True, top_logprobs=21)
    assert e.value.param == "top_logprobs"
