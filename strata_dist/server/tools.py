"""Tool calls: the request's `tools`, `tool_choice` and tool messages checked, and the model's
tool-call output parsed into OpenAI's `tool_calls`, whole or as stream deltas.

The format follows the model's chat template. A template that writes `<tool_call>` asks the model
for one JSON object per call between `<tool_call>` and `</tool_call>` tags:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is the message's content. A block whose inside is not such an object (bad
JSON, no name, unterminated when the generation ends) stays in the content as it was written. The
whole-text parse is the stream parser fed the whole text, so both answers agree."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
TAGGED_JSON = "tagged_json"          # the only format known: the template names <tool_call>
TOOL_CHOICES = ("none", "auto", "required")


def tool_format(template_source: str | None) -> str | None:
    """The tool-call format a chat template asks the model for, or None when it has none."""
    if template_source and OPEN_TAG in template_source:
        return TAGGED_JSON
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolRequestError(ValueError):
    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


# ---- the request -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolUse:
    """What a chat request does with its tools: which the template shows the model, whether the
    answer is parsed for calls, and which tools (by index in `tools`) the answer must call, one or
    (`parallel`) more calls in a row (empty: the model chooses; server/tool_grammar.py)."""
    tools: list | None = None
    parse: bool = False
    forced: tuple[int, ...] = ()
    parallel: bool = True


def check_tools(body: dict, template_format: str | None) -> ToolUse:
    """The request's tools and `tool_choice`: "auto" (the default) shows the tools and parses
    the answer; "none" neither shows nor parses them; "required" constrains the answer to calls
    of any of the tools, {"type": "function", "function": {"name": N}} to calls of N
    (`parallel_tool_calls`, default true: one or more calls, false: exactly one). Refuses tools a
    template cannot show the model."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ToolRequestError("tools", "'tools' must be a list", "invalid_type")
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolRequestError(f"tools[{i}]", f"tools[{i}] must be {{'type': 'function', "
                                                  f"'function': {{'name': …, 'parameters': …}}}}")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError("parallel_tool_calls", f"'parallel_tool_calls' must be true or "
                                                      f"false, got {_shown(parallel)}", "invalid_type")
    forced = _forced(body.get("tool_choice"), tools or [])
    if body.get("tool_choice") == "none" or not tools:
        return ToolUse()
    if template_format is None:
        raise ToolRequestError("tools", "this model's chat template has no tool-call format (it "
                                        "never writes <tool_call>), so tools cannot be offered to "
                                        "the model; send the request without 'tools'",
                               "unsupported_parameter")
    return ToolUse(tools, True, forced, parallel is not False)


def _forced(choice: Any, tools: list) -> tuple[int, ...]:
    """The indexes of the tools `tool_choice` makes the answer call (empty: none forced)."""
    if choice is None or choice in ("none", "auto"):
        return ()
    if choice == "required":
        if not tools:
            raise ToolRequestError("tool_choice", "'tool_choice' 'required' needs 'tools' to call")
        return tuple(range(len(tools)))
    named = isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict)
    name = choice["function"].get("name") if named else None
    if not isinstance(name, str):
        raise ToolRequestError("tool_choice", f"'tool_choice' must be one of "
                                              f"{', '.join(TOOL_CHOICES)} or {{'type': 'function', "
                                              f"'function': {{'name': …}}}}, got {_shown(choice)}")
    found = tuple(i for i, t in enumerate(tools) if t["function"]["name"] == name)
    if not found:
        raise ToolRequestError("tool_choice.function.name", f"'tool_choice.function.name' "
                                                            f"{_shown(name)} is not one of the "
                                                            f"request's 'tools'")
    return found[:1]


def _shown(v: Any) -> str:
    try:
        text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    except (ValueError, RecursionError):
        text = type(v).__name__
    return repr(text if len(text) <= 200 else text[:197] + "...")


def check_message_tools(i: int, m: dict) -> dict:
    """A message's tool fields for the template: an assistant's `tool_calls` (arguments given as a
    JSON string become the object, as templates write them with `tojson`), a tool message's
    `tool_call_id`."""
    out = dict(m)
    calls = m.get("tool_calls")
    if calls is not None:
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise ToolRequestError(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls must be "
                                   f"a list, on an assistant message", "invalid_type")
        clean = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ToolRequestError(f"messages[{i}].tool_calls[{j}]",
                                       f"messages[{i}].tool_calls[{j}] must have function.name")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    pass          # not JSON: the template writes the string as given
            clean.append(dict(c, function=dict(fn, arguments=args)))
        out["tool_calls"] = clean
    if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise ToolRequestError(f"messages[{i}].tool_call_id", f"messages[{i}] (role tool) needs "
                               f"'tool_call_id', the id of the call it answers", "invalid_type")
    return out


# ---- the answer ------------------------------------------------------------------------------------

def _call_of(inside: str) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of one block's inside, None when it is not a call."""
    try:
        obj = json.loads(inside)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        args = {}
    if isinstance(args, str):
        return obj["name"], args
    if not isinstance(args, dict):       # OpenAI's arguments are an object
        return None
    try:
        return obj["name"], json.dumps(args, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None


def _prefix_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that begins `tag` (it may be the tag's start)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ToolCallStream:
    """Turns the generated text, in pieces of any size, into OpenAI chat deltas: `{"content": …}`
    for text outside the tags, and per call `{"tool_calls": [{index, id, type, function: {name,
    arguments: ""}}]}` then `{"tool_calls": [{index, function: {arguments}}]}`.

    Whitespace between content and a call (the model's newlines around the tags) is held back and
    dropped when a call follows it or ends the answer."""

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self.new_id = new_id
        self.pending = ""        # text not yet classified: a possible tag start, held whitespace
        self.inside: str | None = None   # the text of an open block, once its tag is seen
        self.gap = ""            # the whitespace before the open block (text again if no call)
        self.after_call = False  # whitespace right after a call is dropped
        self.calls: list[dict] = []

    def push(self, text: str) -> list[dict]:
        out: list[dict] = []
        self.pending += text
        while True:
            if self.inside is None:
                if self.after_call:
                    self.pending = self.pending.lstrip()
                    if not self.pending:
                        return out
                    self.after_call = False
                at = self.pending.find(OPEN_TAG)
                if at < 0:
                    keep = _prefix_tail(self.pending, OPEN_TAG)
                    ready = self.pending[:len(self.pending) - keep]
                    lead = len(ready) - len(ready.rstrip())     # trailing whitespace waits
                    emit = ready[:len(ready) - lead]
                    if emit:
                        out.append({"content": emit})
                    self.pending = self.pending[len(emit):]
                    return out
                before = self.pending[:at]
                kept = before.rstrip()
                if kept:
                    out.append({"content": kept})
                self.gap = before[len(kept):]
                self.inside = ""
                self.pending = self.pending[at + len(OPEN_TAG):]
            else:
                at = self.pending.find(CLOSE_TAG)
                if at < 0:
                    keep = _prefix_tail(self.pending, CLOSE_TAG)
                    self.inside += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    return out
                self.inside += self.pending[:at]
                self.pending = self.pending[at + len(CLOSE_TAG):]
                out.extend(self._close(self.inside))
                self.inside = None

    def _close(self, inside: str) -> list[dict]:
        call = _call_of(inside)
        if call is None:        # not a call: the block stays text, as written
            return [{"content": self.gap + OPEN_TAG + inside + CLOSE_TAG}]
        self.after_call = True
        name, args = call
        index = len(self.calls)
        self.calls.append({"id": self.new_id(), "type": "function",
                           "function": {"name": name, "arguments": args}})
        first = {"index": index, "id": self.calls[-1]["id"], "type": "function",
                 "function": {"name": name, "arguments": ""}}
        return [{"tool_calls": [first]},
                {"tool_calls": [{"index": index, "function": {"arguments": args}}]}]

    def finish(self) -> list[dict]:
        """The rest: an unterminated block stays text; whitespace held at the end is dropped
        after a call and kept otherwise."""
        rest = self.pending
        if self.inside is not None:
            rest = self.gap + OPEN_TAG + self.inside + self.pending
        self.inside, self.pending = None, ""
        if not rest or (self.calls and not rest.strip()):
            return []
        return [{"content": rest}]


def parse_tool_text(text: str, new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list]:
    """(content or None, tool_calls) of a whole answer: the stream parser's deltas, joined."""
    stream = ToolCallStream(new_id)
    deltas = stream.push(text) + stream.finish()
    content = "".join(d["content"] for d in deltas if "content" in d)
    return (content or None), stream.calls


def join_deltas(deltas: list[dict[str, Any]]) -> tuple[str | None, list]:
    """What a client assembles from stream deltas (tests and clients alike)."""
    content = ""
    calls: list[dict] = []
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls") or []:
            if c["index"] == len(calls):
                calls.append({"id": c["id"], "type": c["type"],
                              "function": {"name": c["function"]["name"], "arguments": ""}})
            calls[c["index"]]["function"]["arguments"] += c["function"].get("arguments") or ""
    return (content or None), calls
