"""Forced tool calls (`tool_choice` "required" or a named function): the grammar that limits the
answer to calls in the template's format, each call's arguments following its function's
`parameters` JSON schema.

For the `<tool_call>` format (server/tools.py) the answer is one call, or with
`parallel_tool_calls` one or more separated by a newline, each

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

written as a Lark grammar for the grammar engine (strata_dist/sampling/structured.py): the tags as the
model's tokens of that text where it has them (else as text), the fixed text around the arguments
as string literals, the arguments as the engine's `%json {schema}`, a JSON schema nested in the
Lark grammar at that place. The answer starts with the first call (no text, no thinking before it). The schema stays the root of its own nested grammar, so
its `$ref`s into its own `$defs` resolve as they would alone. The answer then goes through the
same parser as a free one (`tool_calls`, streamed deltas, `finish_reason: "tool_calls"`)."""
from __future__ import annotations

import json

from protocol.messages import MAX_GRAMMAR_BYTES

from ..sampling.structured import JSON_DEFAULTS, GrammarError, check_grammar, engine_tokenizer
from ..gguf_file.tokenizer import GGUFTokenizer
from .tools import CLOSE_TAG, OPEN_TAG, ToolRequestError, ToolUse

# A function without `parameters` takes none: its arguments are the empty object.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# between two calls of one answer, as the template writes an assistant's calls back
CALL_SEPARATOR = "\n"


def forced_call_grammar(use: ToolUse, tok: GGUFTokenizer) -> str:
    """The Lark grammar of the answer `use` forces ("" when the model chooses), checked against
    the model's tokenizer. A tool whose schema the engine refuses is a ToolRequestError naming
    it (`tools[i].function.parameters`, the engine's reason in the message)."""
    if not use.forced:
        return ""
    rules = []
    tags = (_tag(OPEN_TAG, tok), _tag(CLOSE_TAG, tok))
    for i in use.forced:
        rule = _call_rule(i, use.tools[i]["function"], tags)
        try:     # alone first, so that a refusal names its tool
            check_grammar("lark", f"start: {rule}", tok)
        except GrammarError as e:
            raise _refused(i, use.tools[i]["function"]["name"], str(e)) from None
        rules.append(f"call_{i}: {rule}")
    calls = " | ".join(f"call_{i}" for i in use.forced)
    start = f"start: call ({json.dumps(CALL_SEPARATOR)} call)*" if use.parallel else "start: call"
    grammar = "\n".join([start, f"call: {calls}", *rules]) + "\n"
    size = len(grammar.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise ToolRequestError("tools", f"the grammar of the calls 'tools' and 'tool_choice' force "
                                        f"is {size} bytes (the schemas of the tools it may call); "
                                        f"at most {MAX_GRAMMAR_BYTES} are allowed")
    try:
        check_grammar("lark", grammar, tok)
    except GrammarError as e:
        raise ToolRequestError("tools", f"the grammar of the calls 'tools' and 'tool_choice' force "
                                        f"is refused by the grammar engine: {e}",
                               "invalid_grammar") from None
    return grammar


def _tag(text: str, tok: GGUFTokenizer) -> str:
    """A tag as a Lark item: the token of that text where the model has one the engine holds
    special (Qwen3's `<tool_call>`: the engine takes a token written `<…>` for a special token,
    which the tag's text written out does not match), else the text."""
    token_id = tok.tk.token_to_id(text)
    if token_id is not None and engine_tokenizer(tok).is_special_token(token_id):
        return f"<[{token_id}]>"
    return json.dumps(text)


def _call_rule(i: int, fn: dict, tags: tuple[str, str]) -> str:
    """One call of function `fn` (tools[i]) as a Lark rule's body, between `tags` (the open and
    the close tag as Lark items)."""
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise ToolRequestError(f"tools[{i}].function.parameters",
                               f"'tools[{i}].function.parameters' of {fn['name']!r} must be a JSON "
                               f"schema object, got {type(parameters).__name__}", "invalid_type")
    # no free whitespace, as in any structured answer (structured.py); the schema's own
    # options win
    own = parameters.get("x-guidance")
    options = dict(JSON_DEFAULTS, **own) if isinstance(own, dict) else JSON_DEFAULTS
    try:
        schema = json.dumps(dict(parameters, **{"x-guidance": options}), allow_nan=False)
    except (ValueError, RecursionError) as e:
        raise _refused(i, fn["name"], str(e)) from None
    head = f'\n{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": '
    tail = "}\n"
    # json.dumps writes a string as a Lark string literal (the same escapes)
    return f"{tags[0]} {json.dumps(head)} %json {schema} {json.dumps(tail)} {tags[1]}"


def _refused(i: int, name: str, reason: str) -> ToolRequestError:
    param = f"tools[{i}].function.parameters"
    return ToolRequestError(param, f"'{param}' (the tool {name!r}) is refused by the grammar "
                                   f"engine: {reason}", "invalid_grammar")
