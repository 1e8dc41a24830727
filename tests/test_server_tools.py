"""Tool calls. The parser alone: the model's `<tool_call>` blocks become OpenAI `tool_calls`, whole
or streamed in pieces of any size (each answer is split at every character and must assemble to
the whole-text parse), and the request's tools and tool messages are checked. End to end: the
official client against `strata-launch --port` on a CPU rank whose model answers with a tool call
(server_helpers.write_tool_calling_model), streaming and not, and the call's round trip."""
from __future__ import annotations

import itertools
import json

import openai
import pytest

from server_helpers import TOOL_ANSWER, ServerProcess, write_tool_calling_model
from strata_dist.server.openai_api import ApiError, Limits, parse_chat
from strata_dist.synth import write_synthetic
from strata_dist.tokenizer import GGUFTokenizer
from strata_dist.server.tools import (TAGGED_JSON, ToolCallStream, ToolRequestError, check_message_tools,
                                      check_tools, join_deltas, parse_tool_text, tool_format)

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


def test_check_tools():
    assert check_tools({}, None) == (None, False)
    assert check_tools({"tools": [TOOL]}, TAGGED_JSON) == ([TOOL], True)
    assert check_tools({"tools": [TOOL], "tool_choice": "none"}, TAGGED_JSON) == ([TOOL], False)
    assert check_tools({"tools": [TOOL], "tool_choice": "auto"}, TAGGED_JSON) == ([TOOL], True)
    with pytest.raises(ToolRequestError, match="template has no tool-call format") as e:
        check_tools({"tools": [TOOL]}, None)
    assert e.value.param == "tools"
    for bad, param in (({"tools": {}}, "tools"), ({"tools": [{"type": "function"}]}, "tools[0]"),
                       ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
                       ({"tools": [TOOL], "tool_choice": {"type": "function",
                                                          "function": {"name": "x"}}}, "tool_choice")):
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
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tool", messages=ASK, tools=[WEATHER_TOOL],
                                       tool_choice="required")
    assert e.value.body["param"] == "tool_choice"


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
