"""Structured output end to end: the official client against `strata-launch --port` on two CPU
stage ranks of a tiny random model (random weights: the text is noise, so whatever shape the answer
has comes from the grammar). JSON-schema answers at temperature 1 validate against their schema
(checked by `jsonschema`), json_object answers are JSON objects, a Lark grammar's answers match it
(checked by `re`), streaming gives the same text, and each refused form is a 400 naming its field."""
from __future__ import annotations

import concurrent.futures as cf
import json
import re

import jsonschema
import openai
import pytest

from protocol import ProtocolError, Error, Token, Tokens
from protocol.codec import decode, encode
from protocol.messages import MAX_GRAMMAR_BYTES, Sampling
from server_helpers import client_fixture, server_fixture, tiny_model_fixture
from strata_dist.rank.stage import Stage, StageConfig
from strata_dist.rank.stage_step import StageStep, To
from strata_dist.gguf_file.tokenizer import GGUFTokenizer

pytestmark = pytest.mark.timeout(120)

# short keys and bounded values, so an answer closes within MAX_TOKENS whatever the draws
SCHEMA = {"type": "object",
          "properties": {"n": {"type": "string", "maxLength": 4},
                         "k": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "boolean"},
                         "c": {"enum": ["red", "blue"]}},
          "required": ["n", "k", "b", "c"], "additionalProperties": False}
MAX_TOKENS = 64
SEEDS = range(100)
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
# a Lark grammar: a greeting, a number of one to three digits
LARK = 'start: ("hi" | "yo") " " /[0-9]{1,3}/'
LARK_MATCH = re.compile(r"(hi|yo) [0-9]{1,3}")
MESSAGES = [{"role": "user", "content": "Describe a thing."}]


model = tiny_model_fixture("structured", popularity="zipf:1.0")
# two stages: the grammar rides the first stage's Hidden rows on to the last
server = server_fixture("--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G",
                        "--max-context", "1024", "--gpu-order", "as_given")
client = client_fixture()


def chat(client, seed: int, **kw):
    kw.setdefault("response_format", RESPONSE_FORMAT)
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0,
                                          seed=seed, **kw)


def test_json_schema_answers_validate_against_the_schema(client):
    with cf.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda seed: chat(client, seed), SEEDS))
    texts = [a.choices[0].message.content for a in answers]
    for a, text in zip(answers, texts):
        assert a.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > len(texts) // 2, "the draws are random: the answers differ"
    # the reference: the same requests without response_format are noise
    free = [chat(client, seed, response_format=None).choices[0].message.content for seed in range(5)]
    assert not any(_is_json_object(t) for t in free), free


def test_a_streamed_answer_is_the_same_json(client):
    whole = chat(client, 7).choices[0].message.content
    pieces, finish = [], None
    for chunk in chat(client, 7, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == whole and finish == "stop"
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_json_object_answers_are_json_objects(client):
    closed = 0
    for seed in range(5):
        r = chat(client, seed, response_format={"type": "json_object"}, max_tokens=200)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:   # a free object may run past max_tokens: then it is a cut-off prefix of one
            assert r.choices[0].message.content.startswith("{")
        closed += r.choices[0].finish_reason == "stop"
    assert closed, "some answer closes its object"


def test_a_lark_grammar_is_followed(client):
    for seed in range(10):
        r = chat(client, seed, response_format=None, extra_body={"grammar": LARK})
        assert LARK_MATCH.fullmatch(r.choices[0].message.content), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"


def test_completions_take_a_schema_too(client):
    r = client.completions.create(model="tiny", prompt="A thing:", temperature=1.0, seed=3,
                                  max_tokens=MAX_TOKENS, extra_body={"response_format": RESPONSE_FORMAT})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_max_tokens_too_small_to_close_the_json_ends_with_length(client):
    r = chat(client, 1, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.choices[0].message.content.startswith('{"n":')


SCHEMA_PARAM = "response_format.json_schema.schema"
REFUSED = [   # (the request's extra fields, the field the 400 names, its code)
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"response_format": "json"}, "response_format", "invalid_type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "invalid_type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     SCHEMA_PARAM, "invalid_type"),
    # schemas the engine refuses: an unknown type, and a pattern that is no regex
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     SCHEMA_PARAM, "invalid_grammar"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}},
     SCHEMA_PARAM, "invalid_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 5, "schema": SCHEMA}}},
     "response_format.json_schema.name", "invalid_type"),
    ({"grammar": "start: undefined_rule"}, "grammar", "invalid_grammar"),
    ({"grammar": 12}, "grammar", "invalid_type"),
    ({"grammar": "  "}, "grammar", "invalid_value"),
    ({"grammar": LARK, "response_format": {"type": "json_object"}}, "grammar", "invalid_value"),
    ({"grammar": 'start: "' + "x" * 70000 + '"'}, "grammar", "invalid_value"),
]


@pytest.mark.parametrize("extra,param,code", REFUSED,
                         ids=[f"{p}-{c}-{i}" for i, (_, p, c) in enumerate(REFUSED)])
def test_each_refused_form_is_a_400_naming_the_field(client, extra, param, code):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                       extra_body=extra)
    assert e.value.status_code == 400
    assert (e.value.body["param"], e.value.body["code"]) == (param, code), e.value.body
    assert f"'{param}'" in e.value.body["message"], e.value.body


def test_a_refused_schema_names_the_engines_reason(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, 0, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "frobnicate"}}})
    assert "frobnicate" in e.value.body["message"]


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


# ---- the last stage alone, and the wire -------------------------------------------------------------

def _run_alone(step: StageStep, request_id: int, sampling: Sampling, prompt: list[int]) -> list:
    """A prompt through a stage that is first and last, its decode steps fed back by hand: what
    went to the head."""
    pending = step.step(Tokens(request_id=request_id, session_id=0, pos=0, ids=prompt,
                               sampling=sampling))
    to_head = []
    while pending:
        to_head += [o.msg for o in pending if o.to is To.HEAD]
        nxt = [o.msg for o in pending if o.to is To.FIRST]
        pending = step.step(nxt[0]) if nxt else []
    return to_head


def test_a_grammar_the_rank_cannot_build_fails_its_request_and_the_rank_serves_on(model):
    """A grammar that reached the rank unchecked (not through the server) ends its request with an
    Error naming the engine's reason; the next request follows its grammar."""
    step = StageStep(Stage(StageConfig(model, "cpu", 0, 4, True, True, 256)), rank=0, last=True)
    prompt = GGUFTokenizer.from_gguf(model).encode("A number:")
    sent = _run_alone(step, 1, Sampling(temperature=1.0, seed=1, max_new=8, grammar_kind="lark",
                                        grammar="start: undefined_rule"), prompt)
    errors = [m for m in sent if isinstance(m, Error)]
    assert len(errors) == 1 and "undefined_rule" in errors[0].message and not step.requests
    sent = _run_alone(step, 2, Sampling(temperature=1.0, seed=1, max_new=8, grammar_kind="lark",
                                        grammar=LARK), prompt[:3])
    tokens = [m for m in sent if isinstance(m, Token)]
    text = GGUFTokenizer.from_gguf(model).decode([t.token_id for t in tokens])
    assert LARK_MATCH.fullmatch(text) and tokens[-1].reason == "stop", text


@pytest.mark.parametrize("fields", [{"grammar_kind": "lark"}, {"grammar": LARK},
                                    {"grammar_kind": "regex", "grammar": "a+"},
                                    {"grammar_kind": "lark", "grammar": "x" * (MAX_GRAMMAR_BYTES + 1)}])
def test_the_wire_refuses_a_grammar_without_its_kind_or_past_its_cap(fields):
    with pytest.raises(ProtocolError, match="grammar"):
        decode([bytes(f) for f in encode(Tokens(request_id=1, session_id=0, pos=0, ids=[1],
                                                sampling=Sampling(max_new=1, **fields)))])
