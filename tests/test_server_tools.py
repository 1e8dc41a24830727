"""Tool calls. The parser alone: the model's `<tool_call>` blocks become OpenAI `tool_calls`, whole
or streamed in pieces of any size (each answer is split at every character and must assemble to
the whole-text parse), and the request's tools and tool messages are checked. End to end: the
official client against `strata-launch --port` on a CPU rank whose model answers with a tool call
(server_helpers.write_tool_calling_model), streaming and not, and the call's round trip."""
from __future__ import annotations

import itertools
import json

import jsonschema
import openai
import pytest

from server_helpers import TOOL_ANSWER, ServerProcess, write_tool_calling_model
from strata_dist.server.openai_api import ApiError, Limits, parse_chat
from strata_dist.synth import write_synthetic
from strata_dist.gguf_file.tokenizer import GGUFTokenizer
from strata_dist.server.tools import (TAGGED_JSON, ToolCallStream, ToolRequestError, ToolUse,
                                      check_message_tools, check_tools, join_deltas, parse_tool_text,
                                      tool_format)

pytestmark = pytest.mark.timeout(60)


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def call(name: str, args: dict | str, cid: str) -> dict:
    a = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": a}}


WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

CASES = [
    # (model text, content, calls)
    (WEATHER, None, [call("get_weather", {"city": "Paris"}, "call_0")]),
    ("Let me look.\n" + WEATHER, "Let me look.", [call("get_weather", {"city": "Paris"}, "call_0")]),
    (WEATHER + "\n" + WEATHER.replace("Paris", "Köln"), None,
     [call("get_weather", {"city": "Paris"}, "call_0"), call("get_weather", {"city": "Köln"}, "call_1")]),
    (WEATHER + "\nDone.", "Done.", [call("get_weather", {"city": "Paris"}, "call_0")]),
    ('<tool_call>{"name": "now"}</tool_call>', None, [call("now", {}, "call_0")]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None,
     [call("f", '{"x": 1}', "call_0")]),
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool"}}</tool_call>', None,
     [call("f", {"s": "</tool"}, "call_0")]),
    ("no tags at all\n", "no tags at all\n", []),
    ("a < b and <tool but not a tag", "a < b and <tool but not a tag", []),
    # not a call: the raw text stays content
    ('Hi\n<tool_call>{"name": "f", "arguments": {</tool_call>', 'Hi\n<tool_call>{"name": "f", '
     '"arguments": {</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": null}</tool_call>', None, [call("f", {}, "call_0")]),
    ('<tool_call>{"name": "f", "parameters": {"a": "é"}}</tool_call>', None,
     [call("f", {"a": "é"}, "call_0")]),
    ("a\n\n<tool_call>{}</tool_call>\n b \n", "a\n\n<tool_call>{}</tool_call>\n b \n", []),
    ('x <tool_call>{"name": "f"', 'x <tool_call>{"name": "f"', []),      # cut by max_tokens
    ("<tool_call>", "<tool_call>", []),
    ("ends with <tool_c", "ends with <tool_c", []),
    (WEATHER + "\n<tool_call>oops</tool_call>", "<tool_call>oops</tool_call>",
     [call("get_weather", {"city": "Paris"}, "call_0")]),
    ("", None, []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole_text(text, content, calls):
    assert parse_tool_text(text, ids()) == (content, calls)
    if not calls:               # without a call the text is the content, unchanged
        assert content == (text or None)


@pytest.mark.parametrize("text,content,calls", CASES)
def test_stream_split_at_every_character_and_pair(text, content, calls):
    """Every split into two pieces, and into three at every pair of points of short texts: the
    deltas assemble to the whole-text answer, a name comes before its arguments."""
    cuts = [(i,) for i in range(len(text) + 1)]
    if len(text) <= 80:
        cuts += list(itertools.combinations(range(len(text) + 1), 2))
    for cut in cuts:
        bounds = (0, *cut, len(text))
        stream = ToolCallStream(ids())
        deltas = []
        for a, b in zip(bounds, bounds[1:]):
            deltas += stream.push(text[a:b])
        deltas += stream.finish()
        assert join_deltas(deltas) == (content, calls), cut
        for d in deltas:
            for c in d.get("tool_calls", ()):
                if "id" in c:
                    assert c["function"]["arguments"] == "" and c["function"]["name"]


def test_stream_content_comes_before_the_call_ends():
    """Text outside the tags is sent as it comes, not held to the end."""
    stream = ToolCallStream(ids())
    assert stream.push("Hello there") == [{"content": "Hello there"}]
    assert stream.push(" <tool") == []                      # a tag may begin: held
    assert stream.push("_call>{") == [] and stream.push('"name": "f"}') == []
    out = stream.push("</tool_call>")
    assert out[0] == {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]}
    assert out[1] == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}


def test_tool_format_follows_the_template():
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == TAGGED_JSON
    assert tool_format("{{ messages }}") is None and tool_format(None) is None


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_check_tools():
    assert check_tools({}, None) == ToolUse()
    assert check_tools({"tools": [TOOL]}, TAGGED_JSON) == ToolUse([TOOL], True)
    assert check_tools({"tools": [TOOL], "tool_choice": "auto"}, TAGGED_JSON) == ToolUse([TOOL], True)
    # none: the tools are neither shown to the model nor parsed, whatever the template
    assert check_tools({"tools": [TOOL], "tool_choice": "none"}, TAGGED_JSON) == ToolUse()
    assert check_tools({"tools": [TOOL], "tool_choice": "none"}, None) == ToolUse()
    other = {"type": "function", "function": {"name": "now"}}
    assert check_tools({"tools": [TOOL, other], "tool_choice": "required"}, TAGGED_JSON) == \
        ToolUse([TOOL, other], True, (0, 1), True)
    assert check_tools({"tools": [other, TOOL], "tool_choice": NAMED,
                        "parallel_tool_calls": False}, TAGGED_JSON) == \
        ToolUse([other, TOOL], True, (1,), False)
    with pytest.raises(ToolRequestError, match="template has no tool-call format") as e:
        check_tools({"tools": [TOOL]}, None)
    assert e.value.param == "tools"
    for bad, param in (({"tools": {}}, "tools"), ({"tools": [{"type": "function"}]}, "tools[0]"),
                       ({"tool_choice": "required"}, "tool_choice"),
                       ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
                       ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
                       ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {
                           "name": "x"}}}, "tool_choice.function.name"),
                       ({"tools": [TOOL], "parallel_tool_calls": 1}, "parallel_tool_calls")):
        with pytest.raises(ToolRequestError) as e:
            check_tools(bad, TAGGED_JSON)
        assert e.value.param == param, bad


def test_check_message_tools():
    m = {"role": "assistant", "content": None,
         "tool_calls": [call("get_weather", {"city": "Paris"}, "call_0")]}
    out = check_message_tools(0, m)
    assert out["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert check_message_tools(1, {"role": "tool", "tool_call_id": "call_0", "content": "9 C"})
    with pytest.raises(ToolRequestError) as e:
        check_message_tools(1, {"role": "tool", "content": "9 C"})
    assert e.value.param == "messages[1].tool_call_id"
    with pytest.raises(ToolRequestError) as e:
        check_message_tools(2, {"role": "user", "content": "x", "tool_calls": []})
    assert e.value.param == "messages[2].tool_calls"


# ---- end to end: a real server whose model calls a tool ----------------------------------------------

@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tool.gguf"
    write_tool_calling_model(path)
    s = ServerProcess(str(path), "--cpu-ranks", "1", "--vram-budget", "1G", "--max-context", "4096")
    yield s
    s.close()


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_tool_call_comes_back_parsed(tool_server):
    client = tool_server.client()
    r = client.chat.completions.create(model="tool", messages=ASK, tools=[WEATHER_TOOL],
                                       temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris"}
    # without tools (or with tool_choice none) the same answer is text
    for extra in ({}, {"tools": [WEATHER_TOOL], "tool_choice": "none"}):
        r = client.chat.completions.create(model="tool", messages=ASK, temperature=0, **extra)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == "".join(TOOL_ANSWER)


def test_a_tool_call_streams_name_then_arguments(tool_server):
    client = tool_server.client()
    stream = client.chat.completions.create(model="tool", messages=ASK, tools=[WEATHER_TOOL],
                                            temperature=0, stream=True)
    deltas, finish, token_ids = [], None, []
    for chunk in stream:
        c = chunk.choices[0]
        token_ids += c.model_extra["token_ids"]
        d = c.delta.model_dump(exclude_none=True)
        d.pop("role", None)
        if d.get("content") == "":
            d.pop("content")
        if d:
            deltas.append(d)
        finish = c.finish_reason or finish
    assert finish == "tool_calls"
    named = [i for i, d in enumerate(deltas) if d.get("tool_calls") and
             d["tool_calls"][0].get("function", {}).get("name")]
    argued = [i for i, d in enumerate(deltas) if d.get("tool_calls") and
              d["tool_calls"][0]["function"].get("arguments")]
    assert named and argued and named[0] < argued[0]
    content, calls = join_deltas(deltas)
    assert content == "Checking." and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert len(token_ids) == len(TOOL_ANSWER) + 1     # every token id still arrives, end included


def test_the_round_trip_renders_the_call_and_its_result(tool_server):
    """The assistant's call and the tool's answer go back in the history: accepted, and rendered
    by the template (the prompt's token count is the template's text's)."""
    client = tool_server.client()
    first = client.chat.completions.create(model="tool", messages=ASK, tools=[WEATHER_TOOL],
                                           temperature=0)
    tc = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": "9 C, rain"}]
    r = client.chat.completions.create(model="tool", messages=history, tools=[WEATHER_TOOL],
                                       temperature=0, max_tokens=3)
    tok = GGUFTokenizer.from_gguf(tool_server.model)
    rendered = tok.apply_chat_template(
        [ASK[0], {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": tc.id, "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": tc.id, "content": "9 C, rain"}], tools=[WEATHER_TOOL])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in rendered and "<tool_response>\n9 C, rain\n</tool_response>" in rendered
    assert r.usage.prompt_tokens == len(tok.encode(rendered))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tool", messages=history[:2] + [
            {"role": "tool", "content": "no id"}], tools=[WEATHER_TOOL])
    assert e.value.body["param"] == "messages[2].tool_call_id"


def test_tools_for_a_template_without_a_tool_format_are_refused(tmp_path):
    """The plain synthetic template never writes <tool_call>: tools get a 400 naming the
    template, not a silent answer without them (the real tokenizer and request parser)."""
    path = tmp_path / "plain.gguf"
    write_synthetic(path, like="tiny", quant="f32")
    tok = GGUFTokenizer.from_gguf(path)
    lim = Limits(("plain",), 4096, tok.vocab_size, tok)
    body = {"model": "plain", "messages": ASK, "tools": [WEATHER_TOOL]}
    with pytest.raises(ApiError) as e:
        parse_chat(body, lim)
    assert e.value.status == 400 and e.value.param == "tools"
    assert "chat template has no tool-call format" in e.value.message
    assert not parse_chat(dict(body, tools=None), lim).parse_tools


def test_an_answer_cut_inside_a_call_is_text_streamed_or_not(tool_server):
    """max_tokens cuts the answer at every token: streamed and whole answers agree, and a call
    cut before its closing tag comes back as the raw text, finish_reason "length"."""
    client = tool_server.client()
    for n in range(1, len(TOOL_ANSWER) + 2):
        whole = client.chat.completions.create(model="tool", messages=ASK, tools=[WEATHER_TOOL],
                                               temperature=0, max_tokens=n).choices[0]
        deltas, finish = [], None
        for chunk in client.chat.completions.create(model="tool", messages=ASK, temperature=0,
                                                    tools=[WEATHER_TOOL], max_tokens=n,
                                                    stream=True):
            d = chunk.choices[0].delta.model_dump(exclude_none=True)
            d.pop("role", None)
            deltas.append(d)
            finish = chunk.choices[0].finish_reason or finish
        content, calls = join_deltas(deltas)
        assert finish == whole.finish_reason, n
        assert content == whole.message.content, n
        assert [c["function"] for c in calls] == \
            [c.function.model_dump() for c in whole.message.tool_calls or []], n
        if n < len(TOOL_ANSWER):
            assert whole.finish_reason == "length" and not calls
            assert whole.message.content == "".join(TOOL_ANSWER[:n])
        else:
            assert whole.finish_reason == ("length" if n == len(TOOL_ANSWER) else "tool_calls")
            assert len(calls) == 1


# ---- forced calls: tool_choice "required" or a named function ------------------------------------------
# The tool model's answer is its bigram chain; under a forced call the grammar masks the chain's
# tokens out and the rest of its logits are equal: at temperature 1 the draws are uniform over
# whatever the grammar allows, so any shape the answer has comes from the grammar. The schemas
# bound every string, so an answer ends within max_tokens whatever the draws.
FORECAST = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
CLOCK = {"$defs": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "type": "object",
         "properties": {"zone": {"$ref": "#/$defs/zone"}, "h24": {"type": "boolean"}},
         "required": ["zone", "h24"], "additionalProperties": False}
FORCED_TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
                {"type": "function", "function": {"name": "clock", "parameters": CLOCK}},
                {"type": "function", "function": {"name": "now"}}]      # no parameters: {}
SCHEMAS = {"forecast": FORECAST, "clock": CLOCK,
           "now": {"type": "object", "maxProperties": 0}}


def forced(client, seed: int, **kw):
    kw.setdefault("tools", FORCED_TOOLS)
    return client.chat.completions.create(model="tool", messages=ASK, temperature=1.0, seed=seed,
                                          max_tokens=400, **kw)


def streamed_answer(stream) -> tuple[str | None, list, str | None]:
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta.model_dump(exclude_none=True)
            d.pop("role", None)
            deltas.append(d)
            finish = c.finish_reason or finish
    return (*join_deltas(deltas), finish)


def assert_valid_calls(calls, names=tuple(SCHEMAS)) -> None:
    for tc in calls:
        name, args = tc["function"]["name"], tc["function"]["arguments"]
        assert name in names, name
        jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_required_gives_one_valid_call_streamed_or_not(tool_server):
    """tool_choice "required" without parallel calls: every answer is one call of one of the
    tools whose arguments validate against its schema (jsonschema); streamed with the same seed,
    the deltas assemble to the same call."""
    client = tool_server.client()
    names = []
    for seed in range(12):
        r = forced(client, seed, tool_choice="required", parallel_tool_calls=False)
        choice = choice_of(r)
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (tc,) = choice.message.tool_calls
        assert_valid_calls([tc.model_dump()])
        names.append(tc.function.name)
        if seed < 4:
            content, calls, finish = streamed_answer(forced(
                client, seed, tool_choice="required", parallel_tool_calls=False, stream=True))
            assert (content, finish) == (None, "tool_calls")
            assert [c["function"] for c in calls] == [tc.function.model_dump()]
    assert len(set(names)) > 1, names       # any of the tools, as the draws fall


def test_a_named_function_is_the_one_called(tool_server):
    """tool_choice {"type": "function", "function": {"name": "clock"}}: every call is clock's, its
    arguments valid ($ref into the schema's own $defs included); parallel calls allowed (the
    default), so an answer may hold several, streamed as whole."""
    client = tool_server.client()
    choice = {"type": "function", "function": {"name": "clock"}}
    # After </tool_call> the model's chain puts <|im_end|> (the stop token) at a logit of 64
    # (the embeddings' norm of 8, squared) over 0 for the newline that starts another call: a
    # bias of -64 evens the two, so some answers go on to a second call.
    tok = GGUFTokenizer.from_gguf(tool_server.model)
    even = {str(tok.tk.token_to_id("<|im_end|>")): -64}
    counts = []
    for seed in range(12):
        r = choice_of(forced(client, seed, tool_choice=choice, logit_bias=even))
        assert r.finish_reason == "tool_calls" and r.message.content is None
        calls = [tc.model_dump() for tc in r.message.tool_calls]
        assert_valid_calls(calls, ("clock",))
        counts.append(len(calls))
    assert min(counts) >= 1 and max(counts) > 1, counts
    seed = counts.index(max(counts))
    content, calls, finish = streamed_answer(forced(client, seed, tool_choice=choice, stream=True,
                                                    logit_bias=even))
    assert finish == "tool_calls" and len(calls) == max(counts)
    assert_valid_calls(calls, ("clock",))
    # the tool without parameters: its arguments are the empty object
    r = choice_of(forced(client, 0, tool_choice={"type": "function", "function": {"name": "now"}},
                         parallel_tool_calls=False))
    assert [(tc.function.name, json.loads(tc.function.arguments))
            for tc in r.message.tool_calls] == [("now", {})]


def test_tool_choice_none_does_not_offer_the_tools(tool_server):
    """With tool_choice "none" the template is rendered without the tools (the prompt is the one
    without tools) and the answer is text."""
    client = tool_server.client()
    bare = client.chat.completions.create(model="tool", messages=ASK, max_tokens=1)
    offered = client.chat.completions.create(model="tool", messages=ASK, tools=FORCED_TOOLS,
                                             max_tokens=1)
    none = client.chat.completions.create(model="tool", messages=ASK, tools=FORCED_TOOLS,
                                          tool_choice="none", temperature=0)
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens < offered.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == "".join(TOOL_ANSWER)


BAD_SCHEMA_TOOLS = FORCED_TOOLS[:1] + [{"type": "function", "function": {
    "name": "broken", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(("}}}}}]
FORCED_REFUSALS = [   # (the request's fields, the field the 400 names, a word of its message)
    ({"tool_choice": "required", "tools": None}, "tool_choice", "needs 'tools'"),
    ({"tool_choice": {"type": "function", "function": {"name": "weather"}}},
     "tool_choice.function.name", "'weather'"),
    ({"tool_choice": "always"}, "tool_choice", "'always'"),
    ({"tool_choice": "required", "tools": BAD_SCHEMA_TOOLS}, "tools[1].function.parameters",
     "'broken'"),
    ({"tool_choice": {"type": "function", "function": {"name": "now"}},
      "tools": [{"type": "function", "function": {"name": "now", "parameters": [1]}}]},
     "tools[0].function.parameters", "'now'"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tool calls only"),
    ({"tool_choice": "required", "grammar": 'start: "x"'}, "grammar", "tool calls only"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tool_choice": "required", "n": 2}, "n", "'n' must be 1"),
    ({"tool_choice": "required", "stop": ["\n"]}, "stop", "cut the call"),
]


@pytest.mark.parametrize("extra,param,word", FORCED_REFUSALS,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(FORCED_REFUSALS)])
def test_each_refused_tool_form_is_a_400_naming_the_field(tool_server, extra, param, word):
    body = dict({"tools": FORCED_TOOLS}, **extra)
    with pytest.raises(openai.BadRequestError) as e:
        tool_server.client().chat.completions.create(model="tool", messages=ASK, max_tokens=4,
                                                     extra_body=body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and word in e.value.body["message"], e.value.body
    assert f"'{param}'" in e.value.body["message"], e.value.body


def test_a_refused_schema_names_the_tool_and_the_engines_reason(tool_server):
    with pytest.raises(openai.BadRequestError) as e:
        tool_server.client().chat.completions.create(
            model="tool", messages=ASK, tools=BAD_SCHEMA_TOOLS,
            tool_choice={"type": "function", "function": {"name": "broken"}})
    assert e.value.body["code"] == "invalid_grammar" and "unclosed group" in e.value.body["message"]


def test_a_streamed_round_trip(tool_server):
    """The call streamed, assembled from its deltas as a client does, sent back with the tool's
    answer, and the next answer streamed: the template renders the call and its result (the
    prompt's token count is the template's text's)."""
    client = tool_server.client()
    content, calls, finish = streamed_answer(client.chat.completions.create(
        model="tool", messages=ASK, tools=[WEATHER_TOOL], temperature=0, stream=True))
    assert finish == "tool_calls" and content == "Checking." and len(calls) == 1
    history = ASK + [{"role": "assistant", "content": content, "tool_calls": calls},
                     {"role": "tool", "tool_call_id": calls[0]["id"], "content": "9 C, rain"}]
    chunks = list(client.chat.completions.create(
        model="tool", messages=history, tools=[WEATHER_TOOL], temperature=0, max_tokens=3,
        stream=True, stream_options={"include_usage": True}))
    tok = GGUFTokenizer.from_gguf(tool_server.model)
    rendered = tok.apply_chat_template(
        [ASK[0], {"role": "assistant", "content": "Checking.", "tool_calls": [
            dict(calls[0], function={"name": "get_weather", "arguments": {"city": "Paris"}})]},
         {"role": "tool", "tool_call_id": calls[0]["id"], "content": "9 C, rain"}],
        tools=[WEATHER_TOOL])
    assert "<tool_response>\n9 C, rain\n</tool_response>" in rendered
    assert chunks[-1].usage.prompt_tokens == len(tok.encode(rendered))
    assert chunks[-1].usage.completion_tokens == 3


def choice_of(r):
    (c,) = r.choices
    return c
